"""bitsandbytes' linears in a model: converting a meta model's linears, finding 4-bit and 8-bit ones, quantizing."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from bitsandbytes.nn import Linear4bit, Linear8bitLt, Params4bit
from torch import Tensor, nn
from transformers import BitsAndBytesConfig, PreTrainedModel
from transformers.integrations import replace_with_bnb_linear
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer


def replace_with_4bit_linears(model: PreTrainedModel, config: BitsAndBytesConfig) -> None:
    """Convert a meta model's linears to ``Linear4bit`` in place, as ``from_pretrained(quantization_config=config)``.

    With transformers' own skip list, so ``lm_head``, the model's fp32 modules and
    ``config.llm_int8_skip_modules`` stay unquantized (NOTE [ Same bytes as from_pretrained ] in
    loading/nf4.py).
    """
    skip = Bnb4BitHfQuantizer(config).get_modules_to_not_convert(
        model, config.llm_int8_skip_modules, model._keep_in_fp32_modules
    )
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config, pre_quantized=False)


def named_4bit_linears(module: nn.Module) -> Iterator[tuple[str, Linear4bit]]:
    """``(name, module)`` of every bitsandbytes 4-bit linear in ``module``, as ``named_modules`` gives them."""
    return ((name, sub) for name, sub in module.named_modules() if isinstance(sub, Linear4bit))


def named_8bit_linears(module: nn.Module) -> Iterator[tuple[str, Linear8bitLt]]:
    """``(name, module)`` of every bitsandbytes 8-bit linear (``load_in_8bit=True``) in ``module``.

    NOTE [ 8-bit bases do not stream ]: such a layer cannot be packed into a host arena.
    """
    return ((name, sub) for name, sub in module.named_modules() if isinstance(sub, Linear8bitLt))


# NOTE [ 8-bit bases do not stream ]
# A `Linear8bitLt` reads its int8 weight and per-row scales (`SCB`) from a `MatmulLtState` that it fills
# from the weight on its first forward (`init_8bit_state` moves `weight.CB` and `weight.SCB` onto it), and
# after every forward it sets `weight.data = state.CB`. So rebinding the parameter to an arena view, as a
# slab does for every frozen tensor, changes nothing the layer reads: measured on the CPU (bitsandbytes
# 0.50), a "blockwise" run of an 8-bit base trained bit-identically only because each layer still read its
# original int8 tensor, held beside the arena's copy (the base twice in host RAM, nothing streamed), and on
# a GPU the state's tensors would stay in host memory. Streaming it would mean binding the state's CB and
# SCB (and the weight's, before the first forward) and undoing the forward's rebinding; the strategy
# refuses these layers instead and names NF4 (which streams) or resident training.


def is_4bit_weight(owner: nn.Module, attr: str) -> bool:
    """Whether ``owner.<attr>`` is the weight of a bitsandbytes 4-bit linear (quantized, or to be quantized)."""
    return isinstance(owner, Linear4bit) and attr == "weight"


def quantize_like(meta_weight: Params4bit, value: Tensor, device: torch.device) -> Params4bit:
    """Quantize ``value`` on ``device`` with the settings of ``meta_weight``, as transformers' ``Bnb4bitQuantize``.

    ``Params4bit(value, **meta_param.__dict__).to(device)`` carries the meta parameter's blocksize,
    quant type, double quantization and storage dtype.
    """
    return Params4bit(value, requires_grad=False, **meta_weight.__dict__).to(device)
