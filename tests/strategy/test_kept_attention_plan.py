"""The planner's kept attention at the 7B shape on a 24 GB card (NOTE [ Kept attention ], [ Where layer inputs wait ]).

The plans of the H200 runs of ``benchmarks/RESULTS.md`` ("Session of 2026-11-29 06:45"): Liger's kernels, no adapter
dropout, the chunked loss, a 21.3 GiB budget (what the card's budget leaves of a 22 GiB cap), host memory to spare.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_blockwise.planning.shapes import shape_config
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.planning.step_budget import KEPT_ATTENTION_MIN_FLOPS, StepBudget
from lightning_blockwise.planning.step_kernels import StepKernels

HOST = 100 * 10**9
#: Liger's kernels and the chunked loss, as the runs had them.
LIGER = StepKernels(loss_chunk_tokens=1024, fused_norm=True, fused_mlp=True)


@pytest.fixture(scope="module")
def budget() -> StepBudget:
    seven = model_sizes(shape_config("7b"), dtype=torch.bfloat16, lora_rank=16)
    planned = seven.step_budget(budget=int(21.3 * 2**30), kernels=LIGER)
    return dataclasses.replace(planned, adapter_dropout=False, card=True, choose_inputs=True)


def test_every_recomputed_layer_keeps_its_attention_outputs_at_16k(budget: StepBudget) -> None:
    plan = budget.plan(16384, host_bytes=HOST)
    residency = plan.residency
    assert plan.inputs is not None and plan.inputs.levels.host_count == 0 and not plan.inputs.for_kept
    assert residency.kept == (0, 1) and residency.attention == tuple(range(2, 28))
    # Control: without kept attention the budget buys graphs and residency only, and 26 layers recompute everything.
    without = dataclasses.replace(budget, keep_attention=False).plan(16384, host_bytes=HOST).residency
    assert without.attention == () and len(without.kept) < 28 - 20


def test_at_32k_the_inputs_make_room_for_every_layer_s_attention_outputs(budget: StepBudget) -> None:
    plan = budget.plan(32768, host_bytes=HOST)
    assert plan.inputs is not None and plan.inputs.for_kept and plan.inputs.levels.host_count == 28
    assert plan.residency.attention == tuple(range(28)) and plan.offload
    # Control: with host memory for none of them, the inputs stay on the card and 10 layers keep attention outputs.
    on_card = budget.plan(32768, host_bytes=0)
    assert (
        on_card.inputs is not None and on_card.inputs.levels.host_count == 0 and len(on_card.residency.attention) == 10
    )


def test_at_4k_attention_is_under_the_floor_and_nothing_keeps_it(budget: StepBudget) -> None:
    """0.12 TFLOP per layer at 4k: the dispatch mode's host time outweighs it (KEPT_ATTENTION_MIN_FLOPS)."""
    plan = budget.plan(4096, host_bytes=HOST)
    assert plan.shape.attention_flops() < KEPT_ATTENTION_MIN_FLOPS < budget.plan(16384).shape.attention_flops()
    assert plan.residency.attention == () and plan.residency.kept


#: The H200 runs of RESULTS "Session of 2026-11-29 06:45" (call 5): tokens, the card's budget that reproduces the logged
#: plan (the rows do not record it), the plan's resident / kept / attention blocks and predicted peak, and the measured
#: peak allocated.
MEASURED = [
    (16384, 20.8, (12, 2, 26), 20.155317542e9, 18.560081408e9),
    (32768, 20.9, (10, 0, 28), 20.21055283e9, 18.068076032e9),
]


@pytest.mark.parametrize(("tokens", "gib", "blocks", "logged", "measured"), MEASURED, ids=["16k", "32k"])
def test_the_kept_attention_plans_were_never_under_their_measured_peaks(
    tokens: int, gib: float, blocks: tuple[int, int, int], logged: float, measured: float
) -> None:
    """Never under (an OOM); 8.6% and 11.9% over: the backward frees the records layer by layer (calibration left)."""
    seven = model_sizes(shape_config("7b"), dtype=torch.bfloat16, lora_rank=16)
    planned = seven.step_budget(budget=int(gib * 2**30), kernels=LIGER)
    budget = dataclasses.replace(planned, adapter_dropout=False, card=True, choose_inputs=True)
    residency = budget.plan(tokens, host_bytes=HOST).residency
    assert (len(residency.resident), len(residency.kept), len(residency.attention)) == blocks
    assert abs(residency.predicted_peak - logged) < 0.01e9  # the run's own plan, replayed
    assert measured <= residency.predicted_peak <= 1.15 * measured
