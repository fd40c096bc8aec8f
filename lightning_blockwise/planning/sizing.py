"""Analytic byte counts of a model from its config alone: what ``lightning-blockwise plan`` predicts from.

The model is built on the meta device (shapes and dtypes, no memory, no weights), and
each tensor's bytes are computed the way loading it with bitsandbytes NF4 and double
quantization would store it (NOTE [ NF4 bytes ] in compat/bitsandbytes/formats.py). The decoder
layers' frozen tensors are found by the same walk as the strategy's layout
(:func:`~lightning_blockwise.residency.layout.frozen_tensors`) and laid out at the same offsets, so
:meth:`ModelSizes.block_bytes` equals the strategy's ``layout.nbytes`` exactly.

Example::

    sizes = model_sizes(AutoConfig.from_pretrained("/models/Qwen2.5-7B"), lora_rank=16)
    print(sizes.block_bytes(block_size=1)[0], sizes.host_bytes(block_size=1))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.compat.bitsandbytes import Nf4Format, code_table_bytes, nf4_tensor_bytes
from lightning_blockwise.planning import BlockPlan, ResidencyPlan, StepShape
from lightning_blockwise.planning.recommend import (
    CUDA_CONTEXT_RESERVE,
    RECOMMENDED_MLP_TILE_TOKENS,
    Recommendation,
    recommend,
)
from lightning_blockwise.residency.arena import slab_offsets
from lightning_blockwise.residency.layout import ALIGNMENT, frozen_tensors, tensor_offsets
from lightning_blockwise.step_budget import StepBudget

#: Bytes per trainable adapter element: PEFT keeps adapters in fp32 over a bf16 or 4-bit base.
_ADAPTER_BYTES = 4


def slab_bytes(tensor_bytes: Iterable[int], alignment: int = ALIGNMENT) -> int:
    """The size of a slab holding tensors of these sizes in this order, each offset aligned, as ``layout_block``.

    Args:
        tensor_bytes: Each tensor's own bytes, in slab order.
        alignment: The alignment of every offset (:data:`~lightning_blockwise.residency.layout.ALIGNMENT`).
    """
    return tensor_offsets(tensor_bytes, alignment)[-1]


@dataclass(frozen=True)
class ModelSizes:
    """A model's bytes as a blockwise run places them, computed from its config.

    Attributes:
        model_type: ``config.model_type``.
        layer_tensors: Per decoder layer, the bytes of each frozen tensor in slab order.
        device_bytes: Frozen bytes on the compute device for the whole run: LM head, final norm,
            rotary buffers, the embedding when it is tied (or not a plain frozen table), the
            4-bit code tables, and anything else outside the decoder layers.
        host_embedding_bytes: The input embedding table kept in host memory (0 when tied).
        trainable_bytes: The adapters' bytes (fp32).
        config: The model's config.
        activation_bytes: Bytes per activation element (the LM head's dtype, as the strategy reads it).
    """

    model_type: str
    layer_tensors: tuple[tuple[int, ...], ...]
    device_bytes: int
    host_embedding_bytes: int
    trainable_bytes: int
    config: PretrainedConfig
    activation_bytes: int

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layer_tensors)

    def block_bytes(self, block_size: int) -> list[int]:
        """Each block's slab size for ``block_size`` layers per block (the strategy's ``layout.nbytes``)."""
        return [
            slab_bytes(nbytes for layer in self.layer_tensors[start : start + block_size] for nbytes in layer)
            for start in range(0, self.num_layers, block_size)
        ]

    def host_bytes(self, block_size: int) -> int:
        """The pinned host arena for ``block_size``: every block's slab, each starting aligned (``arena.nbytes``)."""
        return slab_offsets(self.block_bytes(block_size))[-1]

    def shape(
        self,
        tokens: int,
        offload_inputs: bool = False,
        loss_chunk_tokens: int | None = None,
        mlp_tile_tokens: int | None = None,
    ) -> StepShape:
        """The step shape of this model at ``tokens`` tokens per micro-batch (what its activations depend on).

        Args:
            tokens: Tokens per micro-batch (batch size x sequence length).
            offload_inputs: Layer inputs wait for the backward in host memory.
            loss_chunk_tokens: Rows of logits the module's loss builds at a time (``None``: Hugging Face's loss).
            mlp_tile_tokens: Tokens per tile of the module's tiled MLPs (``None``: untiled).
        """
        return StepShape.for_config(
            self.config,
            tokens,
            self.num_layers,
            self.activation_bytes,
            offload_inputs=offload_inputs,
            loss_chunk_tokens=loss_chunk_tokens,
            mlp_tile_tokens=mlp_tile_tokens,
        )

    def step_budget(
        self,
        block_size: int = 1,
        prefetch_depth: int = 2,
        budget: int | None = None,
        offload: bool | None = None,
        loss_chunk_tokens: int | None = None,
        mlp_tile_tokens: int | None = None,
        device_limit: int | None = None,
        keep_activations: bool = True,
    ) -> StepBudget:
        """The strategy's step budget for this model: the same planner with the same inputs as at setup.

        The device bytes the strategy counts there are the frozen ones here plus the adapters.

        Args:
            block_size: Decoder layers per block.
            prefetch_depth: Blocks copied ahead of the one in use.
            budget: The ``vram_budget`` in bytes, or ``None`` to stream every block.
            offload: ``offload_activations``: force layer-input offload on or off; ``None`` turns it on
                when the step does not fit (the budget, else ``device_limit``) without it.
            loss_chunk_tokens: Rows of logits the module's loss builds at a time (``None``: Hugging Face's loss).
            mlp_tile_tokens: Tokens per tile of the module's tiled MLPs (``None``: untiled).
            device_limit: Without a budget, the device bytes beyond which automatic offload turns on.
            keep_activations: The strategy's ``keep_activations`` (NOTE [ Kept activations ] in memory.py).

        Raises:
            ValueError: If ``block_size`` is out of range.
        """
        blocks = BlockPlan(num_layers=self.num_layers, block_size=block_size)  # refuses a block size out of range
        return StepBudget(
            config=self.config,
            num_layers=self.num_layers,
            activation_bytes=self.activation_bytes,
            block_bytes=self.block_bytes(block_size),
            prefetch_depth=prefetch_depth,
            fixed_bytes=self.device_bytes + self.trainable_bytes,
            trainable_bytes=self.trainable_bytes,
            budget=budget,
            offload=offload,
            loss_chunk_tokens=loss_chunk_tokens,
            mlp_tile_tokens=mlp_tile_tokens,
            device_limit=device_limit,
            block_layers=[len(blocks.layers_of(block)) for block in range(blocks.num_blocks)],
            keep_activations=keep_activations,
        )

    def residency(
        self,
        tokens: int,
        block_size: int = 1,
        prefetch_depth: int = 2,
        budget: int | None = None,
        offload_inputs: bool = False,
        loss_chunk_tokens: int | None = None,
        mlp_tile_tokens: int | None = None,
        keep_activations: bool = True,
    ) -> ResidencyPlan:
        """The strategy's residency plan and predicted training-step peak for this model, offload forced on or off.

        Args:
            tokens: Tokens per micro-batch (batch size x sequence length; the strategy's ``budget_tokens``).
            block_size: Decoder layers per block.
            prefetch_depth: Blocks copied ahead of the one in use.
            budget: The ``vram_budget`` in bytes, or ``None`` to stream every block.
            offload_inputs: Layer inputs wait for the backward in host memory (``offload_activations=True``).
            loss_chunk_tokens: Rows of logits the module's loss builds at a time (``None``: Hugging Face's loss).
            mlp_tile_tokens: Tokens per tile of the module's tiled MLPs (``None``: untiled).
            keep_activations: The strategy's ``keep_activations``.

        Raises:
            ValueError: If ``block_size`` is out of range or ``budget`` is below the minimum.
        """
        budgeted = self.step_budget(
            block_size, prefetch_depth, budget, offload_inputs, loss_chunk_tokens, mlp_tile_tokens,
            keep_activations=keep_activations,
        )  # fmt: skip
        return budgeted.plan(tokens).residency


