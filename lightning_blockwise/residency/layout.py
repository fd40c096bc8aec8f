"""A block's frozen tensors laid out in one byte slab: an aligned place for each.

:func:`~lightning_blockwise.residency.walk.frozen_tensors` finds a block's frozen tensors (the
one walk, on real tensors or predicted from a meta model; its names are served here too);
:func:`layout_block` gives each an aligned place in one ``uint8`` slab. The host arena, the
loader's prediction and ``plan``'s sizes all come from :func:`frozen_tensors` and
:func:`tensor_offsets`. Putting the tensors into a slab and pointing the layers at it is
:mod:`~lightning_blockwise.residency.binding`'s job (a floor above this module). The
streamer packs each block once into pinned host memory, then per use copies the host slab
into a device slot in one transfer and binds the slot::

    layout = layout_block(layers)
    host = torch.empty(layout.nbytes, dtype=torch.uint8)  # the host arena's slab
    pack(layout, host)
    bind(layout, host)  # the host copy is now the layers' only copy
    slot[: layout.nbytes].copy_(host, non_blocking=True)
    bind(layout, slot)  # the layers now compute from the device slot
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

# Re-exported (redundant aliases): the walk lived here before it had a module of its own.
from lightning_blockwise.residency.walk import FrozenTensor as FrozenTensor
from lightning_blockwise.residency.walk import Nf4Policy as Nf4Policy
from lightning_blockwise.residency.walk import frozen_tensors as frozen_tensors

#: Default alignment of every tensor in a slab, in bytes: a multiple of every dtype's size
#: and of the widest vectorized copy, so views are valid for any dtype and copies are fast.
ALIGNMENT: int = 256

# The largest element size of a torch dtype (complex128); smaller alignments could make
# a typed view of the slab impossible.
_MIN_ALIGNMENT = 16


@dataclass(frozen=True, eq=False)
class SlabEntry(FrozenTensor):
    """One frozen tensor's place in a block's slab.

    Attributes:
        offset: Byte offset in the slab, a multiple of the layout's alignment.
    """

    offset: int


@dataclass(frozen=True, eq=False)
class BlockLayout:
    """Where each frozen tensor of one block lives in the block's slab.

    The layout holds no tensor, only the places to rebind: keeping the original tensors
    alive would keep a second copy of the whole block once it is bound to a slab.

    Attributes:
        entries: The block's frozen tensors, in module order, at increasing offsets.
        nbytes: Exact slab size needed: the end of the last tensor.
        bytes_needed: Sum of the tensors' own sizes; ``nbytes - bytes_needed`` is alignment padding.
        alignment: The alignment of every offset, in bytes.
    """

    entries: tuple[SlabEntry, ...]
    nbytes: int
    bytes_needed: int
    alignment: int


def align_up(nbytes: int, alignment: int = ALIGNMENT) -> int:
    """``nbytes`` rounded up to a multiple of ``alignment``."""
    return -(-nbytes // alignment) * alignment


def tensor_offsets(sizes: Iterable[int], alignment: int = ALIGNMENT) -> list[int]:
    """Where each tensor of ``sizes`` starts in a slab that packs them in order, then the slab's size (one more entry).

    Every start is a multiple of ``alignment``; the size is the end of the last tensor, unpadded.
    """
    offsets = []
    end = 0
    for size in sizes:
        offsets.append(align_up(end, alignment))
        end = offsets[-1] + size
    return [*offsets, end]


def layout_block(layers: Sequence[nn.Module], first_index: int = 0, alignment: int = ALIGNMENT) -> BlockLayout:
    """Find every frozen tensor the ``layers`` of one block read, and lay them out in one slab.

    The tensors are those of :func:`frozen_tensors`, at the offsets of :func:`tensor_offsets`.

    Args:
        layers: The decoder layers of one block.
        first_index: Index of ``layers[0]`` in the decoder stack, for names in entries and errors.
        alignment: Alignment of each tensor's offset, in bytes; a power of two of at least 16.

    Returns:
        The block's layout.

    Raises:
        ValueError: If ``alignment`` is invalid, or a tensor cannot be packed safely: it requires
            grad but is no adapter, it is on the meta device, it is a ``Params4bit`` without a
            quant state, or bitsandbytes has repacked it for its CPU inference kernel.

    Example::

        layout = layout_block(stack.layers[4:8], first_index=4)
        print(f"{layout.nbytes} bytes, {layout.nbytes - layout.bytes_needed} of them padding")
    """
    if alignment < _MIN_ALIGNMENT or alignment & (alignment - 1):
        raise ValueError(
            f"layout_block: alignment={alignment} must be a power of two of at least {_MIN_ALIGNMENT} bytes, so that"
            " a tensor of any dtype can be viewed at every offset. Use the default `ALIGNMENT`."
        )
    tensors = frozen_tensors(layers, first_index, strict=True)
    offsets = tensor_offsets((tensor.nbytes for tensor in tensors), alignment)
    entries = tuple(
        SlabEntry(t.names, t.bindings, t.dtype, t.shape, t.nbytes, offset)
        for t, offset in zip(tensors, offsets, strict=False)
    )
    return BlockLayout(
        entries=entries,
        nbytes=offsets[-1],
        bytes_needed=sum(entry.nbytes for entry in entries),
        alignment=alignment,
    )
