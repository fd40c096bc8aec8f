"""Binding a block's frozen tensors to a slab: packing them into it and rebinding the places a module reads.

A :class:`~lightning_blockwise.residency.walk.Binding` is one place a module reads a frozen tensor from (a
parameter's data, a buffer, a quant-state attribute); the walk records them. :func:`pack` copies a block's
tensors into a slab at the offsets of its :class:`~lightning_blockwise.residency.layout.BlockLayout`,
:func:`views` cuts a slab into typed tensors, :func:`bind` makes the layers read from them and
:func:`unbound` says which no longer do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_blockwise.residency.layout import BlockLayout
from lightning_blockwise.residency.walk import Binding, BindingKind


def views(layout: BlockLayout, slab: Tensor) -> list[Tensor]:
    """Typed views of ``slab``, one per entry of ``layout``, in entry order (no copy).

    Args:
        layout: The block's layout.
        slab: A contiguous 1-D ``uint8`` tensor of at least ``layout.nbytes`` bytes, on any device.

    Raises:
        ValueError: If ``slab`` is not such a tensor.
    """
    if slab.dtype != torch.uint8 or slab.dim() != 1 or not slab.is_contiguous() or slab.numel() < layout.nbytes:
        raise ValueError(
            f"A block slab must be a contiguous 1-D uint8 tensor of at least {layout.nbytes} bytes (the layout's"
            f" `nbytes`), got dtype {slab.dtype}, shape {tuple(slab.shape)}. Allocate it with"
            " `torch.empty(layout.nbytes, dtype=torch.uint8)`."
        )
    # NOTE [ One storage per slab entry ]
    # Each view gets a storage of its own that aliases exactly its bytes of the slab (slicing an
    # `UntypedStorage` shares memory and keeps the slab alive). Typed views of one shared slab
    # storage would make `torch.save` of the module's `state_dict` fail ("Cannot save multiple
    # tensors or storages that view the same data as different types": NF4 bytes next to
    # float32 `absmax`) and, where it did not fail, write the whole slab or device slot once per
    # tensor's storage. With one storage per entry a saved frozen tensor is exactly its own
    # bytes, wherever it is bound, and nothing is copied to save it.
    storage = slab.untyped_storage()
    base = slab.storage_offset()
    return [
        torch.empty(0, dtype=entry.dtype, device=slab.device).set_(
            storage[base + entry.offset : base + entry.offset + entry.nbytes], 0, entry.shape
        )
        for entry in layout.entries
    ]


def pack(layout: BlockLayout, slab: Tensor) -> None:
    """Copy the block's current frozen tensors into ``slab`` at their offsets.

    Non-contiguous tensors are packed contiguously. The layers are not rebound; call
    :func:`bind` for that.

    Args:
        layout: The block's layout.
        slab: The destination, as :func:`views` takes it (e.g. pinned host memory).

    Raises:
        ValueError: If ``slab`` is unfit, or a tensor's dtype or shape changed since the layout
            was made (bitsandbytes repacked it, a forward cast it, the model was reloaded).
    """
    for entry, view in zip(layout.entries, views(layout, slab), strict=True):
        tensor = entry.bindings[0].current()
        if tensor.dtype != entry.dtype or tensor.shape != entry.shape:
            raise ValueError(
                f"pack: `{entry.names[0]}` is now {tensor.dtype} {tuple(tensor.shape)} but was {entry.dtype}"
                f" {tuple(entry.shape)} when the layout was made; something replaced it (a bitsandbytes repack, a"
                " dtype cast, a reload). Make a new layout with `layout_block` and pack again."
            )
        view.copy_(tensor)


# NOTE [ Rebinding keeps identities ]
# Binding moves storage, never objects. A frozen parameter keeps its ``nn.Parameter``
# object (``param.data = view``), so parameter names, ``state_dict`` keys, optimizer and
# hook references are untouched; a ``Params4bit`` stays a ``Params4bit`` with its
# attributes. Each bitsandbytes ``QuantState`` (shared by a ``Params4bit`` and its
# ``Linear4bit.quant_state``) is the same object before and after, only its ``absmax``
# (and nested ``offset`` / ``state2.absmax``) attributes now name slab views. The small
# ``code`` tables stay where they are: they are not in the slab.
#
# What binding cannot move is a reference taken before it. Autograd's saved frozen
# weights (of an ordinary linear) and the view of the packed weight that bitsandbytes'
# ``MatMul4Bit`` keeps on its ``ctx`` hold the storage they saw at forward time, while
# the ``QuantState`` object on that ``ctx`` is read at backward time (NOTE [ Graphs do
# not outlive residency ] in replay/remat.py). A graph built while a block was bound to a slot
# therefore reads, in its backward, whatever the slot holds then, mixed with whatever
# ``absmax`` is bound then. That is why the streamer must keep each layer's graph inside
# its block's residency and reuse a slot only after the last kernel that reads it.
def bind(layout: BlockLayout, slab: Tensor) -> None:
    """Make the block's layers read every frozen tensor from a view of ``slab``.

    ``slab`` must hold the block's bytes: the slab :func:`pack` filled, or a copy of it
    (e.g. a device slot after ``slot.copy_(host_slab)``). See NOTE [ Rebinding keeps identities ].

    Args:
        layout: The block's layout.
        slab: The slab to read from, as :func:`views` takes it.

    Raises:
        ValueError: If ``slab`` is unfit.
    """
    for entry, view in zip(layout.entries, views(layout, slab), strict=True):
        for binding in entry.bindings:
            binding.rebind(view)


def bind_checked(layout: BlockLayout, slab: Tensor) -> None:
    """:func:`bind` the block to a ``slab`` another process packed, once its bytes are checked equal to the block's.

    NOTE [ One host copy per machine ] in shared_arena.py. The block is packed into a buffer of its own first
    (zeros in the alignment gaps, as in a fresh arena) and compared byte for byte.

    Raises:
        ValueError: If the slab's bytes differ from the block's.
    """
    own = torch.zeros(layout.nbytes, dtype=torch.uint8)
    pack(layout, own)
    if own.numel() != slab.numel() or not torch.equal(own, slab):
        raise ValueError(f"{layout.entries[0].names[0]}...: the shared slab's bytes differ from this block's")
    bind(layout, slab)


def unbound(layout: BlockLayout, slab: Tensor) -> list[str]:
    """Names of the block's tensors that no longer read from their place in ``slab``.

    After :func:`bind` this is empty until something replaces a tensor: bitsandbytes'
    ``Linear4bit`` casting its bias to the compute dtype, its CPU inference repack,
    ``QuantState.to()``, ``module.to()``. A streamer can check it after a layer ran.

    Args:
        layout: The block's layout.
        slab: The slab the block was bound to.
    """
    found = []
    for entry, view in zip(layout.entries, views(layout, slab), strict=True):
        for binding in entry.bindings:
            tensor = binding.current()
            if tensor.data_ptr() != view.data_ptr() or tensor.dtype != view.dtype or tensor.shape != view.shape:
                found.append(entry.names[0])
                break
    return found


__all__ = ["Binding", "BindingKind", "bind", "bind_checked", "pack", "unbound", "views"]
