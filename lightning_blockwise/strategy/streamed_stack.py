"""The decoder layers of a blockwise run: rematerialized, their blocks streamed by a replaceable streamer."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from lightning_blockwise.architectures import adapter_parameters
from lightning_blockwise.planning import format_gb
from lightning_blockwise.replay import remat
from lightning_blockwise.residency.activations import ActivationOffload
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.placement import HostCopy
from lightning_blockwise.residency.stream_observer import StreamObserver
from lightning_blockwise.residency.streamer import BlockStreamer

# NOTE [ Resident prefix ]
# The streamer's slot bookkeeping assumes it alone binds every streamed block: a block
# it evicts is rebound to its host slab, a prefetched one to a slot view. A prefix block
# bound to a device copy behind its back would be rebound under a live resident graph,
# whose bitsandbytes quant states are read at backward time (NOTE [ Graphs do not
# outlive residency ] in replay/remat.py). So the run's streamer is closed and a streamer that
# keeps the prefix blocks resident (the device copies) drives the context; on exit that
# one is closed as well and a fresh streamer of the run's residency, bound as after setup,
# takes over. Device memory meanwhile: the run's slots and resident blocks plus the prefix.


class StreamedStack:
    """Rematerializing decoder layers fed by a :class:`~lightning_blockwise.residency.streamer.BlockStreamer`.

    Owns the streamer, which it replaces when the blocks kept resident change
    (:meth:`restream`, :meth:`resident_prefix`); every streamer it builds reports to
    :attr:`observer` (NOTE [ Stream observer ] in residency/streamer.py).

    Args:
        layers: The decoder layers, in order.
        plan: Their blocks.
        host_copy: The host arena the blocks stream from.
        device: The compute device.
        prefetch_depth: Blocks copied ahead of the one in use.
        resident: Blocks kept on the device for the whole run.
        kept: Blocks whose layers keep their graphs from the forward to the backward instead of
            recomputing them (NOTE [ Kept activations ] in planning/memory.py): resident ones run
            with plain autograd, streamed ones through :class:`~lightning_blockwise.replay.kept.KeptFunction`.
        offloaded_layers: With offload on (:meth:`offload_inputs`), how many layers, the first ones, save their
            inputs in host memory; the others keep them on the device (NOTE [ Split layer inputs ] in
            residency/activations.py). ``None``: every layer.
        checkpoint_every: Keep every this many layers' inputs only and replay the others in the backward
            (NOTE [ Input checkpoints ] in replay/segments.py); ``None``: keep every layer's input.
        attention: Blocks whose recomputed layers keep their attention outputs for the recompute (NOTE [ Kept
            attention ] in replay/kept_attention.py).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        plan: BlockPlan,
        host_copy: HostCopy,
        device: torch.device,
        prefetch_depth: int,
        resident: Iterable[int] = (),
        kept: Iterable[int] = (),
        offloaded_layers: int | None = None,
        checkpoint_every: int | None = None,
        attention: Iterable[int] = (),
    ) -> None:
        self.layers = list(layers)
        self.plan = plan
        self.host_copy = host_copy
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.resident = tuple(sorted(resident))
        self.kept = tuple(sorted(kept))
        self.attention = tuple(sorted(attention))
        n = len(self.layers)
        self.offloaded_layers = n if offloaded_layers is None else offloaded_layers
        if not 0 <= self.offloaded_layers <= n:
            raise ValueError(f"offloaded_layers={offloaded_layers} must be between 0 and the {n} decoder layers.")
        if checkpoint_every is not None and checkpoint_every < 2:
            raise ValueError(f"checkpoint_every={checkpoint_every} must be at least 2 (or None: every input kept).")
        self.checkpoint_every = checkpoint_every
        #: Kept layers whose Hugging Face gradient checkpointing was on, switched off while kept; put back at close.
        self._checkpointing_off: list[nn.Module] = []
        self._observer = StreamObserver()
        self.offload: ActivationOffload | None = None
        self.streamer: BlockStreamer | None = self._new_streamer(self.resident)

    @property
    def observer(self) -> StreamObserver:
        """What every streamer of this stack reports its copies, waits and layer runs to."""
        return self._observer

    def set_observer(self, observer: StreamObserver | None) -> None:
        """Hand ``observer`` (``None``: the no-op one) to the current streamer and every later one."""
        self._observer = StreamObserver() if observer is None else observer
        if self.streamer is not None:
            self.streamer.observer = self._observer

    def install(self) -> None:
        """Install the rematerializing forward on every layer but those of resident kept blocks (plain autograd).

        Layers of streamed kept blocks get it too, keeping their graphs (NOTE [ Kept graphs of streamed blocks ]).
        """
        assert self.streamer is not None
        streamed_kept = {i for block in self.kept if block not in self.resident for i in self.plan.layers_of(block)}
        to_host = range(self.offloaded_layers)
        remat.install(
            self.layers,
            self._layer_params(),
            self.streamer,
            self.offload,
            keep=streamed_kept,
            to_host=to_host,
            checkpoint_every=self.checkpoint_every,
            keep_attention={i for block in self.attention for i in self.plan.layers_of(block)},
        )
        # NOTE [ Kept activations ] in planning/memory.py: a resident block never moves, so plain autograd is safe.
        kept = [self.layers[i] for block in self.kept if block in self.resident for i in self.plan.layers_of(block)]
        remat.uninstall(kept)
        for layer in kept:
            # Kept means not recomputed: not by Hugging Face's checkpointing either (on after
            # `gradient_checkpointing_enable()`, as `prepare_model_for_kbit_training` does), exact either way.
            if vars(layer).get("gradient_checkpointing"):
                layer.gradient_checkpointing = False
                self._checkpointing_off.append(layer)

    def offload_inputs(self, slab_bytes: int | None) -> None:
        """Keep layer inputs in host slabs of ``slab_bytes`` between forward and backward; ``None``: on the device.

        Turning it on allocates a slab per offloaded layer at once (:attr:`offloaded_layers`; refused before
        allocation when the host RAM is short); raising ``slab_bytes`` later allocates larger ones
        (NOTE [ Layer-input offload ] in residency/activations.py).
        """
        if slab_bytes is None or self.offloaded_layers == 0:
            # Nothing to offload: every input saved with the layer's graph, as without offload.
            if self.offload is not None:
                self.offload.close()
                self.offload = None
        elif self.offload is None:
            pin = self.device.type == "cuda"
            self.offload = ActivationOffload(self.device, self._host_saves(), slab_bytes, pin=pin)
        else:
            self.offload.reserve(slab_bytes)
        if self.streamer is not None:
            self.install()

    def set_input_levels(
        self,
        offloaded_layers: int | None,
        checkpoint_every: int | None,
        resident: Iterable[int] | None = None,
        kept: Iterable[int] | None = None,
        attention: Iterable[int] | None = None,
    ) -> None:
        """Offload the first ``offloaded_layers`` layers' inputs (``None``: all) and keep one in ``checkpoint_every``.

        Between steps, where a re-plan moves the layer inputs (NOTE [ Where layer inputs wait ] in
        planning/input_choice.py): the host slabs are freed (the re-plan counted them as room; :meth:`offload_inputs`
        allocates the new ones), and a new ``checkpoint_every`` or new ``resident``/``kept`` blocks (default: the same)
        get one new streamer, which prefetches along the new step order and copies the resident blocks once.
        """
        # Which layers keep their attention outputs is the wrappers' alone: every path below reinstalls them.
        self.attention = self.attention if attention is None else tuple(sorted(attention))
        self.offload_inputs(None)
        self.offloaded_layers = len(self.layers) if offloaded_layers is None else offloaded_layers
        resident = self.resident if resident is None else tuple(sorted(resident))
        kept = self.kept if kept is None else tuple(sorted(kept))
        if (checkpoint_every, resident, kept) != (self.checkpoint_every, self.resident, self.kept):
            self.checkpoint_every = checkpoint_every
            self.restream(resident, kept)

    def restream(self, resident: Iterable[int] | None = None, kept: Iterable[int] | None = None) -> None:
        """Replace the streamer by a fresh one keeping ``resident`` (default: the same blocks) on the device.

        ``kept`` (default: the same blocks) are the blocks whose layers keep their graphs.
        Resident blocks are copied from the host arena again, so this also picks up bytes
        written into the arena since (a checkpoint's frozen base).
        """
        if resident is not None:
            self.resident = tuple(sorted(resident))
        if kept is not None:
            self.kept = tuple(sorted(kept))
        self._close_streamer()
        self.streamer = self._new_streamer(self.resident)
        self.install()

    def prefix_bytes(self, num_blocks: int, layer_graph: int) -> int:
        """Device bytes that running the first ``num_blocks`` blocks resident adds (:meth:`resident_prefix`).

        The slabs of those blocks not resident already, plus ``layer_graph`` bytes per layer: a
        resident layer keeps its graph from the forward to the backward.
        """
        blocks = [b for b in range(num_blocks) if b not in self.resident]
        # Kept blocks' graphs are in the run's planned peak already (NOTE [ Kept activations ]).
        layers = sum(len(self.plan.layers_of(b)) for b in range(num_blocks) if b not in self.kept)
        return sum(self.host_copy.layouts[b].nbytes for b in blocks) + layers * layer_graph

    @contextmanager
    def all_rematerialized(self) -> Iterator[None]:
        """Rematerialize every layer while the context is open, the kept blocks' too.

        ParityCheck's blockwise arm (NOTE [ Prefix parity ] in verification/check.py): a kept layer runs
        as in resident training, so comparing it with the reference would check nothing.
        """
        kept = self.kept
        self.kept = ()
        try:
            self.install()
            yield
        finally:
            self.kept = kept
            self.install()

    @contextmanager
    def resident_prefix(self, num_blocks: int) -> Iterator[None]:
        """Run the layers of the first ``num_blocks`` blocks the resident way while the context is open.

        See :meth:`lightning_blockwise.BlockwiseStrategy.resident_prefix` and NOTE [ Resident prefix ].

        Raises:
            ValueError: If ``num_blocks`` is out of range.
        """
        if not 0 <= num_blocks <= self.plan.num_blocks:
            raise ValueError(
                f"BlockwiseStrategy.resident_prefix: num_blocks={num_blocks} must be between 0 and the"
                f" {self.plan.num_blocks} blocks of the plan."
            )
        prefix = [layer for block in range(num_blocks) for layer in self.plan.layers_of(block)]
        self._close_streamer()
        self.streamer = self._new_streamer({*self.resident, *range(num_blocks)})
        try:
            self.install()
            remat.uninstall([self.layers[i] for i in prefix])
            yield
        finally:
            self.restream()

    def describe(self, model_type: str) -> str:
        """One line for the log: the layers and their blocks, the streamer's slots, the host arena (the plan: the rest).

        Args:
            model_type: The Hugging Face ``config.model_type`` the layers are of.
        """
        assert self.streamer is not None
        arena = self.host_copy.arena
        return (
            f"{len(self.layers)} {model_type} decoder layers in {self.plan.num_blocks} blocks of up to"
            f" {self.plan.block_size}, {len(self.streamer.streamed)} streamed through {len(self.streamer.slots)} slots"
            f" on {self.device}; host arena {format_gb(arena.nbytes, digits=3)}"
            f" ({format_gb(arena.bytes_needed, digits=3)} of tensors){', pinned' if arena.pinned else ''}"
        )

    def close(self) -> None:
        """Give every layer its own forward (and checkpointing flag) back and free the streamer's device memory."""
        remat.uninstall(self.layers)
        for layer in self._checkpointing_off:
            layer.gradient_checkpointing = True
        self._checkpointing_off = []
        self._close_streamer()
        self.offload_inputs(None)

    def _close_streamer(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None

    def _host_saves(self) -> int:
        """Inputs a step saves in host memory: the offloaded layers', of those that keep theirs."""
        every = self.checkpoint_every
        return self.offloaded_layers if every is None else -(-self.offloaded_layers // every)

    def _new_streamer(self, resident: Iterable[int]) -> BlockStreamer:
        resident = sorted(resident)
        streamer = BlockStreamer(
            self.plan,
            self.host_copy.layouts,
            self.host_copy.arena.slabs,
            self.device,
            self.prefetch_depth,
            resident=resident,
            checkpoint_every=self.checkpoint_every,
            # Streamed blocks whose layers keep graphs come back to their forward slot (NOTE [ Slot affinity ]).
            homebound=[block for block in self.kept if block not in resident],
        )
        streamer.observer = self._observer
        return streamer

    def _layer_params(self) -> list[list[nn.Parameter]]:
        return [[p for p in adapter_parameters(layer).values() if p.requires_grad] for layer in self.layers]


__all__ = ["StreamedStack"]
