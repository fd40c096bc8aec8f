"""Where each part of the module lives during a blockwise run, and the host copy a model carries.

Decoder layers' frozen tensors: the host arena (streamed, or copied once to the device for
blocks the VRAM budget keeps resident), held with its block layouts in a :class:`HostCopy`
that travels with the Hugging Face model (:func:`attach_host_copy`, :func:`host_copy_of`).
The frozen, untied input embedding: host memory (NOTE [ Host embedding lookup ]). Everything
else (adapters, the LM head, norms, rotary tables, bitsandbytes' 4-bit code tables): the
compute device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_blockwise.architectures import DecoderStack, adapter_parameters
from lightning_blockwise.compat.bitsandbytes import move_code_tables
from lightning_blockwise.residency.arena import HostArena
from lightning_blockwise.residency.binding import bind, bind_checked, pack, unbound
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.layout import BlockLayout, layout_block
from lightning_blockwise.residency.shared_arena import ArenaClaim
from lightning_blockwise.residency.sharing import attach_or_own, serve_or_release

# The attribute of the Hugging Face model that holds its host copy, so that the copy lives exactly
# as long as the model (NOTE [ Exact-size pinned memory ] in residency/arena.py). Read and written only by
# `attach_host_copy` and `host_copy_of`.
_HOST_COPY_ATTR = "_blockwise_host_copy"


@dataclass(eq=False)
class HostCopy:
    """The host arena of one model's decoder layers and the block layouts laid out in it.

    Attributes:
        layer_ranges: The decoder layers of each block.
        layouts: Each block's layout.
        arena: The host arena; ``arena.slabs[b]`` holds block ``b``.
        block_size: The decoder layers per block it was packed for (the last block may hold fewer).
        serving: The claim through which this process serves the arena to others on the machine, while the copy
            lives (``load_blockwise(share=True)``, NOTE [ One host copy per machine ] in shared_arena.py).
    """

    layer_ranges: tuple[range, ...]
    layouts: tuple[BlockLayout, ...]
    arena: HostArena
    block_size: int
    serving: ArenaClaim | None = None

    def __del__(self) -> None:
        # The serving thread keeps the claim, and through it the arena, alive: stop it with the copy.
        if self.serving is not None:
            self.serving.release()

    def prepare_base_write(self, owner: str) -> None:
        """Make ready to write a checkpoint's frozen base into this copy, or refuse while others read it.

        A copy this process serves to others (NOTE [ One host copy per machine ] in shared_arena.py) has
        one writer or none: while a peer it served runs, writing would change that peer's weights under
        it, so this refuses; once none runs, it stops serving, since the copy is about to hold another
        base than the one late-comers would ask for (they load their own). Call it only for a checkpoint
        that carries the base; a copy mapped from another process is refused where it is loaded.

        Args:
            owner: How the error names the caller, e.g. ``"BlockwiseStrategy"``.

        Raises:
            MisconfigurationException: If processes this one served its copy to still run.
        """
        if self.serving is None:
            return
        peers = self.serving.peers()
        if not peers:
            self.serving.release()  # no new peer from here on; one served meanwhile is counted below
            peers = self.serving.peers()
            self.serving = None
        if peers:
            raise MisconfigurationException(
                f"{owner}: this checkpoint carries the frozen base, to be written into the host copy, but this"
                f" process shares that copy with {len(peers)} other process(es) (pids {peers[:8]}), which would"
                " then train on this checkpoint's base without knowing it (NOTE [ One host copy per machine ])."
                " Load it after they finish, or give this process a copy of its own: `load_blockwise(...,"
                " share=False)` or `BlockwiseStrategy(share_host_copy=False)`."
            )

    def is_bound(self) -> bool:
        """Whether every block still reads from its slab (nothing moved the model since)."""
        return all(not unbound(layout, slab) for layout, slab in zip(self.layouts, self.arena.slabs, strict=True))

    def unfit_for(self, plan: BlockPlan, pin: bool) -> str | None:
        """Why this copy cannot serve a run of ``plan`` (page-locked if ``pin``), or ``None`` if it can.

        Args:
            plan: The run's blocks.
            pin: Whether the run copies from the arena to a CUDA device, which needs it page-locked.
        """
        if self.layer_ranges != _layer_ranges(plan):
            return (
                f"it was packed in blocks of {self.block_size} layers but the strategy's `block_size` is"
                f" {plan.block_size}; pass the same `block_size` to `load_blockwise` and the strategy to avoid it"
            )
        if not self.is_bound():
            return (
                "some of its tensors were replaced since it was packed (the model was moved, e.g. with `.to()`);"
                " leave the model where `load_blockwise` put it and let the strategy place it"
            )
        if pin and not self.arena.pinned:
            return (
                "it is not page-locked and the strategy copies it to a CUDA device; load the model with"
                " `load_blockwise(..., device=<that device>)` to page-lock it"
            )
        return None


def attach_host_copy(model: nn.Module, copy: HostCopy) -> None:
    """Hand ``copy`` over with ``model``: the host copy of its decoder layers, for the strategy to adopt.

    The model keeps the copy, and so the arena its frozen tensors are views of, alive as long as
    itself. :func:`load_blockwise` attaches the copy it packs, and the strategy the one it makes.

    Args:
        model: The Hugging Face model whose decoder layers are bound to ``copy``.
        copy: The host copy.

    Example::

        attach_host_copy(model, copy)
        assert host_copy_of(model) is copy
    """
    vars(model)[_HOST_COPY_ATTR] = copy


def host_copy_of(model: nn.Module) -> HostCopy | None:
    """The host copy attached to ``model`` (by :func:`load_blockwise` or an earlier run), or ``None``."""
    return vars(model).get(_HOST_COPY_ATTR)


def detach_host_copy(model: nn.Module) -> HostCopy | None:
    """Let ``model`` forget its host copy, and return it (``None`` if it had none).

    For a model moved off the arena (``model.to("cuda")``) before another blockwise run: that run would
    pack a new arena while the model still holds the old one, two arenas in host RAM at once (the
    strategy warns). Detached, the old arena is freed once nothing else holds it (the earlier run's
    trainer and strategy included).
    """
    return vars(model).pop(_HOST_COPY_ATTR, None)


def host_copy(
    stack: DecoderStack,
    plan: BlockPlan,
    pin: bool,
    share_key: Callable[[Sequence[BlockLayout]], str | None] | None = None,
) -> HostCopy:
    """The model's host copy for ``plan``: the one attached to it if it fits, or a new one packed block by block.

    A copy that does not fit is repacked with a warning that says why. Packing a block and
    binding its layers to the slab drops the previous copies of its tensors (on the GPU after
    a standard load), one block at a time, so memory does not peak. With ``share_key``, a new
    copy is shared with the other processes of the machine that pack the same base (NOTE [ One
    host copy per machine ] in shared_arena.py): the first packs and serves it, the others check
    every block's bytes against it and bind to its read-only pages.

    Args:
        stack: The model's decoder stack.
        plan: The run's blocks.
        pin: Page-lock the arena for copies to a CUDA device.
        share_key: What names the base, from the blocks' layouts (``None``, or returning ``None``: not shared).

    Raises:
        MisconfigurationException: If the arena does not fit the available host RAM (checked
            before anything is allocated).
        RuntimeError: If a shared copy's bytes differ from this model's.
    """
    existing = host_copy_of(stack.model)
    if existing is not None:
        reason = existing.unfit_for(plan, pin)
        if reason is None:
            return existing
        rank_zero_warn(
            f"BlockwiseStrategy is repacking the model's host copy: {reason}. Host RAM holds the old and the new"
            " arena until the repack ends."
        )
    ranges = _layer_ranges(plan)
    layouts = tuple(layout_block([stack.layers[i] for i in layers], first_index=layers[0]) for layers in ranges)
    sizes = [layout.nbytes for layout in layouts]
    name = share_key(layouts) if share_key is not None and hasattr(os, "memfd_create") else None
    key = None if name is None else f"packed/{name}/{sizes}"
    arena_claim, shared = attach_or_own(key, pin)
    arena = shared if shared is not None else HostArena(sizes, pin=pin)
    for layout, slab in zip(layouts, arena.slabs, strict=True):
        if shared is None:
            pack(layout, slab)
            bind(layout, slab)
            continue
        try:
            bind_checked(layout, slab)
        except ValueError as error:
            raise RuntimeError(
                f"BlockwiseStrategy: the host copy another process shares for this base differs from this model's"
                f" ({error}); pass `share_host_copy=False` to pack a copy of this process's own."
            ) from None
    serving = serve_or_release(arena_claim, arena, {"blocks": len(layouts)})
    copy = HostCopy(layer_ranges=ranges, layouts=layouts, arena=arena, block_size=plan.block_size, serving=serving)
    attach_host_copy(stack.model, copy)
    return copy


def move_rest_to_device(module: nn.Module, stack: DecoderStack, device: torch.device, skip: list[nn.Module]) -> None:
    """Move everything but the decoder layers' frozen tensors and the ``skip`` modules to ``device``.

    Adapters inside the layers and bitsandbytes' small 4-bit code tables go to the device;
    the frozen tensors stay bound to the host copy. See NOTE [ Placement through public calls ].
    """
    skipped = {id(layer) for layer in stack.layers} | {id(m) for m in skip}
    above = _above(module, skipped)

    def visit(sub: nn.Module) -> None:
        if id(sub) in skipped:
            return
        if id(sub) not in above:
            sub.to(device)
            return
        _move_own_tensors(sub, device)
        for child in sub.children():
            visit(child)

    visit(module)
    for layer in stack.layers:
        for param in adapter_parameters(layer).values():
            param.data = param.data.to(device)
            if param.grad is not None:
                param.grad = param.grad.to(device)
        move_code_tables(layer, device)


# NOTE [ Placement through public calls ]
# The module is moved subtree by subtree, not module by module: a subtree with nothing to keep off the
# device (no decoder layer, no host embedding below it) moves with its own public `.to(device)`, so a
# module that overrides how it moves (torchmetrics' `Metric._apply` also moves its metric states and
# takes no `recurse` argument; bitsandbytes' `Linear8bitLt.to` moves its quantization state) moves as
# it would under `strategy="auto"`. Only the few containers above the decoder layers (the LightningModule,
# the PEFT and Hugging Face wrappers, the layer list) are walked; their own parameters and buffers, if
# any, move one by one, through `param.data` and the module's `setattr`, the same tensors `_apply` would
# give. (Calling each submodule's private `_apply(fn, recurse=False)` crashed every module holding a
# metric: issue 42.)
def _above(module: nn.Module, skipped: set[int]) -> set[int]:
    """The ids of the modules under ``module`` (itself included) that have a module in ``skipped`` below them."""
    above: set[int] = set()

    def walk(sub: nn.Module) -> bool:
        holds = False
        for child in sub.children():
            # Every child is walked (no short cut), so that each one's own subtree is classified too.
            holds = (id(child) in skipped or walk(child)) or holds
        if holds:
            above.add(id(sub))
        return holds

    walk(module)
    return above


def _move_own_tensors(sub: nn.Module, device: torch.device) -> None:
    """Move the parameters and buffers ``sub`` holds itself (not its children's) to ``device``."""
    for param in sub.parameters(recurse=False):
        param.data = param.data.to(device)
        if param.grad is not None:
            param.grad = param.grad.to(device)
    for name, buffer in list(sub.named_buffers(recurse=False)):
        setattr(sub, name, buffer.to(device))


def _layer_ranges(plan: BlockPlan) -> tuple[range, ...]:
    return tuple(plan.layers_of(b) for b in range(plan.num_blocks))
