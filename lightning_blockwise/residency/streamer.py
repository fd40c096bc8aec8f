"""Streaming blocks of frozen weights from the host arena through a fixed pool of device slots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from typing_extensions import override

from lightning_blockwise.residency.base import Pass, Residency
from lightning_blockwise.residency.binding import views
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.layout import BlockLayout
from lightning_blockwise.residency.step_order import step_order
from lightning_blockwise.residency.stream_observer import StreamObserver

# NOTE [ Slot reuse ]
# A slot is refilled only after every kernel that reads the block it holds has finished.
# Every ``release`` records the slot's ``freed`` event on the compute stream right behind
# the layer's kernels (not only a block's last layer in a pass: a replay of input checkpoints
# may stop inside a block); a copy into the slot first makes the copy stream wait on it.
# A layer reads its block only between ``acquire`` and ``release`` (remat.py keeps each
# recompute graph inside that span, NOTE [ Graphs do not outlive residency ]), so the
# event covers every read. In the other direction,
# ``acquire`` makes the compute stream wait on the slot's ``copied`` event before the
# layer's first kernel. Slots are allocated once and never freed while streaming, so
# the caching allocator never hands their memory to anything else and no
# ``record_stream`` is needed.
#
# NOTE [ Reused events ]
# A stream that waits on an event waits for the work of that event's most recent record at
# the time the wait is issued; recording the event again later changes nothing for waits
# already issued (``cudaStreamWaitEvent``: "Once this call has returned, any functions
# (including cudaEventRecord() and cudaEventDestroy()) may be called on event again, and
# subsequent calls will not have any effect on stream"). Recording one event again is
# therefore, for every wait, the same as replacing it with a fresh one, as long as nothing
# waits on an older record later. The streamer only ever waits on the latest copy into a
# slot and the latest release of a slot's block (NOTE [ Slot reuse ]), so each slot keeps
# one ``copied`` and one ``freed`` event for the whole run: the waits are those fresh events
# gave, without a ``cudaEventCreate`` and ``cudaEventDestroy`` per copy and per release.
# The layer-input offload (residency/activations.py) gives its events back to a free list
# once every wait on them has been issued.
#
# NOTE [ Prefetch order ]
# Blocks are needed 0..K-1 in the forward and K-1..0 in the backward. On each acquire the
# streamer starts copies for the next ``prefetch_depth`` blocks of the step's order (the
# window: the block in use and those). With ``prefetch_depth + 1`` slots the blocks that end
# the forward are still resident when the backward starts at them, and the blocks that end
# the backward are resident when the next forward starts: no block is loaded twice in a row.
# With input checkpoints every ``k`` layers (NOTE [ Input checkpoints ] in replay/segments.py)
# the backward's order is no longer a sweep: before its layers ``c+k-1..c`` run backward, a
# replay runs ``c..c+k-2`` forward, so blocks are needed ``..., c+k`` (backward), ``c..c+k-2``
# (replay), ``c+k-1..c`` (backward), ``c-k..`` (replay), ... ``step_order`` gives that order
# and the window follows it, so the replay's first blocks are copied while the layer above the
# segment still runs. An evicted block is rebound to its host slab (no copy), so every module
# tensor always names memory that holds its value: a state_dict, a checkpoint or a stray read
# after eviction sees the right bytes.
#
# NOTE [ Slot affinity ]
# Each streamed block has one home slot, its position among the streamed blocks modulo the
# number of slots. A window of ``prefetch_depth + 1`` consecutive streamed blocks covers
# every slot once, so in a sweep the home slot never holds a block the window still needs
# and every copy goes there: the least recently used slot, as an LRU would pick. What the
# home slot buys: a block comes back to the very addresses it had in the forward. A kept
# layer of a streamed block (NOTE [ Kept graphs of streamed blocks ] in replay/kept.py)
# holds, in its graph, views of its block's slot made in the forward (bitsandbytes'
# ``MatMul4Bit`` keeps the packed weight so); once ``acquire`` has brought the block back
# for the backward, those views read its bytes again. The replays of input checkpoints
# break the sweep: a window may hold two blocks of one home slot. Then a block goes to the
# least recently used slot whose block the window does not need, except a block with kept
# layers (``homebound``), which only ever goes home: it waits for its own acquire rather than
# be prefetched, and then evicts whatever is there (never the block in use: that is itself).
#
# NOTE [ Stream observer ]
# The streamer tells its ``observer`` where copies, waits and layer runs begin and end, at
# the point in stream order each happens: the copy hooks run while the copy stream is
# current, the others while the compute stream is. An observer can record a CUDA event
# right there (or read a host clock on the CPU) and read the timings later, without a
# synchronize. The default observer does nothing, so the streamer needs no ``if`` for it.


@dataclass
class TransferStats:
    """Host-to-device traffic since the last :meth:`BlockStreamer.reset_stats`."""

    copies: int = 0
    bytes: int = 0


class BlockStreamer(Residency):
    """Makes each block usable on ``device`` from its host slab, ahead of need.

    On CUDA, copies run on a dedicated stream and are ordered with events
    (NOTE [ Slot reuse ]); on the CPU the same slots are filled synchronously, which keeps
    packing, slot reuse and rebinding exercised without a GPU.

    Args:
        plan: The block plan.
        layouts: Each block's layout.
        host_slabs: Each block's slab in the host arena.
        device: The compute device.
        prefetch_depth: Blocks copied ahead of the one in use.
        resident: Blocks copied to the device once and kept there for the whole run.
        checkpoint_every: Layer inputs kept every this many layers, the others replayed in the backward
            (NOTE [ Input checkpoints ] in replay/segments.py); it decides the backward's order. ``None``: all kept.
        homebound: Blocks whose layers keep their graphs to the backward: copied to their home slot only
            (NOTE [ Slot affinity ]).
    """

    def __init__(
        self,
        plan: BlockPlan,
        layouts: Sequence[BlockLayout],
        host_slabs: Sequence[Tensor],
        device: torch.device,
        prefetch_depth: int,
        resident: Sequence[int] = (),
        checkpoint_every: int | None = None,
        homebound: Sequence[int] = (),
    ) -> None:
        self.plan = plan
        self.layouts = list(layouts)
        self.device = device
        self.prefetch_depth = prefetch_depth
        self.checkpoint_every = checkpoint_every
        self.homebound = frozenset(homebound)
        self._host_slabs = list(host_slabs)
        self._host_views = [views(layout, slab) for layout, slab in zip(layouts, host_slabs, strict=True)]
        self.resident = frozenset(resident)
        self.streamed = [b for b in range(plan.num_blocks) if b not in self.resident]
        self._resident_slabs = {b: self._host_slabs[b].to(device) for b in sorted(self.resident)}
        for block, slab in self._resident_slabs.items():
            self._bind(block, views(self.layouts[block], slab))
        slot_bytes = max((self.layouts[b].nbytes for b in self.streamed), default=0)
        num_slots = min(prefetch_depth + 1, len(self.streamed))
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(num_slots)]
        self._slot_views: dict[tuple[int, int], list[Tensor]] = {}
        self._slot_block: list[int | None] = [None] * num_slots
        self._block_slot: dict[int, int] = {}
        # NOTE [ Slot affinity ].
        self._home = {block: index % num_slots for index, block in enumerate(self.streamed)} if num_slots else {}
        self._cuda = device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(device) if self._cuda else None
        self._copied: list[torch.cuda.Event | None] = [None] * num_slots
        self._freed: list[torch.cuda.Event | None] = [None] * num_slots
        # When each slot's block was last acquired, for the least recently used slot (NOTE [ Slot affinity ]).
        self._used = [0] * num_slots
        self._clock = 0
        self.stats = TransferStats()
        self.observer = StreamObserver()

    def reset_stats(self) -> TransferStats:
        """Return the transfer counters and start new ones."""
        stats, self.stats = self.stats, TransferStats()
        return stats

    @override
    def acquire(self, layer: int, phase: Pass) -> None:
        block = self.plan.block_of(layer)
        if block in self.resident:
            self.observer.layer_started(layer, phase)
            return
        window = self._window(layer, phase)
        if block not in self._block_slot:
            self._fetch(block, window)
        slot = self._block_slot[block]
        self._clock += 1
        self._used[slot] = self._clock
        if self._cuda and self._copied[slot] is not None:
            self.observer.wait_started(block)
            torch.cuda.current_stream(self.device).wait_event(self._copied[slot])
            self.observer.wait_finished(block)
        for ahead in window[1:]:
            if ahead not in self._block_slot and (ahead not in self.homebound or self._home_is_free(ahead, window)):
                self._fetch(ahead, window)
        # After the prefetches: on the CPU they are synchronous copies, not part of the layer's run.
        self.observer.layer_started(layer, phase)

    @override
    def release(self, layer: int, phase: Pass) -> None:
        self.observer.layer_finished(layer, phase)
        block = self.plan.block_of(layer)
        if block in self.resident:
            return
        if self._cuda:
            # Behind every layer's kernels (NOTE [ Slot reuse ]).
            slot = self._block_slot[block]
            # Recorded again, not made anew (NOTE [ Reused events ]): copies wait on the latest release only.
            freed = self._freed[slot] or torch.cuda.Event()
            freed.record(torch.cuda.current_stream(self.device))
            self._freed[slot] = freed

    def _window(self, layer: int, phase: Pass) -> list[int]:
        """The block of ``layer`` and the next ``prefetch_depth`` streamed blocks of the step's order.

        See NOTE [ Prefetch order ].
        """
        window = [self.plan.block_of(layer)]
        for later, _ in step_order(layer, phase, self.plan.num_layers, self.checkpoint_every):
            block = self.plan.block_of(later)
            if block not in self.resident and block not in window:
                window.append(block)
                if len(window) > self.prefetch_depth:
                    break
        return window

    def _home_is_free(self, block: int, window: Sequence[int]) -> bool:
        return self._slot_block[self._home[block]] not in window

    def _slot_for(self, block: int, window: Sequence[int]) -> int:
        """Where ``block`` goes: home, unless the window needs the block there (NOTE [ Slot affinity ])."""
        home = self._home[block]
        if block in self.homebound or self._home_is_free(block, window):
            return home
        free = [slot for slot, held in enumerate(self._slot_block) if held not in window]
        return min(free, key=lambda slot: self._used[slot])

    def _fetch(self, block: int, window: Sequence[int]) -> None:
        """Copy ``block`` into a slot (NOTE [ Slot affinity ]), evicting the block there."""
        slot = self._slot_for(block, window)
        evicted = self._slot_block[slot]
        if evicted is not None:
            self._bind(evicted, self._host_views[evicted])
            del self._block_slot[evicted]
        layout = self.layouts[block]
        host = self._host_slabs[block]
        target = self.slots[slot][: layout.nbytes]
        if self._cuda:
            assert self._copy_stream is not None
            with torch.cuda.stream(self._copy_stream):
                if self._freed[slot] is not None:
                    self._copy_stream.wait_event(self._freed[slot])
                self.observer.copy_started(block)
                target.copy_(host, non_blocking=True)
                self.observer.copy_finished(block, layout.nbytes)
                # Recorded again (NOTE [ Reused events ]): `acquire` waits on the latest copy into the slot only.
                copied = self._copied[slot] or torch.cuda.Event()
                copied.record(self._copy_stream)
            self._copied[slot] = copied
        else:
            self.observer.copy_started(block)
            target.copy_(host)
            self.observer.copy_finished(block, layout.nbytes)
        self.stats.copies += 1
        self.stats.bytes += layout.nbytes
        self._slot_block[slot] = block
        self._block_slot[block] = slot
        key = (block, slot)
        if key not in self._slot_views:
            self._slot_views[key] = views(layout, self.slots[slot])
        # Binding before the copy lands is safe: nothing reads the block before `acquire`
        # has made the compute stream wait for `copied`.
        self._bind(block, self._slot_views[key])

    def _bind(self, block: int, block_views: list[Tensor]) -> None:
        layout = self.layouts[block]
        for entry, view in zip(layout.entries, block_views, strict=True):
            for binding in entry.bindings:
                binding.rebind(view)

    @override
    def close(self) -> None:
        """Bind every block back to its host slab and free the device memory and the copy stream."""
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
        for block in [*self._block_slot, *self._resident_slabs]:
            self._bind(block, self._host_views[block])
        self._block_slot.clear()
        self._resident_slabs.clear()
        self._slot_block = [None] * len(self.slots)
        self._slot_views.clear()
        self.slots = []
        self._copy_stream = None
        self._copied = []
        self._freed = []
