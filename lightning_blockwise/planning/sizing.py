"""Analytic byte counts of a model from its config alone: what ``lightning-blockwise plan`` predicts from.

The model is built on the meta device (shapes and dtypes, no memory, no weights), and
each tensor's bytes are computed the way loading it with bitsandbytes NF4 and double
quantization would store it (NOTE [ NF4 bytes ] in compat/bitsandbytes/formats.py), or for a
dense base (``quantize=False``, ``load_blockwise(quantize=False)``) in its own dtype. Tensors that
bitsandbytes does not quantize (norms, the fused 3-D experts of ``qwen3_moe``) are counted in their
own dtype either way: a mixed base is sized from its real per-tensor dtypes. The decoder
layers' frozen tensors are found by the same walk as the strategy's layout
(:func:`~lightning_blockwise.residency.layout.frozen_tensors`) and laid out at the same offsets, so
:meth:`ModelSizes.block_bytes` equals the strategy's ``layout.nbytes`` exactly.

Example::

    sizes = model_sizes(AutoConfig.from_pretrained("/models/Qwen2.5-7B"), lora_rank=16)
    print(sizes.block_bytes(block_size=1)[0], sizes.host_bytes(block_size=1))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.compat.bitsandbytes import Nf4Format, code_table_bytes, nf4_tensor_bytes
from lightning_blockwise.planning.footprint import ModelSizes, slab_bytes
from lightning_blockwise.planning.recommend import (
    CUDA_CONTEXT_RESERVE,
    RECOMMENDED_MLP_TILE_TOKENS,
    Recommendation,
    recommend,
)
from lightning_blockwise.residency.layout import frozen_tensors

#: Bytes per trainable adapter element: PEFT keeps adapters in fp32 over a bf16 or 4-bit base.
_ADAPTER_BYTES = 4


def model_sizes(
    config: PretrainedConfig,
    dtype: torch.dtype | None = None,
    lora_rank: int = 16,
    targets: Iterable[str] | None = None,
    dora: bool = False,
    double_quant: bool = True,
    quantize: bool = True,
) -> ModelSizes:
    """Bytes of the NF4 (or dense) model ``config`` describes, with LoRA adapters, without loading any weight.

    Every ``nn.Linear`` but the LM head is counted as bitsandbytes NF4 (what
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` does),
    everything else in ``dtype``; with ``quantize=False`` every tensor in ``dtype``.

    Args:
        config: The model's config (e.g. ``AutoConfig.from_pretrained(checkpoint_dir)``).
        dtype: The dtype of the unquantized tensors; default ``config.dtype``, else bfloat16.
        lora_rank: LoRA rank ``r``; 0 counts no adapters.
        targets: The decoder layers' linears that get adapters, by the last part of their module names
            (``q_proj``, ...); default all of them.
        dora: Count DoRA's magnitude vector (one fp32 per output feature) as well.
        double_quant: ``bnb_4bit_use_double_quant``.
        quantize: ``False``: a dense base, no tensor quantized (``load_blockwise(quantize=False)``).

    Raises:
        MisconfigurationException: If the config has no decoder stack (see
            :func:`~lightning_blockwise.architectures.find_decoder_stack`).
        ValueError: If ``lora_rank`` is negative or ``targets`` names a linear the decoder layers do not have.
    """
    if lora_rank < 0:
        raise ValueError(f"lora_rank={lora_rank} must be at least 0 (0 counts no adapters).")
    dtype = dtype or _config_dtype(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    stack = find_decoder_stack(model, allow_unvalidated=True)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    wanted = None if targets is None else set(targets)
    if wanted is not None:
        # A misspelt name would count no adapter for it, and a plan too small, without a word.
        linears = {
            name.rsplit(".", 1)[-1] for name, module in stack.layers.named_modules() if isinstance(module, nn.Linear)
        }
        if unknown := sorted(wanted - linears):
            raise ValueError(
                f"no linear of the {config.model_type} decoder layers is named {' or '.join(unknown)}; their linears"
                f" are {', '.join(sorted(linears))}."
            )

    layer_tensors = []
    trainable = 0
    for layer in stack.layers:
        layer_tensors.append(tuple(_frozen_bytes(layer, head, double_quant, quantize)))
        for name, module in layer.named_modules():
            if isinstance(module, nn.Linear) and (wanted is None or name.rsplit(".", 1)[-1] in wanted):
                per_rank = module.in_features + module.out_features
                trainable += (lora_rank * per_rank + (module.out_features if dora else 0)) * _ADAPTER_BYTES

    # The input embedding stays on the host when it is a table of its own (`embedding.can_stay_on_host`).
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    on_host = set() if tied or embedding is None else {id(t) for t in _tensors(embedding)}
    # Seen tensors are skipped: a tied table is reached from the embedding and the head, and counted once.
    seen = {id(t) for layer in stack.layers for t in _tensors(layer)} | on_host
    device = 0
    for module in model.modules():
        for tensor in _tensors(module, recurse=False):
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if quantize and isinstance(module, nn.Linear) and module is not head and tensor is module.weight:
                device += sum(nf4_tensor_bytes(tensor.numel(), double_quant))
            else:
                device += tensor.numel() * tensor.element_size()
    if quantize:
        linears = sum(isinstance(m, nn.Linear) and m is not head for m in model.modules())
        device += linears * code_table_bytes(double_quant)

    return ModelSizes(
        model_type=str(config.model_type),
        layer_tensors=tuple(layer_tensors),
        device_bytes=device,
        host_embedding_bytes=sum(t.numel() * t.element_size() for t in _tensors(embedding)) if on_host else 0,
        trainable_bytes=trainable,
        config=config,
        activation_bytes=head.weight.element_size() if head is not None else 2,
    )


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    """The checkpoint's dtype as its config states it (what ``from_pretrained`` loads it in), else bfloat16."""
    for candidate in (config, getattr(config, "text_config", None)):
        value = getattr(candidate, "dtype", None)
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
            return getattr(torch, value)
    return torch.bfloat16


def _tensors(module: nn.Module | None, recurse: bool = True) -> Iterator[torch.Tensor]:
    """A module's parameters and buffers."""
    if module is None:
        return
    yield from module.parameters(recurse=recurse)
    yield from module.buffers(recurse=recurse)


def _frozen_bytes(layer: nn.Module, head: nn.Module | None, double_quant: bool, quantize: bool) -> Iterator[int]:
    """The bytes of a decoder layer's frozen tensors, in ``layout_block``'s order.

    The walk of :func:`~lightning_blockwise.residency.layout.frozen_tensors`, every linear but the head counted as
    NF4 when ``quantize``, every other tensor (all of them when not) in its own dtype.
    """
    nf4 = Nf4Format(double_quant=double_quant)

    def as_nf4(module: nn.Module, name: str, tensor: torch.Tensor) -> Nf4Format | None:
        quantized = quantize and isinstance(module, nn.Linear) and module is not head and name == "weight"
        return nf4 if quantized else None

    return (tensor.nbytes for tensor in frozen_tensors([layer], nf4=as_nf4))


# The card recommendation lived here before it moved to `recommend.py`; it stays importable from here.
__all__ = [
    "CUDA_CONTEXT_RESERVE",
    "RECOMMENDED_MLP_TILE_TOKENS",
    "ModelSizes",
    "Recommendation",
    "model_sizes",
    "recommend",
    "slab_bytes",
]
