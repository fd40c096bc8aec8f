"""One weight of a merge: the base as training saw it, the adapter's delta, their sum, re-quantized if asked.

Every function here works on one tensor at a time on one device; :mod:`lightning_blockwise.export.merge`
calls them in the order of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import bitsandbytes.functional as bnb_functional
import torch
from bitsandbytes.nn import Linear4bit, Params4bit
from torch import Tensor

from lightning_blockwise.compat.bitsandbytes import SAVED_WEIGHT_ENTRIES, deserialize, quantize_like

# NOTE [ What a merge adds ]
# Training computed each adapted linear as `x @ dequant(W_nf4).T + scaling * (x @ A.T) @ B.T`: the
# function trained is dequant(NF4) plus the LoRA delta `(B @ A) * scaling`, where NF4 is the base
# quantized exactly as the loaders quantize it (cast to the compute dtype on the device, then
# `Params4bit(...).to(device)`: NOTE [ Same bytes as from_pretrained ] in loading/nf4.py). The
# merge does what PEFT's `merge_and_unload` does for a bitsandbytes 4-bit layer
# (`peft/tuners/lora/bnb.py`, `Linear4bit.merge`): `dequantize_4bit` gives the base in its quant
# state's dtype (the compute dtype), `get_delta_weight` gives `(B @ A) * scaling` in the adapter's
# dtype (float32: PEFT casts half-precision adapters up when it loads them, `autocast_adapter_dtype`),
# and the sum is taken with torch's type promotion, so in float32. A dense export casts that sum
# once to its dtype; an NF4 export quantizes it with the base's settings, as `Params4bit(sum, **settings)`
# in PEFT does, which gives a float32 quant state (PEFT's merged layers have one too). Weights
# without an adapter are dequant(NF4) in a dense export and the training NF4 bytes themselves in an
# NF4 export. `merge_into_original` replaces dequant(NF4) by the checkpoint's own weight: another
# model than the one trained, written only when asked.


@contextmanager
def quantized_as_trained(
    module: Linear4bit, key: str, keys: Mapping[str, Any], device: torch.device, dtype: torch.dtype, saved: bool
) -> Iterator[Params4bit]:
    """The NF4 weight training used, on ``device``, for the span of the block.

    A checkpoint's unquantized weight is cast to ``dtype`` on ``device`` in one ``.to`` and
    quantized with the meta weight's settings, as the loaders do (NOTE [ Same bytes as
    from_pretrained ] in loading/nf4.py); a pre-quantized one is deserialized.

    Args:
        module: The meta model's ``Linear4bit`` that holds the weight's settings.
        key: The weight's checkpoint key.
        keys: Checkpoint key -> the open shard that holds it.
        device: Where to quantize.
        dtype: The compute dtype the base was loaded in.
        saved: Whether the checkpoint holds the weight quantized already.
    """
    meta_weight = module.weight
    try:
        if saved:
            stats = {
                entry: keys[f"{key}.{entry}"].get_tensor(f"{key}.{entry}")
                for entry in SAVED_WEIGHT_ENTRIES
                if f"{key}.{entry}" in keys
            }
            weight = deserialize(module, keys[key].get_tensor(key), stats)
            weight.data = weight.data.to(device)
            weight.quant_state.to(device)
        else:
            weight = quantize_like(meta_weight, keys[key].get_tensor(key).to(device=device, dtype=dtype), device)
        yield weight
    finally:
        # bitsandbytes points the module at every quant state it makes; the meta model lives as long as
        # the merge and must not keep every layer's statistics alive (tests/export/test_merge.py sees it).
        module.quant_state = None
        module._parameters["weight"] = meta_weight


def dequantized(weight: Params4bit) -> Tensor:
    """``weight`` dequantized in its quant state's dtype, as PEFT's ``dequantize_bnb_weight`` does."""
    return bnb_functional.dequantize_4bit(weight.data, weight.quant_state)


def lora_delta(lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """``(B @ A) * scaling``, as PEFT's ``get_delta_weight`` computes it (NOTE [ What a merge adds ]).

    Args:
        lora_a: ``lora_A``'s weight, ``(r, in_features)``, on the merge's device.
        lora_b: ``lora_B``'s weight, ``(out_features, r)``, on the merge's device.
        scaling: ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA).
    """
    # PEFT loads half-precision adapters as float32 (`autocast_adapter_dtype`); float32 ones are unchanged.
    if lora_a.dtype in (torch.float16, torch.bfloat16):
        lora_a, lora_b = lora_a.float(), lora_b.float()
    return (lora_b @ lora_a) * scaling


def requantized(module: Linear4bit, value: Tensor, device: torch.device) -> Params4bit:
    """``value`` quantized with the settings of the base's weight, as PEFT's 4-bit merge re-quantizes.

    Args:
        module: The meta model's ``Linear4bit`` that holds the weight's settings.
        value: The merged weight (float32 after promotion, NOTE [ What a merge adds ]).
        device: Where to quantize.
    """
    try:
        return quantize_like(module.weight, value, device)
    finally:
        module.quant_state = None  # as in `quantized_as_trained`


def saved_entries(key: str, weight: Params4bit) -> dict[str, Tensor]:
    """The state-dict entries ``save_pretrained`` writes for a 4-bit weight, on the CPU.

    The packed weight under ``key`` and its quant state under ``key.absmax``, ``key.quant_map``,
    ..., ``key.quant_state.bitsandbytes__nf4``, as ``Linear4bit._save_to_state_dict`` writes them.
    """
    entries = {key: weight.data}
    entries.update({f"{key}.{name}": tensor for name, tensor in weight.quant_state.as_dict(packed=True).items()})
    return {name: tensor.cpu() for name, tensor in entries.items()}


__all__ = ["dequantized", "lora_delta", "quantized_as_trained", "requantized", "saved_entries"]
