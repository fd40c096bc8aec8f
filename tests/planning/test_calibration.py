"""The memory model against every peak measured on the H100: never under, and at most 10% over.

Each point is a run recorded in ``benchmarks/RESULTS.md`` or ``benchmarks/results/*.jsonl`` (Qwen2.5 shapes,
random-init NF4 with double quantization, LoRA r=16 on all seven projections, bf16-mixed, batch 1): its shape,
tokens and options, and the peak allocated memory it measured. The prediction is the strategy's own
(``model_sizes(...).residency``, the planner ``BlockwiseStrategy`` runs at setup). The control arm is the model
before NOTE [ A layer's backward peak ]: its plan of the 131k-token point was under the measured peak.

The runs with Liger's RMSNorm and RoPE (``LIGER_POINTS``, ``StepShape.fused_norm``) are checked the same way, against
the strategy's plan for them; their control arm is the plan the strategy made then, without ``fused_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from lightning_blockwise.planning import StepShape
from lightning_blockwise.planning.activation_constants import ALLOCATOR_ROUNDING
from lightning_blockwise.planning.footprint import ModelSizes
from lightning_blockwise.planning.memory import with_headroom
from lightning_blockwise.planning.shapes import shape_config
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.planning.step_budget import StepBudget
from lightning_blockwise.planning.step_kernels import StepKernels

GiB = 2**30
#: The most a plan may be over a measured peak (and it may never be under).
OVER = 0.10


@dataclass(frozen=True)
class Point:
    """One measured run: what it trained, how, and its peak allocated bytes."""

    shape: str
    tokens: int
    measured: float
    source: str
    offload: bool = False
    chunk: int | None = None
    tile: int | None = None
    block_size: int = 1
    budget: int | None = None
    #: Blocks the run kept resident under a budget of the time (before the budget was the allocator's cap), replayed
    #: here as such: today's planner makes another plan from that budget.
    resident: int | None = None

    @property
    def name(self) -> str:
        options = [
            "offload" if self.offload else "",
            f"chunk{self.chunk}" if self.chunk else "",
            f"tile{self.tile}" if self.tile else "",
            f"bs{self.block_size}" if self.block_size != 1 else "",
            f"budget{self.budget / GiB:.1f}GiB" if self.budget else "",
            f"resident{self.resident}" if self.resident else "",
        ]
        return "-".join([self.shape, str(self.tokens), *filter(None, options)])


LONG = "RESULTS.md 'Long context' / results/h100_long_context.jsonl"
CAP = "RESULTS.md 'The budget as a cap on the card' / results/h100_long_context.jsonl"
RESIDENT = "RESULTS.md 'Long context against resident training without checkpointing'"
DEFAULTS = "RESULTS.md 'Planner prediction vs measured peak' (budget_tokens=512)"
CARDS = "RESULTS.md 'Card checks' / results/h100_card_check.jsonl (the committed model's rows)"
# The 22 GiB-capped 7B runs of docs/benchmarks.md; 32k and 131k measured again by this probe of the
# allocator's history (7.185 GB and 22.260 GB, H100, torch 2.11, transformers 5.17).
CAPPED_7B = "issue 28: 7B on a 22 GiB cap (offload, chunked loss, tiled MLP)"

POINTS = [
    Point("7b", 16384, 35.43e9, LONG),
    Point("7b", 16384, 32.15e9, LONG, offload=True),
    Point("7b", 16384, 13.25e9, LONG, chunk=4096),
    Point("7b", 16384, 9.96e9, LONG, offload=True, chunk=4096),
    Point("7b", 16384, 7.34e9, LONG, offload=True, chunk=1024),
    Point("7b", 16384, 4.67e9, LONG, offload=True, chunk=1024, tile=4096),
    Point("32b", 8192, 24.48e9, LONG),
    Point("32b", 8192, 11.81e9, LONG, offload=True, chunk=4096),
    Point("32b", 8192, 8.28e9, LONG, offload=True, chunk=1024),
    Point("32b", 8192, 7.03e9, LONG, offload=True, chunk=1024, tile=4096),
    Point("72b", 16384, 16.39e9, LONG, offload=True, chunk=4096),
    Point("72b", 16384, 16.39e9, LONG, offload=True, chunk=1024),
    Point("72b", 16384, 12.99e9, LONG, offload=True, chunk=1024, tile=4096),
    Point("72b", 32768, 18.72e9, LONG + ", 22 GiB cap", offload=True, chunk=1024, tile=4096),
    Point("7b", 32768, 7.19e9, CAPPED_7B, offload=True, chunk=1024, tile=4096),
    Point("7b", 65536, 12.2e9, CAPPED_7B, offload=True, chunk=1024, tile=4096),
    Point("7b", 131072, 22.26e9, CAPPED_7B, offload=True, chunk=1024, tile=4096),
    Point("7b", 16384, 7.95e9, CAP, offload=True, chunk=1024, budget=int(8.5 * GiB)),
    Point("7b", 16384, 7.56e9, CAP, offload=True, chunk=1024, tile=4096, budget=int(8.5 * GiB)),
    Point("7b", 2048, 6.22e9, RESIDENT),
    Point("7b", 2048, 3.97e9, RESIDENT, offload=True, chunk=1024),
    Point("7b", 4096, 10.40e9, RESIDENT),
    Point("7b", 4096, 4.03e9, RESIDENT, offload=True, chunk=1024),
    Point("32b", 2048, 9.12e9, RESIDENT),
    Point("32b", 2048, 6.15e9, RESIDENT, offload=True, chunk=1024),
    Point("7b", 512, 3.11e9, DEFAULTS),
    Point("32b", 512, 5.75e9, DEFAULTS),
    Point("72b", 512, 8.80e9, DEFAULTS),
    Point("7b", 512, 3.47e9, DEFAULTS, block_size=2),
    Point("32b", 512, 6.51e9, DEFAULTS, block_size=2),
    Point("72b", 512, 10.16e9, DEFAULTS, block_size=2),
    Point("7b", 512, 5.76e9, DEFAULTS + ", 6GB budget: 22 of 28 blocks resident", resident=22),
    Point("32b", 512, 11.29e9, DEFAULTS + ", 12GB budget: 22 of 64 blocks resident", resident=22),
    Point("7b", 1024, 4.10e9, CARDS),
    Point("7b", 1024, 13.86e9, CARDS, budget=16106127300),
    Point("7b", 1024, 14.99e9, CARDS, budget=24696061860),
    Point("32b", 1024, 7.54e9, CARDS, block_size=2),
    Point("32b", 1024, 13.81e9, CARDS, block_size=2, budget=16106127300),
    Point("32b", 1024, 21.25e9, CARDS, block_size=2, budget=24696061860),
]


@pytest.fixture(scope="module")
def sizes() -> dict[str, ModelSizes]:
    return {name: model_sizes(shape_config(name), dtype=torch.bfloat16, lora_rank=16) for name in ("7b", "32b", "72b")}


def predicted(sizes: ModelSizes, point: Point) -> int:
    """The planner's predicted peak for the run ``point`` measured."""
    plan = sizes.residency(
        point.tokens, point.block_size, budget=point.budget, offload_inputs=point.offload,
        kernels=StepKernels(loss_chunk_tokens=point.chunk, mlp_tile_tokens=point.tile),
    )  # fmt: skip
    if point.resident is None:
        return plan.predicted_peak
    # Those blocks on the device beside the three slots the streamed ones still use.
    assert sizes.num_layers - point.resident >= 3
    return plan.predicted_peak + sum(sizes.block_bytes(point.block_size)[: point.resident])