def model_sizes(
    config: PretrainedConfig,
    dtype: torch.dtype | None = None,
    lora_rank: int = 16,
    targets: Iterable[str] | None = None,
    dora: bool = False,
    double_quant: bool = True,
) -> ModelSizes:
    """Bytes of the NF4 model ``config`` describes, with LoRA adapters, without loading any weight.

    Every ``nn.Linear`` but the LM head is counted as bitsandbytes NF4 (what
    ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` does),
    everything else in ``dtype``.

    Args:
        config: The model's config (e.g. ``AutoConfig.from_pretrained(checkpoint_dir)``).
        dtype: The dtype of the unquantized tensors; default ``config.dtype``, else bfloat16.
        lora_rank: LoRA rank ``r``; 0 counts no adapters.
        targets: The decoder layers' linears that get adapters, by the last part of their module names
            (``q_proj``, ...); default all of them.
        dora: Count DoRA's magnitude vector (one fp32 per output feature) as well.
        double_quant: ``bnb_4bit_use_double_quant``.

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
        layer_tensors.append(tuple(_frozen_bytes(layer, head, double_quant)))
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
            if isinstance(module, nn.Linear) and module is not head and tensor is module.weight:
                device += sum(nf4_tensor_bytes(tensor.numel(), double_quant))
            else:
                device += tensor.numel() * tensor.element_size()
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


def _frozen_bytes(layer: nn.Module, head: nn.Module | None, double_quant: bool) -> Iterator[int]:
    """The bytes of a decoder layer's frozen tensors, in ``layout_block``'s order.

    The walk of :func:`~lightning_blockwise.residency.layout.frozen_tensors`, every linear but the head counted as NF4.
    """
    nf4 = Nf4Format(double_quant=double_quant)

    def as_nf4(module: nn.Module, name: str, tensor: torch.Tensor) -> Nf4Format | None:
        return nf4 if isinstance(module, nn.Linear) and module is not head and name == "weight" else None

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
