"""Which 4-bit settings and dtype a load uses: a quantized checkpoint's own, else the caller's or NF4; or dense."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import BitsAndBytesConfig

from lightning_blockwise.compat.bitsandbytes import is_supported_config, nf4_config


def resolve_quantization(
    config: Any, requested: BitsAndBytesConfig | None, compute_dtype: torch.dtype, quantize: bool = True
) -> tuple[BitsAndBytesConfig | None, bool]:
    """The 4-bit settings to load with, and whether the checkpoint is already quantized; refuses all but NF4.

    Args:
        config: The checkpoint's config.
        requested: The caller's settings, if any; checked, but a quantized checkpoint's own settings win.
        compute_dtype: The compute dtype of the default settings.
        quantize: ``False``: a dense load, whose settings are ``None``.

    Raises:
        MisconfigurationException: If the checkpoint or ``requested`` is quantized other than as 4-bit NF4
            with uint8 storage, or a dense load is asked for with settings or of a quantized checkpoint.
    """
    saved = getattr(config, "quantization_config", None)
    if not quantize:
        _check_dense(saved, requested)
        return None, False
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


def _check_dense(saved: Any, requested: BitsAndBytesConfig | None) -> None:
    """Refuse a dense load that is given 4-bit settings or a quantized checkpoint: one of the two is a mistake."""
    if requested is not None:
        raise MisconfigurationException(
            "load_blockwise(quantize=False) loads a dense base, but a `quantization_config` was passed too. Drop"
            " `quantization_config` for a dense (bf16) base, or drop `quantize=False` to load it as NF4."
        )
    if saved is not None:
        method = saved.get("quant_method") if isinstance(saved, dict) else getattr(saved, "quant_method", saved)
        raise MisconfigurationException(
            f"load_blockwise(quantize=False) loads a dense base, but the checkpoint is already quantized"
            f" ({method!r} in its config.json) and its weights cannot be dequantized exactly. Use the unquantized"
            " (bf16) checkpoint, or drop `quantize=False` to load this one as NF4."
        )


def saved_dtype(config: Any, bnb_config: BitsAndBytesConfig) -> torch.dtype:
    """The dtype ``from_pretrained`` loads a pre-quantized checkpoint in, whatever ``dtype`` it is given.

    The dtype the checkpoint was saved in, else its 4-bit compute dtype.
    """
    dtype = getattr(config, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else bnb_config.bnb_4bit_compute_dtype