def within(predicted: float, measured: float) -> bool:
    """Never under the measured peak, and at most :data:`OVER` over it."""
    return measured <= predicted <= (1 + OVER) * measured


@pytest.mark.parametrize("point", POINTS, ids=lambda point: point.name)
def test_the_plan_is_never_under_a_measured_peak_nor_10_percent_over(
    sizes: dict[str, ModelSizes], point: Point
) -> None:
    plan = predicted(sizes[point.shape], point)
    over = plan / point.measured - 1
    print(f"{point.name}: predicted {plan / 1e9:.2f} GB, measured {point.measured / 1e9:.2f} GB, {over:+.1%}")
    assert within(plan, point.measured), f"{point.name} ({point.source}): {over:+.1%}"


def _old_activation_peak(shape: StepShape) -> int:
    """The activation model before NOTE [ A layer's backward peak ]: a tiled MLP's backward with ten hidden states."""
    inputs = 3 if shape.offload_inputs else shape.num_layers
    assert shape.mlp_tile_tokens is not None and shape.loss_chunk_tokens is not None
    hidden = shape.tokens * shape.hidden_size * shape.activation_bytes
    working = 10 * hidden + 6 * shape.mlp_tile_tokens * shape.intermediate_size * shape.activation_bytes
    dequantized = 2 * shape.hidden_size * shape.intermediate_size * shape.activation_bytes
    logits = int(shape.loss_chunk_tokens * shape.vocab_size * 12.5)
    return int(((inputs + 4) * hidden + max(logits, working + dequantized)) * 1.02)


