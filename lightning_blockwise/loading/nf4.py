"""One 4-bit weight from the checkpoint to the host: quantized on the device, or rebuilt when saved quantized."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise.compat.bitsandbytes import (
    SAVED_STATE_JSON,
    SAVED_WEIGHT_ENTRIES,
    deserialize,
    move_to_host,
    quantize_like,
    saved_quant_type,
)


# NOTE [ Same bytes as from_pretrained ]
# Every step that decides bytes is transformers' own: the meta model is converted with
# `replace_with_bnb_linear` and the skip list of `Bnb4BitHfQuantizer` (so `lm_head` and the
# model's fp32 modules stay unquantized; `compat.bitsandbytes.replace_with_4bit_linears`), each
# weight is cast to the load dtype on the device in one `.to(device, dtype)` as
# `core_model_loading._materialize_copy` does, and quantized as `Bnb4bitQuantize` does:
# `Params4bit(value, **meta_param.__dict__).to(device)`, which carries the meta parameter's
# blocksize, quant type, double quantization and storage dtype. Pre-quantized weights go
# through `Params4bit.from_prequantized` as `Bnb4bitDeserialize` does. Only the placement
# differs: the results are moved to the host (the same `Params4bit` and `QuantState` objects)
# and packed into the arena.
def quantize_weight(module: nn.Module, value: torch.Tensor, device: torch.device) -> None:
    """Quantize one weight on ``device`` as transformers' ``Bnb4bitQuantize`` does, then move it to the host.

    Args:
        module: The ``Linear4bit`` whose (meta) weight it is.
        value: The unquantized weight, already cast to the load dtype on ``device`` in one ``.to``
            (NOTE [ Same bytes as from_pretrained ]; ``TensorSource.read`` in conversions.py does it).
        device: Where to quantize.
    """
    weight = quantize_like(module.weight, value, device)
    del value
    move_to_host(weight)
    module._parameters["weight"] = weight


def deserialize_weight(module: nn.Module, key: str, keys: dict[str, Any]) -> None:
    """Rebuild a pre-quantized weight on the host as transformers' ``Bnb4bitDeserialize`` does.

    Args:
        module: The ``Linear4bit`` whose (meta) weight it is.
        key: The weight's checkpoint key.
        keys: Checkpoint key -> the open shard that holds it.

    Raises:
        ValueError: If the weight's bitsandbytes statistics are not in the checkpoint.
        MisconfigurationException: If the weight is quantized as FP4.
    """
    stats = {}
    for entry in SAVED_WEIGHT_ENTRIES:
        name = f"{key}.{entry}"
        if name in keys:
            stats[entry] = keys[name].get_tensor(name)
    quant_type = saved_quant_type(stats)
    if quant_type is None:
        raise ValueError(
            f"load_blockwise: the pre-quantized weight `{key}` lacks its bitsandbytes statistics (`{key}.absmax`,"
            f" `{key}.{SAVED_STATE_JSON}`); the checkpoint is incomplete."
        )
    if quant_type != "nf4":
        raise MisconfigurationException(
            f"load_blockwise: `{key}` is quantized as {quant_type.upper()}; only NF4 is supported. Use an NF4 or"
            " unquantized checkpoint."
        )
    module._parameters["weight"] = deserialize(module, keys[key].get_tensor(key), stats)
