"""Where each part of the module lives during a blockwise run.

Decoder layers' frozen tensors: the host arena (streamed, or copied once to the device for
blocks the VRAM budget keeps resident). The frozen, untied input embedding: host memory
(NOTE [ Host embedding lookup ]). Everything else (adapters, the LM head, norms, rotary
tables, bitsandbytes' 4-bit code tables): the compute device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from bitsandbytes.nn import Linear4bit, Params4bit
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_blockwise.architectures import DecoderStack, adapter_parameters
from lightning_blockwise.arena import HostArena
from lightning_blockwise.host import BlockLayout, bind, layout_block, pack, unbound
from lightning_blockwise.plan import BlockPlan

# The attribute of the Hugging Face model that keeps its host copy alive exactly as long
# as the model (NOTE [ Exact-size pinned memory ] in arena.py).
_HOST_COPY_ATTR = "_blockwise_host_copy"


@dataclass(eq=False)
class HostCopy:
    """The host arena of one model's decoder layers and the block layouts laid out in it.

    Attributes:
        layer_ranges: The decoder layers of each block.
        layouts: Each block's layout.
        arena: The host arena; ``arena.slabs[b]`` holds block ``b``.
    """

    layer_ranges: tuple[range, ...]
    layouts: tuple[BlockLayout, ...]
    arena: HostArena

    def is_bound(self) -> bool:
        """Whether every block still reads from its slab (nothing moved the model since)."""
        return all(not unbound(layout, slab) for layout, slab in zip(self.layouts, self.arena.slabs, strict=True))


def host_copy(stack: DecoderStack, plan: BlockPlan, pin: bool) -> HostCopy:
    """The model's host copy for ``plan``: the one it already has, or a new one packed block by block.

    Packing a block and binding its layers to the slab drops the previous copies of its
    tensors (on the GPU after a standard load), one block at a time, so memory does not peak.

    Raises:
        MisconfigurationException: If the arena does not fit the available host RAM (checked
            before anything is allocated).
    """
    ranges = tuple(plan.layers_of(b) for b in range(plan.num_blocks))
    existing: HostCopy | None = vars(stack.model).get(_HOST_COPY_ATTR)
    if existing is not None and existing.layer_ranges == ranges and existing.is_bound():
        if not pin or existing.arena.pinned:
            return existing
    if existing is not None:
        rank_zero_warn(
            "BlockwiseStrategy is repacking the model's host copy (another block_size, or the model was moved since"
            " it was packed): host RAM holds the old and the new arena until the repack ends. Pass the same"
            " `block_size` to `load_blockwise` and the strategy to avoid it."
        )
    layouts = tuple(layout_block([stack.layers[i] for i in layers], first_index=layers[0]) for layers in ranges)
    arena = HostArena([layout.nbytes for layout in layouts], pin=pin)
    for layout, slab in zip(layouts, arena.slabs, strict=True):
        pack(layout, slab)
        bind(layout, slab)
    copy = HostCopy(layer_ranges=ranges, layouts=layouts, arena=arena)
    vars(stack.model)[_HOST_COPY_ATTR] = copy
    return copy


def move_rest_to_device(module: nn.Module, stack: DecoderStack, device: torch.device, skip: list[nn.Module]) -> None:
    """Move everything but the decoder layers' frozen tensors and the ``skip`` modules to ``device``.

    Adapters inside the layers and bitsandbytes' small 4-bit code tables go to the device;
    the frozen tensors stay bound to the host copy.
    """
    skipped = {id(layer) for layer in stack.layers} | {id(m) for m in skip}

    def visit(sub: nn.Module) -> None:
        if id(sub) in skipped:
            return
        sub._apply(lambda t: t.to(device), recurse=False)
        for child in sub.children():
            visit(child)

    visit(module)
    for layer in stack.layers:
        for param in adapter_parameters(layer).values():
            param.data = param.data.to(device)
            if param.grad is not None:
                param.grad = param.grad.to(device)
        for sub in layer.modules():
            weight = getattr(sub, "weight", None)
            if isinstance(weight, Params4bit) and weight.quant_state is not None:
                state = weight.quant_state
                state.code = state.code.to(device)
                if state.nested:
                    state.state2.code = state.state2.code.to(device)


def disable_cpu_repack(stack: DecoderStack) -> dict[nn.Module, bool]:
    """Keep bitsandbytes from repacking streamed CPU weights in place; return the flags to restore.

    See NOTE [ bitsandbytes CPU inference kernel ] in strategy.py: in eval mode on the CPU,
    ``Linear4bit.forward`` replaces its weight with a repacked copy and marks its quant
    state, which would detach it from the host arena and then mismatch the next binding.
    Streamed CPU layers use bitsandbytes' generic 4-bit kernel instead.
    """
    flags = {}
    for layer in stack.layers:
        for module in layer.modules():
            if isinstance(module, Linear4bit):
                flags[module] = module.support_avx512bf16_for_cpu
                module.support_avx512bf16_for_cpu = False
    return flags


def restore_cpu_repack(flags: dict[nn.Module, bool]) -> None:
    """Undo :func:`disable_cpu_repack`."""
    for module, flag in flags.items():
        module.support_avx512bf16_for_cpu = flag