def test_control_the_model_without_the_norm_peak_was_under_at_131k_tokens(sizes: dict[str, ModelSizes]) -> None:
    """The control arm: the old model fails the check where the strategy's log said 19.68 GB and 22.26 were used."""
    seven = sizes["7b"]
    point = next(p for p in POINTS if p.tokens == 131072)
    shape = seven.shape(point.tokens, point.offload, StepKernels(point.chunk, point.tile))
    new = predicted(seven, point)
    old = new - shape.activation_peak() + _old_activation_peak(shape)
    assert round(old / 1e9, 2) == 19.68  # what BlockwiseStrategy logged for this run before the fix
    assert not within(old, point.measured)
    assert within(new, point.measured)
    # And the check has a ceiling: the old model's 7B/16k tiled plan was 16% over its measured peak.
    tiled = seven.shape(16384, True, StepKernels(1024, 4096))
    old_tiled = predicted(seven, POINTS[5]) - tiled.activation_peak() + _old_activation_peak(tiled)
    assert POINTS[5].tile == 4096 and not within(old_tiled, POINTS[5].measured) and old_tiled > POINTS[5].measured


@pytest.mark.parametrize("tile", [1024, 16384])
def test_tiled_attention_changes_no_prediction_of_the_measured_points(sizes: dict[str, ModelSizes], tile: int) -> None:
    """With Hugging Face's RMSNorm the norm's backward stays above attention's (NOTE [ A layer's backward peak ])."""
    for point in POINTS:
        model = sizes[point.shape]
        kernels = StepKernels(loss_chunk_tokens=point.chunk, mlp_tile_tokens=point.tile)
        with_tile = replace(kernels, attention_tile_tokens=tile)
        untiled = model.residency(point.tokens, point.block_size, budget=point.budget, offload_inputs=point.offload,
                                  kernels=kernels)  # fmt: skip
        tiled = model.residency(point.tokens, point.block_size, budget=point.budget, offload_inputs=point.offload,
                                kernels=with_tile)  # fmt: skip
        assert tiled == untiled, point.name
        # Control: the tile reached the memory model, whose attention peak did shrink.
        shape = model.shape(point.tokens, offload_inputs=point.offload, kernels=kernels)
        tiled_shape = model.shape(point.tokens, offload_inputs=point.offload, kernels=with_tile)
        assert tiled_shape.attention_tile_tokens == tile
        if tile < point.tokens:
            assert tiled_shape.attention_working_set() < shape.attention_working_set()


# --- Liger's RMSNorm (issues 27 and 28) ----------------------------------------------------------------------------

SESSION = "RESULTS.md 'Session of 2026-11-26 03:51'"


@dataclass(frozen=True)
class LigerPoint:
    """One 7B run with Liger's RMSNorm and RoPE (no adapter dropout, chunked loss of 1024 rows), and what was planned.

    ``planned`` is the peak the strategy logged then, from the model without ``fused_norm``: replaying it checks that
    the point is the run's configuration. A point with a ``budget`` (the card's, one that reproduces that plan) is
    evaluated at the residency that ran (``resident`` blocks, ``kept`` of them keeping their graphs), since today's
    planner keeps more there.
    """

    name: str
    tokens: int
    measured: float
    planned: float
    source: str
    mlp_tile: int | None = None
    attention_tile: int | None = None
    budget: int | None = None
    swiglu: bool = False
    resident: int = 0
    kept: int = 0
    #: The run ran out of memory on a 22 GiB cap: ``measured`` is the least it needed (allocated + the refused block).
    refused: bool = False


