"""Finding a block's frozen tensors: the one walk, on real tensors or predicted from a meta model.

A block's frozen base is many small tensors: per 4-bit linear a packed NF4 weight, its
``absmax`` and, with double quantization, a nested ``absmax`` and ``offset``; per layer
a few norm weights. :func:`frozen_tensors` finds each once, with every name that reaches it
and every place to rebind; :mod:`~lightning_blockwise.residency.layout` lays them out in a slab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Params4bit
from torch import Tensor, nn

from lightning_blockwise.architectures import adapter_parameters
from lightning_blockwise.compat.bitsandbytes import Nf4Format, is_repacked_for_cpu, pending_nf4, quant_state_tensors

#: Which weights a walk predicts as NF4 before they are quantized, and in which format: called with
#: ``(module, parameter name, parameter)``, it returns the format or ``None`` (a tensor as it is).
Nf4Policy = Callable[[nn.Module, str, Tensor], Nf4Format | None]


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
        """Make this place hold ``view`` (NOTE [ Rebinding keeps identities ] in binding.py)."""
        if self.kind is BindingKind.PARAMETER:
            self.owner.data = view
        elif self.kind is BindingKind.BUFFER:
            # Straight into `_buffers`: `Module.__setattr__` would run buffer registration hooks.
            self.owner._buffers[self.attr] = view
        else:
            setattr(self.owner, self.attr, view)


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
    bitsandbytes will store for it (NOTE [ NF4 bytes ] in compat/bitsandbytes/formats.py).

    Args:
        layers: The decoder layers of one block.
        first_index: Index of ``layers[0]`` in the decoder stack, for names and errors.
        nf4: Which weights to predict as NF4 and how; by default a bitsandbytes weight on the
            meta device that is not quantized yet, in its own format.
        strict: Refuse what a slab cannot stand in for: a tensor that requires grad but is no
            adapter, or one on the meta device
            (:func:`~lightning_blockwise.residency.layout.layout_block` packs real bytes).

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
        # NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py: bitsandbytes
        # converts this layout back when the weight moves or is saved, which packing would freeze.
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
