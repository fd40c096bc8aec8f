"""Random-init NF4 models of real shapes, built layer by layer on the device: real sizes without real weights."""

from __future__ import annotations

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_blockwise.loading.random_draws import random_linear, random_parameter


def random_nf4_model(
    config: PretrainedConfig,
    device: torch.device | str,
    compute_dtype: torch.dtype = torch.bfloat16,
    std: float = 0.02,
    quantize: bool = True,
) -> PreTrainedModel:
    """A random-init NF4 (double quant) model of ``config``'s shape, quantized one linear at a time on ``device``.

    For real shapes without their weights (benchmarks, memory checks, smoke runs): every
    ``nn.Linear`` but the LM head becomes a bitsandbytes NF4 ``Linear4bit``, as
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_use_double_quant=True))`` converts them; the other parameters are random in
    ``compute_dtype`` on ``device`` (1-D ones, the norms, at 1). The unquantized model never
    exists whole: parameters start on the meta device, and buffers (rotary frequencies,
    embedding scales) are computed by the model's own constructor on the CPU and moved. Draws
    from torch's global RNG: seed it first for a reproducible model.

    Args:
        config: The model's config, e.g. ``AutoConfig.from_pretrained(dir)`` or a config class.
        device: Where the model is built and quantized.
        compute_dtype: The 4-bit linears' compute dtype and the dtype of every other parameter.
        std: Standard deviation of the random weights.
        quantize: NF4 linears (default); ``False``: dense linears holding the same draws, in ``compute_dtype``.

    Returns:
        The model in train mode, with ``is_loaded_in_4bit`` set unless ``quantize=False`` (what PEFT reads to
        pick its bitsandbytes LoRA layer).
    """
    device = torch.device(device)

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    head = model.get_output_embeddings()
    # NOTE [ Random draw order ] in loading/random_draws.py: `random_blockwise` builds these bytes layer by layer.
    for name, linear in list(model.named_modules()):
        if isinstance(linear, nn.Linear) and linear is not head:
            model.set_submodule(name, random_linear(linear, device, compute_dtype, std, quantize))
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                setattr(module, name, random_parameter(param, device, std))
        for name, buffer in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, buffer.to(device), persistent=name not in module._non_persistent_buffers_set)
    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != device.type]
    if left:
        raise RuntimeError(f"random_nf4_model: {', '.join(left[:5])} were not built on {device}; this is a bug.")
    if quantize:
        model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
    return model.train()


__all__ = ["random_nf4_model"]