LONG_262K = "results/h100_long_context_7b_256k_22gib_tiledattn.jsonl"
LONG_358K = "results/h100_long_context_7b_350k_80gb.jsonl"
REFUSED_262K = "results/h100_long_context_7b_256k_22gib.jsonl"
CARD = "results/h100_peers_7b_same_machine.jsonl"
CAPPED = "results/h100_peers_7b_22gib_levels.jsonl"
LIGER_POINTS = [
    # Every block streamed, layer inputs offloaded, MLP tiled (Liger's SwiGLU off); the 65k ones with fused LoRA.
    LigerPoint("65k", 65536, 9.066e9, 12.84e9, SESSION + ", memory_peak.py", mlp_tile=4096),
    LigerPoint("65k-attn16k", 65536, 7.944e9, 12.84e9, SESSION + ", memory_peak.py", 4096, 16384),
    LigerPoint("262k-attn16k", 262144, 22.729e9, 44.877e9, LONG_262K, 4096, 16384),
    LigerPoint("358k", 358400, 39.581e9, 60.561e9, LONG_358K, 4096),
    # Out of memory on a 22 GiB cap: 20.26 GiB allocated and 7.03 GiB refused.
    LigerPoint("262k", 262144, (20.26 + 7.03) * GiB, 44.877e9, REFUSED_262K, 4096, refused=True),
    # The card as the budget, Liger's SwiGLU on, MLP untiled, fused LoRA; every layer input on the card. The rows do not
    # say the card's budget: each is one that reproduces the logged plan (21 GiB keeps 12 blocks at 32k, not 11).
    LigerPoint("4k-80GB", 4096, 25.267e9, 28.039e9, CARD, budget=79 * GiB, swiglu=True, resident=28, kept=28),
    LigerPoint("16k-80GB", 16384, 64.481e9, 73.693e9, CARD, budget=76 * GiB, swiglu=True, resident=28, kept=21),
    LigerPoint("16k-22GiB", 16384, 17.714e9, 20.328e9, CAPPED, budget=21 * GiB, swiglu=True, resident=9, kept=3),
    LigerPoint("32k-22GiB", 32768, 17.854e9, 20.226e9, CAPPED, budget=int(20.9 * GiB), swiglu=True, resident=11),
]


def with_kernels(budget: StepBudget, **changes: Any) -> StepBudget:
    """``budget`` with some of its kernels changed, as they are (as the strategy reads them from a module)."""
    return replace(budget, kernels=replace(budget.kernels, **changes))


def liger_predicted(seven: ModelSizes, point: LigerPoint, fused_norm: bool = True) -> int:
    """The planner's predicted training-step peak for the run ``point`` measured, with or without ``fused_norm``."""
    budget = seven.step_budget(
        budget=point.budget, offload=True if point.budget is None else None,
        kernels=StepKernels(loss_chunk_tokens=1024, mlp_tile_tokens=point.mlp_tile,
                            attention_tile_tokens=point.attention_tile),
    )  # fmt: skip
    # What the strategy reads from a model with Liger and without adapter dropout, and where it plans the inputs; these
    # runs predate NOTE [ Kept attention ] (their layers kept no attention outputs).
    budget = replace(
        with_kernels(budget, fused_mlp=point.swiglu), adapter_dropout=False, card=point.budget is not None,
        choose_inputs=point.budget is not None, keep_attention=False,
    )  # fmt: skip
    then = budget.plan(point.tokens, host_bytes=100 * 10**9)
    residency = then.residency
    assert abs(residency.predicted_peak - point.planned) < 0.01e9, (point.name, residency.predicted_peak)
    assert (len(residency.resident), len(residency.kept)) == (point.resident, point.kept), point.name
    if not fused_norm:
        return residency.predicted_peak
    if point.budget is None:
        return with_kernels(budget, fused_norm=True).plan(point.tokens).residency.predicted_peak
    # The residency that ran, with the memory model of Liger's RMSNorm: its activations and its kept graphs.
    old, new = then.shape, replace(then.shape, fused_norm=True)
    graphs = sum(budget.block_layers[block] for block in residency.kept) * (new.layer_graph() - old.layer_graph())
    return residency.predicted_peak + new.activation_peak() - old.activation_peak() + graphs


