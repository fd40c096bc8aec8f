"""The state-dict entries ``save_pretrained`` writes next to a 4-bit weight, and reading a saved weight back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from bitsandbytes.nn import Linear4bit, Params4bit
from bitsandbytes.utils import unpack_tensor_to_dict
from torch import Tensor, nn

from lightning_blockwise.compat.bitsandbytes.config import QUANT_TYPE
from lightning_blockwise.compat.bitsandbytes.linears import named_4bit_linears

#: What ``save_pretrained`` writes next to each ``<linear>.weight`` of a 4-bit model, as key suffixes.
SAVED_STATE_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
#: The prefix of the state-dict entry that packs a quant state's non-tensor fields (and the nested
#: offset) as JSON; the 4-bit type (``nf4``, ``fp4``) follows it.
SAVED_STATE_JSON_PREFIX = "quant_state.bitsandbytes__"
#: The JSON entry of an NF4 weight (it also carries the nested offset).
SAVED_STATE_JSON = f"{SAVED_STATE_JSON_PREFIX}{QUANT_TYPE}"
# The 4-bit types whose JSON entry a saved weight may have.
_SAVED_QUANT_TYPES = ("nf4", "fp4")
#: Every key suffix ``save_pretrained`` may write next to a 4-bit weight (NF4 or FP4), in the order they are read.
SAVED_WEIGHT_ENTRIES = (*SAVED_STATE_SUFFIXES, *(f"{SAVED_STATE_JSON_PREFIX}{kind}" for kind in _SAVED_QUANT_TYPES))


def deserialize(module: Linear4bit, data: Tensor, stats: Mapping[str, Tensor]) -> Params4bit:
    """A saved 4-bit weight rebuilt on the host, as transformers' ``Bnb4bitDeserialize`` does.

    Args:
        module: The ``Linear4bit`` the weight belongs to.
        data: The packed weight as saved.
        stats: Its saved statistics by key suffix (:data:`SAVED_WEIGHT_ENTRIES`).
    """
    return Params4bit.from_prequantized(
        data=data, quantized_stats=dict(stats), requires_grad=False, device="cpu", module=module
    )


def saved_quant_type(stats: Mapping[str, Tensor]) -> str | None:
    """The 4-bit type (``"nf4"``, ``"fp4"``) a saved weight's statistics declare, or ``None`` if they are incomplete.

    Args:
        stats: The entries saved next to the weight, by key suffix (:data:`SAVED_WEIGHT_ENTRIES`).
    """
    if "absmax" not in stats:
        return None
    return next((kind for kind in _SAVED_QUANT_TYPES if f"{SAVED_STATE_JSON_PREFIX}{kind}" in stats), None)


def saved_nested_offsets(module: nn.Module, state: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
    """Each 4-bit linear's current nested-quantization ``offset`` tensor, with its value saved in ``state``.

    bitsandbytes folds the offset into ``<linear>.weight.quant_state.bitsandbytes__nf4``, a JSON
    tensor of the state dict, instead of saving it as a tensor of its own.

    Args:
        module: The module whose state dict ``state`` is.
        state: A state dict of ``module``; linears whose JSON tensor it lacks are skipped.
    """
    found = []
    for name, sub in named_4bit_linears(module):
        if sub.weight.quant_state is None or not sub.weight.quant_state.nested:
            continue
        key = f"{name}.weight.{SAVED_STATE_JSON}"
        if key in state:
            current = sub.weight.quant_state.offset
            saved = unpack_tensor_to_dict(state[key])["nested_offset"]
            found.append((current, torch.tensor(saved, dtype=current.dtype).reshape(current.shape)))
    return found


def is_saved_quantization_metadata(key: str) -> bool:
    """Whether ``key`` is a bitsandbytes state-dict entry that no module tensor is loaded from.

    The code tables (``quant_map``, ``nested_quant_map``) are constants of the NF4 format and the
    JSON tensor describes the quantization (its offset is read by :func:`saved_nested_offsets`).
    """
    return key.endswith((".quant_map", ".nested_quant_map", f".{SAVED_STATE_JSON}"))
