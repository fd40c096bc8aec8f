"""What the planner reads of a module set up on its device: its bytes there, what it declares, the device's limit."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.kernels.liger import liger_kernels_in
from lightning_blockwise.planning.memory import ALLOCATOR_HEADROOM_PERCENT, ALLOCATOR_SLACK
from lightning_blockwise.planning.step_budget import StepBudget, blas_threads
from lightning_blockwise.planning.step_kernels import StepKernels
from lightning_blockwise.strategy.device_memory import blas_workspace_bytes

#: Card memory kept out of the limit that decides automatic offload without a ``vram_budget``: the
#: CUDA context and kernels, which ``max_memory_allocated`` does not count (the cuBLAS workspaces it
#: does count are in the plan's fixed bytes: ``blas_workspace_bytes``).
_CONTEXT_RESERVE = 2**30


def module_budget(
    module: nn.Module,
    model: nn.Module,
    block_bytes: Sequence[int],
    device: torch.device,
    prefetch_depth: int,
    budget: int | None,
    offload: bool | None,
    block_layers: Sequence[int] = (),
    keep_activations: bool = False,
    window: int = 1,
    ranks: int = 1,
    offloaded_layers: int | None = None,
    card: bool = False,
    checkpoint_every: int | None = None,
    host_ranks: int = 1,
) -> StepBudget:
    """The step budget of a module set up on ``device``: what is there now, what the module declares.

    Device bytes are counted once per storage. The module declares a chunked loss, tiled MLPs and tiled
    attention with positive integer attributes ``loss_chunk_tokens``, ``mlp_tile_tokens`` and
    ``attention_tile_tokens`` (NOTE [ Chunked loss ] in loss.py, NOTE [ Tiled MLP ] in tiling.py, NOTE [ Tiled
    attention ] in attention.py).

    Args:
        module: The LightningModule, its rest moved to ``device``.
        model: The Hugging Face model inside it.
        block_bytes: Each block's slab size.
        device: The compute device.
        prefetch_depth: Blocks copied ahead of the one in use.
        budget: The ``vram_budget`` in bytes, or ``None``.
        offload: The ``offload_activations`` option.
        block_layers: Decoder layers in each block.
        keep_activations: The ``keep_activations`` option.
        window: Micro-batches of a block-major window (1: none).
        ranks: Data-parallel processes of the run: with several, DDP's gradient buckets (a flat copy of the
            trainable gradients on each rank's device, `ModelSizes.per_rank` in planning) count as fixed bytes.
        offloaded_layers: With offload on, the layers whose inputs go to host memory (``None``: all).
        card: ``budget`` is the card's, not the user's (NOTE [ The card as the default budget ]): a step it does
            not hold streams every block instead of being refused.
        checkpoint_every: The ``input_checkpoint_every`` option. With it and ``offload`` both ``None`` the planner
            chooses where the layer inputs wait (NOTE [ Where layer inputs wait ]).
        host_ranks: Processes on this machine (Lightning's devices per node), sharing its host memory.
    """
    head = model.get_output_embeddings()
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    buckets = trainable if ranks > 1 else 0
    return StepBudget(
        config=model.config,
        num_layers=len(find_decoder_stack(model, allow_unvalidated=True).layers),
        activation_bytes=head.weight.element_size() if head is not None else 2,
        block_bytes=list(block_bytes),
        prefetch_depth=prefetch_depth,
        fixed_bytes=device_bytes(module, device) + blas_workspace_bytes(device, blas_threads(window)) + buckets,
        trainable_bytes=trainable,
        budget=budget,
        offload=offload,
        device_limit=device_limit(device),
        block_layers=list(block_layers),
        keep_activations=keep_activations,
        adapter_dropout=_has_dropout(module),
        window=window,
        offloaded_layers=offloaded_layers,
        card=card,
        checkpoint_every=checkpoint_every,
        choose_inputs=offload is None and checkpoint_every is None,
        host_ranks=host_ranks,
        kernels=module_kernels(module, model),
    )


def module_kernels(module: nn.Module, model: nn.Module) -> StepKernels:
    """How ``module`` computes its step: what it declares, and the Liger kernels installed on ``model``.

    Read as the module runs, not as ``CausalLMFineTune`` would install them (``StepKernels.as_installed``): a fused
    gated activation counts wherever one is installed (``tile_mlps`` takes Liger's off the MLPs it tiles).
    """
    liger = liger_kernels_in(model)
    return StepKernels(
        loss_chunk_tokens=_declared_count(module, "loss_chunk_tokens"),
        mlp_tile_tokens=_declared_count(module, "mlp_tile_tokens"),
        attention_tile_tokens=_declared_count(module, "attention_tile_tokens"),
        fused_norm=liger["rms_norm"] > 0,
        fused_mlp=liger["mlp"] > 0,
    )


def device_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes of ``module``'s parameters and buffers on ``device``, each storage once."""
    storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device == device:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def device_limit(device: torch.device) -> int | None:
    """The bytes a CUDA device lets this process allocate (its per-process cap, less the context), else ``None``."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(torch.cuda.get_per_process_memory_fraction(device) * total) - _CONTEXT_RESERVE


def _has_dropout(module: nn.Module) -> bool:
    """Whether any dropout with ``p > 0`` is in ``module`` (PEFT's adapter dropout is an ``nn.Dropout``)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def _declared_count(module: Any, name: str) -> int | None:
    """A positive integer the module declares for the planner, else ``None``."""
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def reference_headroom(device: torch.device, budget: int | None, predicted_peak: int) -> int | None:
    """Device bytes a resident reference step may take now beyond the run's planned peak (``None``: no limit).

    The least of: what the budget leaves above the planned peak; on CUDA, the free and cached
    device memory less what the training step still needs to grow to its planned peak; and,
    under a per-process cap (``torch.cuda.set_per_process_memory_fraction``), what that cap leaves.
    """
    limits = []
    if budget is not None:
        # The budget caps the allocator, which needs its headroom (NOTE [ A budget is a cap on the card ]).
        limits.append((budget - ALLOCATOR_SLACK) * 100 // (100 + ALLOCATOR_HEADROOM_PERCENT) - predicted_peak)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        # The blockwise step itself still has to grow from what is allocated now to its planned peak.
        still_needed = max(0, predicted_peak - allocated)
        limits.append(max(0, free + cached - still_needed))
        # A per-process cap binds the allocator before the card runs out: at most `fraction * total` bytes.
        cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
        limits.append(max(0, cap - allocated - still_needed))
    return min(limits) if limits else None


__all__ = ["device_bytes", "device_limit", "module_budget", "module_kernels", "reference_headroom"]
