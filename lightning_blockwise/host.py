"""Packing a block's frozen tensors into one contiguous byte slab, and pointing the layers at it.

A block's frozen base is many small tensors: per 4-bit linear a packed NF4 weight, its
``absmax`` and, with double quantization, a nested ``absmax`` and ``offset``; per layer
a few norm weights. :func:`layout_block` finds them and gives each an aligned place in one
``uint8`` slab; :func:`pack` copies them there; :func:`bind` makes the layers read their
tensors from views of a slab. The streamer packs each block once into pinned host
memory, then per use copies the host slab into a device slot in one transfer and binds
the slot::

    layout = layout_block(layers)
    host = torch.empty(layout.nbytes, dtype=torch.uint8)  # the host arena's slab
    pack(layout, host)
    bind(layout, host)  # the host copy is now the layers' only copy
    slot[: layout.nbytes].copy_(host, non_blocking=True)
    bind(layout, slot)  # the layers now compute from the device slot

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
# not outlive residency ] in remat.py). A graph built while a block was bound to a slot
# therefore reads, in its backward, whatever the slot holds then, mixed with whatever
# ``absmax`` is bound then. That is why the streamer must keep each layer's graph inside
# its block's residency and reuse a slot only after the last kernel that reads it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Params4bit
from torch import Tensor, nn

from lightning_blockwise.architectures import adapter_parameters

#: Default alignment of every tensor in a slab, in bytes: a multiple of every dtype's size
#: and of the widest vectorized copy, so views are valid for any dtype and copies are fast.
ALIGNMENT: int = 256

# The largest element size of a torch dtype (complex128); smaller alignments could make
# a typed view of the slab impossible.
_MIN_ALIGNMENT = 16


class BindingKind(Enum):
    """How a frozen tensor is reached from the module, and so how it is rebound."""

    #: A module parameter: ``param.data = view`` (the ``Parameter`` object stays).
    PARAMETER = "parameter"
    #: A module buffer: ``module._buffers[name] = view``.
    BUFFER = "buffer"
    #: A tensor attribute of a bitsandbytes ``QuantState`` (or its nested ``state2``).
    QUANT_STATE = "quant_state"


@dataclass(frozen=True, eq=False)
class Binding:
    """One place a module reads a frozen tensor from.

    Attributes:
        kind: How the tensor is reached.
        owner: The ``nn.Parameter`` (``PARAMETER``), the module that registers the buffer
            (``BUFFER``) or the ``QuantState`` (``QUANT_STATE``).
        attr: ``"data"``, the buffer's name, or the quant-state attribute.
    """

    kind: BindingKind
    owner: nn.Parameter | nn.Module | QuantState
    attr: str

    def current(self) -> Tensor:
        """The tensor this place holds now."""
        if self.kind is BindingKind.PARAMETER:
            return self.owner.data
        if self.kind is BindingKind.BUFFER:
            return self.owner._buffers[self.attr]
        return getattr(self.owner, self.attr)

    def rebind(self, view: Tensor) -> None:
        """Make this place hold ``view`` (NOTE [ Rebinding keeps identities ])."""
        if self.kind is BindingKind.PARAMETER:
            self.owner.data = view
        elif self.kind is BindingKind.BUFFER:
            # Straight into `_buffers`: `Module.__setattr__` would run buffer registration hooks.
            self.owner._buffers[self.attr] = view
        else:
            setattr(self.owner, self.attr, view)


@dataclass(frozen=True, eq=False)
class SlabEntry:
    """One frozen tensor's place in a block's slab.

    Attributes:
        names: Every qualified name that reaches these bytes (``layers.3.mlp.up_proj.base_layer.weight``,
            ``...weight.quant_state.absmax``); tied tensors have several.
        bindings: Every distinct place to rebind (two ``Parameter`` objects sharing storage are two).
        dtype: The tensor's dtype.
        shape: The tensor's shape.
        offset: Byte offset in the slab, a multiple of the layout's alignment.
        nbytes: The tensor's own size in bytes.
    """

    names: tuple[str, ...]
    bindings: tuple[Binding, ...]
    dtype: torch.dtype
    shape: torch.Size
    offset: int
    nbytes: int


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


def layout_block(layers: Sequence[nn.Module], first_index: int = 0, alignment: int = ALIGNMENT) -> BlockLayout:
    """Find every frozen tensor the ``layers`` of one block read, and lay them out in one slab.

    Frozen tensors are the parameters that are not PEFT adapters (see
    :func:`~lightning_blockwise.architectures.adapter_parameters`; for a bitsandbytes
    ``Params4bit`` its packed data), the buffers, and per ``Params4bit`` the tensors of its
    ``QuantState``: ``absmax`` and, with double quantization, ``offset`` and
    ``state2.absmax``. The 4-bit ``code`` tables are left out: they are tiny and can stay
    on the compute device. A tensor reached twice (a tied parameter, a shared quant state,
    two parameters over the same storage) gets one entry; distinct tensors that merely
    overlap are packed separately, which is safe because frozen tensors are never written.

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
    # Bytes seen -> (a tensor holding them, its names, its bindings): tied tensors share one entry.
    groups: dict[tuple[object, ...], tuple[Tensor, list[str], list[Binding]]] = {}
    seen_bindings: set[tuple[int, str]] = set()
    for name, tensor, binding in _frozen_tensors(layers, first_index):
        _, names, bindings = groups.setdefault(_bytes_key(tensor), (tensor, [], []))
        names.append(name)
        if (id(binding.owner), binding.attr) not in seen_bindings:
            seen_bindings.add((id(binding.owner), binding.attr))
            bindings.append(binding)

    entries = []
    end = 0
    for tensor, names, bindings in groups.values():
        offset = -(-end // alignment) * alignment
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(SlabEntry(tuple(names), tuple(bindings), tensor.dtype, tensor.shape, offset, nbytes))
        end = offset + nbytes
    return BlockLayout(
        entries=tuple(entries),
        nbytes=end,
        bytes_needed=sum(entry.nbytes for entry in entries),
        alignment=alignment,
    )


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


def _frozen_tensors(layers: Sequence[nn.Module], first_index: int) -> Iterator[tuple[str, Tensor, Binding]]:
    """Every (qualified name, tensor, binding) of the layers' frozen tensors, in module order; checks each."""
    for index, layer in enumerate(layers, start=first_index):
        adapters = {id(param) for param in adapter_parameters(layer).values()}
        # `remove_duplicate=False`: a module or tensor reached under two names is reported under both.
        for module_name, module in layer.named_modules(remove_duplicate=False):
            prefix = ".".join(filter(None, (f"layers.{index}", module_name)))
            for param_name, param in module._parameters.items():
                if param is None or id(param) in adapters:
                    continue
                name = f"{prefix}.{param_name}"
                _check_frozen(name, param)
                yield name, param, Binding(BindingKind.PARAMETER, param, "data")
                if isinstance(param, Params4bit):
                    yield from _quant_state_tensors(name, param)
            for buffer_name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                name = f"{prefix}.{buffer_name}"
                _check_frozen(name, buffer)
                yield name, buffer, Binding(BindingKind.BUFFER, module, buffer_name)


def _quant_state_tensors(name: str, weight: Params4bit) -> Iterator[tuple[str, Tensor, Binding]]:
    """The tensors of a ``Params4bit``'s quant state that are packed with it (not the ``code`` tables)."""
    state = weight.quant_state
    if state is None:
        raise ValueError(
            f"layout_block: `{name}` is a bitsandbytes `Params4bit` without a quant state, so it is not quantized (or"
            " lost its state in a conversion). Quantize the model before packing it: load it with"
            " `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` or move the `Linear4bit` to a device."
        )
    if getattr(state, "packing_format_for_cpu", False):
        # NOTE [ bitsandbytes CPU inference kernel ] in strategy.py: bitsandbytes converts this
        # layout back when the weight moves or is saved, which packing would freeze.
        raise ValueError(
            f"layout_block: `{name}` was repacked by bitsandbytes for its CPU inference kernel (an eval-mode"
            " `Linear4bit` ran on the CPU without grad), a format it converts back on `.cuda()` or `state_dict()`"
            " and that has no backward. Call `model.train()` right after loading, before any forward."
        )
    parts = [(state, "absmax", "quant_state.absmax")]
    if state.nested:
        parts += [(state, "offset", "quant_state.offset"), (state.state2, "absmax", "quant_state.state2.absmax")]
    for owner, attr, suffix in parts:
        tensor = getattr(owner, attr)
        if isinstance(tensor, Tensor):
            _check_frozen(f"{name}.{suffix}", tensor)
            yield f"{name}.{suffix}", tensor, Binding(BindingKind.QUANT_STATE, owner, attr)


def _check_frozen(name: str, tensor: Tensor) -> None:
    """Refuse a tensor that a slab cannot stand in for."""
    if tensor.requires_grad:
        raise ValueError(
            f"layout_block: `{name}` requires grad but is not a PEFT adapter. A slab holds a frozen copy that is"
            " refilled from the host, so training it would be lost. Freeze it (`requires_grad_(False)`) or train"
            " it through a PEFT adapter."
        )
    if tensor.is_meta:
        raise ValueError(
            f"layout_block: `{name}` is on the meta device and has no bytes to pack. Materialize the model's"
            " weights (load them) before laying out its blocks."
        )


def _bytes_key(tensor: Tensor) -> tuple[object, ...]:
    """Identifies the exact bytes and geometry a tensor reads: equal keys mean one entry suffices."""
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )
