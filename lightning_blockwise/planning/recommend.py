"""What to set for a card of a given size: ``vram_budget``, ``block_size``, offload, loss and MLP tiling.

What ``lightning-blockwise plan --gpu-memory`` recommends, from a model's sizes
(:func:`~lightning_blockwise.planning.sizing.model_sizes`) alone.

Example::

    sizes = model_sizes(AutoConfig.from_pretrained("/models/Qwen2.5-7B"), lora_rank=16)
    advice = recommend(sizes, gpu_memory=24 * 2**30, tokens=2048)
    print(advice.budget, advice.block_size, advice.offload_activations)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from lightning_blockwise.longcontext.loss import DEFAULT_CHUNK_TOKENS
from lightning_blockwise.longcontext.tiling import DEFAULT_TILE_TOKENS
from lightning_blockwise.planning import ResidencyPlan
from lightning_blockwise.planning.step_kernels import PLAIN_KERNELS, StepKernels

if TYPE_CHECKING:
    # Only for annotations (the sizes of a model, a floor below `sizing`, which re-exports this module's names).
    from lightning_blockwise.planning.footprint import ModelSizes

#: Card memory kept out of the recommended budget: the CUDA context and cuBLAS workspaces,
#: which ``torch.cuda.max_memory_allocated`` (what the budget predicts) does not count.
CUDA_CONTEXT_RESERVE = 2**30
#: ``block_size=2`` is recommended while it streams at most this much more than ``block_size=1``:
#: fewer, larger copies made it 6-15% faster per step on the H100 (``benchmarks/RESULTS.md``).
_BLOCK_SIZE_2_TOLERANCE = 1.10
_BUDGET_STEP = 2**30 // 10
#: The MLP tile recommended where nothing else fits: :func:`~lightning_blockwise.longcontext.tiling.tile_mlps`'
#: default, the tile measured in ``benchmarks/RESULTS.md`` ("Long context").
RECOMMENDED_MLP_TILE_TOKENS = DEFAULT_TILE_TOKENS


@dataclass(frozen=True)
class Recommendation:
    """What to set for a card of a given size.

    Attributes:
        gpu_memory: The card's memory, in bytes.
        budget: The ``vram_budget`` to set, in bytes.
        block_size: The ``block_size`` to set.
        plan: The residency plan that budget and block size give; ``None`` when even every block
            streamed does not fit.
        minimum: The smallest budget of ``block_size=1`` (every block streamed) with the options below.
        offload_activations: The ``offload_activations`` to set: layer inputs wait for the backward in host memory.
        loss_chunk_tokens: The module's loss chunk to set (``StepKernels``), as given or chosen here.
        mlp_tile_tokens: The module's MLP tile to set (``StepKernels``), as given or chosen here.
        attention_tile_tokens: The module's attention tile (``StepKernels``), as given: never chosen here.
        offload_host_bytes: Host bytes the offloaded layer inputs take (0 with offload off).
        fused_norm: The plan counts Liger's RMSNorm (``StepKernels``), as given.
        fused_mlp: The plan counts Liger's fused gated activation: given, and the MLPs untiled
            (``StepKernels.as_installed``).
        masked_row: The plan counts attention with a mask over rows of this many tokens, as given
            (``StepShape.masked_row``); ``None``: causal rows.
    """

    gpu_memory: int
    budget: int
    block_size: int
    plan: ResidencyPlan | None
    minimum: int
    offload_activations: bool = False
    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    offload_host_bytes: int = 0
    attention_tile_tokens: int | None = None
    fused_norm: bool = False
    fused_mlp: bool = False
    masked_row: int | None = None


#: The smallest card a plan is made for: the CUDA context's reserve and one step of budget.
SMALLEST_CARD = CUDA_CONTEXT_RESERVE + _BUDGET_STEP


def check_card(gpu_memory: int) -> None:
    """Refuse a card that leaves no budget once the CUDA context is on it.

    Raises:
        ValueError: If ``gpu_memory`` is below :data:`SMALLEST_CARD` (the budget would be zero or negative).
    """
    if gpu_memory < SMALLEST_CARD:
        raise ValueError(
            f"{gpu_memory:,} bytes ({gpu_memory / 2**30:.3g} GiB) is too small for a card: the CUDA context and"
            f" cuBLAS workspaces take about {CUDA_CONTEXT_RESERVE / 2**30:g} GiB of it before any tensor, so a card"
            f" needs at least {SMALLEST_CARD / 2**30:g} GiB. Give the card's whole memory, e.g. 24GiB"
            " (`nvidia-smi --query-gpu=memory.total --format=csv`)"
        )


def recommend(
    sizes: ModelSizes,
    gpu_memory: int,
    tokens: int,
    prefetch_depth: int = 2,
    offload: bool | None = None,
    kernels: StepKernels = PLAIN_KERNELS,
    masked_row: int | None = None,
) -> Recommendation:
    """The ``vram_budget``, ``block_size``, offload, loss and MLP tiling for a card of ``gpu_memory`` bytes.

    The budget is the card less :data:`CUDA_CONTEXT_RESERVE`, rounded down to a tenth of a GiB: the
    allocator's headroom is inside the plan (NOTE [ A budget is a cap on the card ] in planning/memory.py).
    Of ``block_size`` 1 and 2 the one that streams fewer bytes under that budget wins, and 2
    also when it streams at most 10% more (it copies faster); when everything fits resident,
    1 (nothing streams).

    Only when even every block streamed does not fit is the step made smaller (NOTE [ Long-context
    options ]): the layer inputs offloaded to host memory (unless ``offload`` is ``False``), else the
    chunked loss at :data:`~lightning_blockwise.longcontext.loss.DEFAULT_CHUNK_TOKENS` rows (unless
    ``kernels.loss_chunk_tokens`` is given), without offload and then with it; last, with both, the MLPs tiled in
    :data:`RECOMMENDED_MLP_TILE_TOKENS` tokens (unless ``kernels.mlp_tile_tokens`` is given).

    Args:
        sizes: The model's sizes.
        gpu_memory: The card's memory, in bytes.
        tokens: Tokens per micro-batch.
        prefetch_depth: Blocks copied ahead of the one in use.
        offload: ``offload_activations`` as the user set it; ``None``: chosen here.
        kernels: How the module computes the step, as given: a loss chunk or MLP tile left ``None`` is chosen where
            nothing else fits; the attention tile and Liger's kernels (``CausalLMFineTune(kernels="liger")``, or
            ``"auto"`` on CUDA with Liger-Kernel installed) are planned for as given, the fused gated activation
            for the settings without an MLP tile only, as ``CausalLMFineTune`` installs it.
        masked_row: Tokens per row where attention runs with a mask (padded or packed rows), planned for as given;
            ``None``: causal rows without padding.

    Raises:
        ValueError: If the card leaves no budget once the CUDA context is on it (:func:`check_card`).
    """
    check_card(gpu_memory)
    # Rounded down to a tenth of a GiB, so that it reads as the string to put in a config ("19.5GiB").
    budget = int((gpu_memory - CUDA_CONTEXT_RESERVE) / _BUDGET_STEP) * _BUDGET_STEP
    # NOTE [ Long-context options ]
    # Offload costs host RAM and link traffic but trains the same numbers; the chunked loss is a
    # change to the module and not bit-identical to Hugging Face's (NOTE [ Chunked loss ] in
    # loss.py). So the plain step is tried first, then offload; where the loss has to be chunked,
    # offload is needed again only if the chunked loss alone does not fit (at 16k tokens a 7B
    # model's logits take 30 GB: the chunked loss, not offload, is what brings it under a card).
    # Offload is chosen as the strategy's `offload_activations=None` chooses it: only when the
    # step does not fit without. The tiled MLP comes last: it too is the module's and not bit-identical,
    # and its forward runs again per tile (27-30% slower steps, benchmarks/RESULTS.md), so it is added only
    # where offload and the chunked loss together still leave one layer's backward too big for the card.
    offloads = [False, True] if offload is None else [offload]
    chunks = [kernels.loss_chunk_tokens] if kernels.loss_chunk_tokens is not None else [None, DEFAULT_CHUNK_TOKENS]
    options = [(flag, chunk, kernels.mlp_tile_tokens) for chunk in chunks for flag in offloads]
    if kernels.mlp_tile_tokens is None:
        options.append((offloads[-1], chunks[-1], RECOMMENDED_MLP_TILE_TOKENS))
    for offload_inputs, chunk, tile in options:
        setting = replace(kernels, loss_chunk_tokens=chunk, mlp_tile_tokens=tile)
        advice = _recommend_blocks(
            sizes, gpu_memory, budget, tokens, prefetch_depth, offload_inputs, setting, masked_row
        )
        if advice.plan is not None:
            return advice
    return advice


def _recommend_blocks(
    sizes: ModelSizes,
    gpu_memory: int,
    budget: int,
    tokens: int,
    prefetch_depth: int,
    offload_inputs: bool,
    kernels: StepKernels,
    masked_row: int | None = None,
) -> Recommendation:
    """:func:`recommend`'s choice of ``block_size`` for one setting of offload, loss and MLP tiling."""
    kernels = kernels.as_installed()

    def residency(block_size: int, budget: int | None = None) -> ResidencyPlan:
        return sizes.residency(
            tokens, block_size, prefetch_depth, budget, offload_inputs, kernels, masked_row=masked_row
        )

    shape = sizes.shape(tokens, offload_inputs, kernels, masked_row)
    options = {
        "offload_activations": offload_inputs,
        "offload_host_bytes": shape.offloaded_host_bytes(),
        "masked_row": masked_row,
        **asdict(kernels),
    }
    minimum = residency(1).minimum
    streamed: dict[int, tuple[int, ResidencyPlan]] = {}
    for block_size in (1, 2)[: sizes.num_layers]:
        if residency(block_size).minimum > budget:
            continue
        plan = residency(block_size, budget)
        blocks = sizes.block_bytes(block_size)
        streamed[block_size] = (sum(b for i, b in enumerate(blocks) if i not in plan.resident), plan)
    if not streamed:
        return Recommendation(gpu_memory, budget, 1, None, minimum, **options)
    best = 1 if 1 in streamed else 2
    if best == 1 and 2 in streamed and 0 < streamed[2][0] <= _BLOCK_SIZE_2_TOLERANCE * streamed[1][0]:
        best = 2
    return Recommendation(gpu_memory, budget, best, streamed[best][1], minimum, **options)