@pytest.mark.parametrize("point", LIGER_POINTS, ids=lambda point: point.name)
def test_with_liger_the_plan_is_never_under_a_measured_peak_nor_10_percent_over(
    sizes: dict[str, ModelSizes], point: LigerPoint
) -> None:
    plan = liger_predicted(sizes["7b"], point)
    over = plan / point.measured - 1
    print(f"{point.name}: predicted {plan / 1e9:.2f} GB, measured {point.measured / 1e9:.2f} GB, {over:+.1%}")
    if point.refused:
        # Only a floor was measured: the plan must not let the run start under its 22 GiB cap.
        assert plan >= point.measured > 22 * GiB, f"{point.name} ({point.source}): {over:+.1%}"
    else:
        assert within(plan, point.measured), f"{point.name} ({point.source}): {over:+.1%}"


def test_control_without_fused_norm_every_liger_point_is_over_by_more_than_10_percent(
    sizes: dict[str, ModelSizes],
) -> None:
    """The control arm: the same points, planned as the strategy did then (what it logged), miss the ceiling."""
    seven = sizes["7b"]
    for point in LIGER_POINTS:
        old, new = liger_predicted(seven, point, fused_norm=False), liger_predicted(seven, point)
        assert old > (1 + OVER) * point.measured and old > new, point.name


def test_with_liger_the_planner_keeps_more_blocks_under_the_same_budgets(sizes: dict[str, ModelSizes]) -> None:
    """Issue 27: the 22 GiB-capped runs kept 9 and 11 blocks resident; with ``fused_norm`` those budgets keep more."""
    for point in LIGER_POINTS[-2:]:
        budget = replace(
            with_kernels(sizes["7b"].step_budget(budget=point.budget, kernels=StepKernels(1024)), fused_mlp=True),
            adapter_dropout=False, card=True, choose_inputs=True, keep_attention=False,
        )  # fmt: skip
        then = budget.plan(point.tokens, host_bytes=100 * 10**9).residency
        now = with_kernels(budget, fused_norm=True).plan(point.tokens, host_bytes=100 * 10**9).residency
        assert len(then.resident) == point.resident and len(now.resident) > point.resident, point.name
        assert with_headroom(now.predicted_peak) <= point.budget  # still a plan within the budget


# --- Input checkpoints at 72B (issue 28) ----------------------------------------------------------------------------

#: 72B, every block streamed, layer inputs offloaded with ``input_checkpoint_every=2``, chunked loss (1024), tiled MLP
#: (4096) and attention (16384), Liger's RMSNorm and RoPE, no adapter dropout: (tokens, measured peak, the plan the
#: strategy logged then, with a segment's 2 replayed inputs counted on the card beside the 3 in flight).
K2_POINTS = [
    (65536, 19.329e9, 23.111e9, "results/h100_long_context_72b_64k_22gib.jsonl (22 GiB cap)"),
    (98304, 25.391e9, 30.477e9, "results/h100_long_context_72b_96k_80gb.jsonl (whole card)"),
]


@pytest.mark.parametrize(("tokens", "measured", "logged", "source"), K2_POINTS, ids=["64k", "96k"])
def test_with_input_checkpoints_in_host_memory_the_plan_is_within_10_percent(
    sizes: dict[str, ModelSizes], tokens: int, measured: float, logged: float, source: str
) -> None:
    """NOTE [ Input checkpoints ]: a segment's inputs and the next checkpoint coming back, less those in flight.

    Control: the count the strategy logged for these runs (a segment's k replayed inputs on top of the in-flight
    ones) is reproduced, and is more than 10% over.
    """
    budget = sizes["72b"].step_budget(
        offload=True,
        kernels=StepKernels(loss_chunk_tokens=1024, mlp_tile_tokens=4096, attention_tile_tokens=16384, fused_norm=True),
    )
    budget = replace(budget, adapter_dropout=False, checkpoint_every=2)
    plan = budget.plan(tokens)
    assert plan.shape.checkpoint_every == 2 and plan.offload and plan.residency.resident == ()
    new = plan.residency.predicted_peak
    over = new / measured - 1
    print(f"72b {tokens} k=2: predicted {new / 1e9:.2f} GB, measured {measured / 1e9:.2f} GB, {over:+.1%}")
    assert within(new, measured), f"{source}: {over:+.1%}"
    two_inputs = 2 * plan.shape.input_bytes()
    old = new + int(two_inputs * ALLOCATOR_ROUNDING)
    assert abs(old - logged) < 0.01e9, (old, logged)
    assert not within(old, measured)
