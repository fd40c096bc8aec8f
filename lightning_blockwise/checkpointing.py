"""What a blockwise checkpoint holds: the trainable state, a fingerprint of the frozen base, the RNG states.

The frozen base is every tensor of the Hugging Face model that training does not change: the
decoder layers' frozen tensors (NF4 packed weights and their quantization statistics, norms,
biases), and the frozen input embedding, final norm and LM head. The checkpoint directory the
model was loaded from already holds them, so by default a checkpoint leaves them out
(NOTE [ Lean checkpoints ]) and records a fingerprint of the base instead, to refuse a
checkpoint resumed over another base.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from bitsandbytes.nn import Linear4bit
from bitsandbytes.utils import unpack_tensor_to_dict
from torch import Tensor, nn

from lightning_blockwise.host import BlockLayout, views

#: The checkpoint key under which the strategy keeps what it adds to Lightning's checkpoint.
CHECKPOINT_KEY = "blockwise"

#: Bumped when what is stored under ``CHECKPOINT_KEY`` changes meaning.
FORMAT_VERSION = 1

# Bytes sampled per tensor for the fingerprint: enough that two different bases (another seed,
# other trained weights) differ in some sampled byte, few enough that a 72B base takes a second.
_SAMPLES_PER_TENSOR = 4096

# bitsandbytes' state-dict entry that packs a quant state's non-tensor fields (and the nested offset) as JSON.
_BNB_JSON = "quant_state.bitsandbytes__nf4"

# Config entries that name where a model came from, not what it is.
_CONFIG_NOISE = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")

# NOTE [ Lean checkpoints ]
# A checkpoint of a blockwise run keeps what training changes (trainable parameters, whatever the
# module holds outside the Hugging Face model, optimizer, schedulers, loops, callbacks) and leaves
# out the frozen base: at 72B that is ~40 GB a checkpoint that the base's own directory already
# has. In its place it records `base_fingerprint`: a hash of the model config and of a strided
# sample of every frozen tensor's bytes, so a lean checkpoint resumed over another base (same
# shapes, other weights) is refused instead of silently training a different model. With
# `save_frozen_base=True` the file is self-contained: every frozen tensor once, read from the host
# copy (never a device slot: NOTE [ One storage per slab entry ] in host.py), written straight to
# disk so that nothing of the base is copied in host memory.


@dataclass(frozen=True)
class BaseKeys:
    """Which keys of a LightningModule's ``state_dict`` are the frozen base, and which are trained.

    Attributes:
        frozen: Keys of the Hugging Face model's frozen tensors (bitsandbytes' quantization
            statistics included).
        trainable: Keys of parameters that require grad, anywhere in the module.
    """

    frozen: frozenset[str]
    trainable: frozenset[str]

    @classmethod
    def of(cls, module: nn.Module, base_model: nn.Module) -> BaseKeys:
        """Sort ``module``'s state-dict keys; ``base_model`` is the Hugging Face model inside it."""
        prefix = next(name for name, sub in module.named_modules(remove_duplicate=False) if sub is base_model)
        base = base_model.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True)
        trainable = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        return cls(frozen=frozenset(base) - trainable, trainable=frozenset(trainable))


def base_fingerprint(config: Any, tensors: Iterable[Tensor]) -> str:
    """A hash of a model config and of a strided byte sample of each frozen tensor, in order.

    Args:
        config: The Hugging Face model's config (where the model was loaded from is ignored).
        tensors: The frozen base's tensors, in state-dict order (read where they are: a device
            tensor has only its sampled bytes copied).

    Returns:
        A hex digest.
    """
    settings = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for tensor in tensors:
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        flat = (
            tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)
        )
        count = min(flat.numel(), _SAMPLES_PER_TENSOR)
        if count:
            index = torch.linspace(0, flat.numel() - 1, count, dtype=torch.float64).long()
            digest.update(flat[index.to(flat.device)].cpu().numpy().tobytes())
    return digest.hexdigest()


class HostViews:
    """The host-arena view of every decoder-layer frozen tensor, found from wherever it is bound now.

    A streamed block may be bound to a device slot when a checkpoint is written; the host
    arena is the authoritative copy (and the only one a full-state checkpoint should read or a
    full-state load should write). Tensors are matched by the address of their first byte.

    Args:
        layouts: Every block's layout.
        slabs: Every block's slab in the host arena.
    """

    def __init__(self, layouts: Iterable[BlockLayout], slabs: Iterable[Tensor]) -> None:
        self._by_address: dict[int, Tensor] = {}
        for layout, slab in zip(layouts, slabs, strict=True):
            for entry, view in zip(layout.entries, views(layout, slab), strict=True):
                for binding in entry.bindings:
                    self._by_address[binding.current().data_ptr()] = view

    def get(self, tensor: Tensor) -> Tensor | None:
        """The host view of ``tensor`` if it is a decoder layer's frozen tensor, else ``None``."""
        view = self._by_address.get(tensor.data_ptr()) if tensor.numel() else None
        if view is None or view.dtype != tensor.dtype or view.shape != tensor.shape:
            return None
        return view


def saved_nested_offsets(module: nn.Module, state: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
    """Each 4-bit linear's current nested-quantization ``offset`` tensor, with its value saved in ``state``.

    bitsandbytes folds the offset into ``<linear>.weight.quant_state.bitsandbytes__nf4``, a JSON
    tensor of the state dict, instead of saving it as a tensor of its own.

    Args:
        module: The module whose state dict ``state`` is.
        state: A state dict of ``module``; linears whose JSON tensor it lacks are skipped.
    """
    found = []
    for name, sub in module.named_modules():
        if not isinstance(sub, Linear4bit) or sub.weight.quant_state is None or not sub.weight.quant_state.nested:
            continue
        key = f"{name}.weight.{_BNB_JSON}"
        if key in state:
            current = sub.weight.quant_state.offset
            saved = unpack_tensor_to_dict(state[key])["nested_offset"]
            found.append((current, torch.tensor(saved, dtype=current.dtype).reshape(current.shape)))
    return found


def is_quantization_metadata(key: str) -> bool:
    """Whether ``key`` is a bitsandbytes state-dict entry that no module tensor is loaded from.

    The code tables (``quant_map``, ``nested_quant_map``) are constants of the NF4 format and the
    JSON tensor describes the quantization (its offset is read by :func:`saved_nested_offsets`).
    """
    return key.endswith((".quant_map", ".nested_quant_map", f".{_BNB_JSON}"))


__all__ = [
    "CHECKPOINT_KEY",
    "FORMAT_VERSION",
    "BaseKeys",
    "HostViews",
    "base_fingerprint",
    "is_quantization_metadata",
    "saved_nested_offsets",
]
