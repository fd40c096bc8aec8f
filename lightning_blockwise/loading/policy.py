"""Which 4-bit settings and dtype a load uses: a quantized checkpoint's own, else the caller's or NF4; NF4 only."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import BitsAndBytesConfig

from lightning_blockwise.compat.bitsandbytes import is_supported_config, nf4_config


def resolve_quantization(
    config: Any, requested: BitsAndBytesConfig | None, compute_dtype: torch.dtype
) -> tuple[BitsAndBytesConfig, bool]:
    """The 4-bit settings to load with, and whether the checkpoint is already quantized; refuses all but NF4.

    Args:
        config: The checkpoint's config.
        requested: The caller's settings, if any; checked, but a quantized checkpoint's own settings win.
        compute_dtype: The compute dtype of the default settings.

    Raises:
        MisconfigurationException: If the checkpoint or ``requested`` is quantized other than as 4-bit NF4
            with uint8 storage.
    """
    saved = getattr(config, "quantization_config", None)
    if saved is not None:
        saved = saved if isinstance(saved, dict) else saved.to_dict()
        if saved.get("quant_method") != "bitsandbytes" or not saved.get("load_in_4bit"):
            raise MisconfigurationException(
                f"load_blockwise: the checkpoint is quantized with {saved.get('quant_method')!r}"
                f" (load_in_8bit={saved.get('load_in_8bit', False)}); only bitsandbytes 4-bit NF4 checkpoints or"
                " unquantized ones are supported. Use an unquantized (bf16) checkpoint."
            )
        # As in `from_pretrained`, the checkpoint's own settings (its compute dtype too) win.
        bnb_config = BitsAndBytesConfig.from_dict(saved)
    elif requested is not None:
        bnb_config = requested
    else:
        bnb_config = nf4_config(compute_dtype)
    for checked in (bnb_config, requested):
        if checked is not None and not is_supported_config(checked):
            raise MisconfigurationException(
                "load_blockwise: only bitsandbytes 4-bit NF4 with uint8 storage is supported, got"
                f" load_in_4bit={checked.load_in_4bit}, load_in_8bit={checked.load_in_8bit},"
                f" bnb_4bit_quant_type={checked.bnb_4bit_quant_type!r},"
                f" bnb_4bit_quant_storage={checked.bnb_4bit_quant_storage}. Use"
                " `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True)`."
            )
    return bnb_config, saved is not None


def saved_dtype(config: Any, bnb_config: BitsAndBytesConfig) -> torch.dtype:
    """The dtype ``from_pretrained`` loads a pre-quantized checkpoint in, whatever ``dtype`` it is given.

    The dtype the checkpoint was saved in, else its 4-bit compute dtype.
    """
    dtype = getattr(config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else bnb_config.bnb_4bit_compute_dtype
