"""A block's frozen tensors: finding them (the one walk) and laying them out in one byte slab.

A block's frozen base is many small tensors: per 4-bit linear a packed NF4 weight, its
``absmax`` and, with double quantization, a nested ``absmax`` and ``offset``; per layer
a few norm weights. :func:`frozen_tensors` finds them, on real tensors or predicted from
a meta model; :func:`layout_block` gives each an aligned place in one ``uint8`` slab. The
host arena, the loader's prediction and ``plan``'s sizes all come from :func:`frozen_tensors`
and :func:`tensor_offsets`. Putting the tensors into a slab and pointing the layers at it
is :mod:`~lightning_blockwise.residency.binding`'s job (its names are served here too). The
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

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Params4bit
from torch import Tensor, nn

from lightning_blockwise.architectures import adapter_parameters
from lightning_blockwise.compat.bitsandbytes import Nf4Format, is_repacked_for_cpu, pending_nf4, quant_state_tensors
from lightning_blockwise.residency.binding import Binding, BindingKind

# Re-exported (redundant aliases): binding's functions are still imported from here, where they lived before.
from lightning_blockwise.residency.binding import bind as bind
from lightning_blockwise.residency.binding import pack as pack
from lightning_blockwise.residency.binding import unbound as unbound
from lightning_blockwise.residency.binding import views as views

#: Default alignment of every tensor in a slab, in bytes: a multiple of every dtype's size
#: and of the widest vectorized copy, so views are valid for any dtype and copies are fast.
ALIGNMENT: int = 256

# The largest element size of a torch dtype (complex128); smaller alignments could make
# a typed view of the slab impossible.
_MIN_ALIGNMENT = 16


#: Which weights a walk predicts as NF4 before they are quantized, and in which format: called with
#: ``(module, parameter name, parameter)``, it returns the format or ``None`` (a tensor as it is).
Nf4Policy = Callable[[nn.Module, str, Tensor], Nf4Format | None]


@dataclass(frozen=True, eq=False)
class FrozenTensor:
    """One frozen tensor of a block, as a slab holds it: found on a real tensor, or predicted.

    Attributes:
        names: Every qualified name that reaches these bytes (``layers.3.mlp.up_proj.base_layer.weight``,
            ``...weight.quant_state.absmax``); tied tensors have several.
        bindings: Every distinct place to rebind (two ``Parameter`` objects sharing storage are two);
            none for a tensor predicted from a weight not quantized yet.
        dtype: The tensor's dtype.
        shape: The tensor's shape.
        nbytes: The tensor's own size in bytes.
    """

    names: tuple[str, ...]
    bindings: tuple[Binding, ...]
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int


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


def frozen_tensors(
    layers: Sequence[nn.Module], first_index: int = 0, *, nf4: Nf4Policy = pending_nf4, strict: bool = False
) -> list[FrozenTensor]:
    """Every frozen tensor the ``layers`` of one block read, in slab order: the one walk of a block.

    Frozen tensors are the parameters that are not PEFT adapters (see
    :func:`~lightning_blockwise.architectures.adapter_parameters`; for a bitsandbytes
    ``Params4bit`` its packed data), the buffers, and per ``Params4bit`` the tensors of its
    quant state (:func:`~lightning_blockwise.compat.bitsandbytes.quant_state_tensors`; the
    4-bit ``code`` tables are left out: they are tiny and can stay on the compute device).
    Order: per module, each parameter (a 4-bit weight followed by its quant state), then its
    buffers. A tensor reached twice (a tied parameter, a shared quant state, two parameters
    over the same storage) is one tensor with several names: a slab holds it once. Distinct
    tensors that merely overlap are separate, which is safe because frozen tensors are never
    written.

    Works on the meta device too, for predictions before anything is loaded: shapes and
    dtypes are all it reads, and a weight that ``nf4`` names is predicted as the tensors
    bitsandbytes will store for it (NOTE [ NF4 bytes ] in compat/bitsandbytes.py).

    Args:
        layers: The decoder layers of one block.
        first_index: Index of ``layers[0]`` in the decoder stack, for names and errors.
        nf4: Which weights to predict as NF4 and how; by default a bitsandbytes weight on the
            meta device that is not quantized yet, in its own format.
        strict: Refuse what a slab cannot stand in for: a tensor that requires grad but is no
            adapter, or one on the meta device (:func:`layout_block` packs real bytes).

    Raises:
        ValueError: If a tensor cannot be packed safely: ``strict`` refuses it, it is a real
            ``Params4bit`` without a quant state, or bitsandbytes has repacked it for its CPU
            inference kernel.

    Example::

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=nf4_config())
        slab_bytes = tensor_offsets(t.nbytes for t in frozen_tensors(model.model.layers[:2]))[-1]
    """
    # Bytes reached -> (dtype, shape, names, bindings): a tied tensor is one entry, named by every path to it.
    groups: dict[tuple[object, ...], tuple[torch.dtype, torch.Size, list[str], list[Binding]]] = {}
    seen_bindings: set[tuple[int, str]] = set()
    for name, key, dtype, shape, binding in _walk(layers, first_index, nf4, strict):
        _, _, names, bindings = groups.setdefault(key, (dtype, shape, [], []))
        names.append(name)
        if binding is not None and (id(binding.owner), binding.attr) not in seen_bindings:
            seen_bindings.add((id(binding.owner), binding.attr))
            bindings.append(binding)
    return [
        FrozenTensor(tuple(names), tuple(bindings), dtype, shape, shape.numel() * dtype.itemsize)
        for dtype, shape, names, bindings in groups.values()
    ]


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


# What the walk finds per name: (qualified name, bytes key, dtype, shape, binding or None if predicted).
_Found = tuple[str, tuple[object, ...], torch.dtype, torch.Size, Binding | None]


def _walk(layers: Sequence[nn.Module], first_index: int, nf4: Nf4Policy, strict: bool) -> Iterator[_Found]:
    """Every frozen tensor of ``layers`` under each of its names, in module order."""
    for index, layer in enumerate(layers, start=first_index):
        adapters = {id(param) for param in adapter_parameters(layer).values()}
        # `remove_duplicate=False`: a module or tensor reached under two names is reported under both.
        for module_name, module in layer.named_modules(remove_duplicate=False):
            prefix = ".".join(filter(None, (f"layers.{index}", module_name)))
            for param_name, param in module._parameters.items():
                if param is None or id(param) in adapters:
                    continue
                name = f"{prefix}.{param_name}"
                if strict:
                    _check_frozen(name, param)
                predicted = nf4(module, param_name, param)
                if predicted is not None:
                    # Not quantized yet: the tensors bitsandbytes will store, keyed by the weight they come from.
                    for suffix, dtype, shape in predicted.tensor_specs(param.numel()):
                        key = (*_bytes_key(param), suffix)
                        yield ".".join(filter(None, (name, suffix))), key, dtype, torch.Size(shape), None
                    continue
                yield _found(name, param, Binding(BindingKind.PARAMETER, param, "data"))
                if isinstance(param, Params4bit):
                    yield from _quant_state(name, param, strict)
            for buffer_name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                name = f"{prefix}.{buffer_name}"
                if strict:
                    _check_frozen(name, buffer)
                yield _found(name, buffer, Binding(BindingKind.BUFFER, module, buffer_name))


def _quant_state(name: str, weight: Params4bit, strict: bool) -> Iterator[_Found]:
    """The quant-state tensors packed with a quantized ``Params4bit``."""
    state: QuantState | None = weight.quant_state
    if state is None:
        raise ValueError(
            f"layout_block: `{name}` is a bitsandbytes `Params4bit` without a quant state, so it is not quantized (or"
            " lost its state in a conversion). Quantize the model before packing it: load it with"
            " `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` or move the `Linear4bit` to a device."
        )
    if is_repacked_for_cpu(state):
        # NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes.py: bitsandbytes converts
        # this layout back when the weight moves or is saved, which packing would freeze.
        raise ValueError(
            f"layout_block: `{name}` was repacked by bitsandbytes for its CPU inference kernel (an eval-mode"
            " `Linear4bit` ran on the CPU without grad), a format it converts back on `.cuda()` or `state_dict()`"
            " and that has no backward. Call `model.train()` right after loading, before any forward."
        )
    for owner, attr, suffix in quant_state_tensors(state):
        tensor = getattr(owner, attr)
        if strict:
            _check_frozen(f"{name}.{suffix}", tensor)
        yield _found(f"{name}.{suffix}", tensor, Binding(BindingKind.QUANT_STATE, owner, attr))


def _found(name: str, tensor: Tensor, binding: Binding) -> _Found:
    return name, _bytes_key(tensor), tensor.dtype, tensor.shape, binding


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
    storage = tensor.untyped_storage()
    # A meta storage has no address (every one is 0): the storage object itself tells tied meta tensors apart.
    where = storage._cdata if tensor.is_meta else storage.data_ptr()
    return (tensor.device, where, tensor.storage_offset(), tensor.dtype, tuple(tensor.shape), tensor.stride())
