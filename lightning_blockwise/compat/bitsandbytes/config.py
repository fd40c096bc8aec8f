"""The NF4 settings the package loads with, and the ``Linear4bit`` that loading with them makes of a linear.

Example::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4_config(torch.bfloat16)).train()
"""

from __future__ import annotations

import torch
from bitsandbytes.nn import Linear4bit, Params4bit
from torch import Tensor, nn
from transformers import BitsAndBytesConfig

#: The 4-bit data type the package loads with.
QUANT_TYPE = "nf4"
#: Whether the absmax are quantized again (``bnb_4bit_use_double_quant``): NF4 with double quantization.
DOUBLE_QUANT = True


def nf4_config(compute_dtype: torch.dtype = torch.float32) -> BitsAndBytesConfig:
    """The package's 4-bit settings: bitsandbytes NF4 with double quantization, computing in ``compute_dtype``.

    Args:
        compute_dtype: The dtype the 4-bit layers compute in (bitsandbytes' default, float32, if not given).
    """
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=QUANT_TYPE,
        bnb_4bit_use_double_quant=DOUBLE_QUANT,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def is_supported_config(config: BitsAndBytesConfig) -> bool:
    """Whether ``config`` is 4-bit NF4 with ``uint8`` storage, the format the host arena lays out."""
    return (
        bool(config.load_in_4bit)
        and config.bnb_4bit_quant_type == QUANT_TYPE
        and config.bnb_4bit_quant_storage == torch.uint8
    )


def nf4_linear(linear: nn.Linear, weight: Tensor, compute_dtype: torch.dtype) -> Linear4bit:
    """The NF4 ``Linear4bit`` that loading with :func:`nf4_config` makes of ``linear``, holding ``weight`` quantized.

    The weight is quantized on its own device; the bias, if ``linear`` has one, is left on the
    meta device for the caller to set.

    Args:
        linear: The linear to replace (only its shape and whether it has a bias are read).
        weight: The unquantized weight, ``(out_features, in_features)``.
        compute_dtype: The dtype the layer computes in.
    """
    quantized = Linear4bit(
        linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
        compress_statistics=DOUBLE_QUANT, quant_type=QUANT_TYPE, device="meta",
    )  # fmt: skip
    quantized.weight = Params4bit(
        weight, requires_grad=False, compress_statistics=DOUBLE_QUANT, quant_type=QUANT_TYPE, module=quantized
    ).to(weight.device)
    return quantized
