"""Kept graphs of streamed blocks and the timed plan on the GPU: exact at a 1.5B shape (NF4, seq 512, dropout).

`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/gpu/test_gpu_timed_plan.py -s` (deterministic mode:
resident training is reproducible only there). A budget is chosen from the planner so that the compute-bound
timed plan keeps graphs of resident and of streamed blocks and recomputes others; the timed step's times are
replaced by compute-bound ones there (NOTE [ Spending the budget on time ]), and one run keeps the times the
H100 measured. Controls: blocks brought back into another slot in the backward make the run differ
(NOTE [ Slot affinity ]); with compute delayed, copies still wait for the kept graphs' backward.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning.speed import StepTimes
from lightning_blockwise.replay import remat
from lightning_blockwise.strategy import step_planner
from tests.helpers.models import (
    DEFAULT_TARGETS,
    RunResult,
    assert_equal_runs,
    fit_on_gpu,
    nf4_lora_builder,
    runs_differ,
)
from tests.helpers.streaming import StepPeak, backward_blocks_come_back_elsewhere

pytestmark = pytest.mark.gpu

SEQ = 512
STEPS = 3
ACCUMULATE = 2
#: Copies hide under compute (a 1.5B block copies in well under its forward): graphs first, streamed ones too.
COMPUTE_BOUND = StepTimes(1e-3, 2.5e-3, 1.5e-3, link_bytes_per_s=1e15, tokens=SEQ)


def _fit(path: Path, strategy: Any, **trainer_kwargs: Any) -> RunResult:
    build = nf4_lora_builder(path, DEFAULT_TARGETS, r=16, lora_dropout=0.1)
    return fit_on_gpu(build, strategy, STEPS, ACCUMULATE, SEQ, **trainer_kwargs)


@pytest.fixture(scope="module")
def deterministic() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")


@pytest.fixture(scope="module")
def budget(qwen2_checkpoint: Path, deterministic: None) -> int:
    """A budget whose compute-bound timed plan keeps graphs of >= 2 resident and >= 4 streamed blocks, not all 28."""
    probe = BlockwiseStrategy(budget_tokens=SEQ)
    build = nf4_lora_builder(qwen2_checkpoint, DEFAULT_TARGETS, r=16, lora_dropout=0.1)
    fit_on_gpu(build, probe, 1, 1, SEQ)
    assert probe._planner is not None
    step_budget = dataclasses.replace(probe._planner.budget, keep_activations=True, times=COMPUTE_BOUND)
    minimum = step_budget.plan(SEQ).residency.minimum
    for candidate in range(minimum, minimum + 2**34, 2**26):
        plan = dataclasses.replace(step_budget, budget=candidate).plan(SEQ).residency
        streamed_kept = set(plan.kept) - set(plan.resident)
        if len(plan.resident) >= 2 and len(streamed_kept) >= 4 and len(plan.kept) < 28:
            print(f"\n[timed plan] budget {candidate / 2**30:.2f} GiB: resident {plan.resident}, kept {plan.kept}")
            return candidate
    raise AssertionError("no budget gives a compute-bound plan with every kind of block")


@pytest.fixture(scope="module")
def resident(qwen2_checkpoint: Path, deterministic: None) -> Iterator[RunResult]:
    result = _fit(qwen2_checkpoint, "auto")
    yield result
    # Its grads and weights live on the device: give the memory back to the modules after this one.
    del result
    gc.collect()
    torch.cuda.empty_cache()


def test_streamed_kept_graphs_equal_resident(
    qwen2_checkpoint: Path, budget: int, resident: RunResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_planner, "step_times", lambda *args, **kwargs: COMPUTE_BOUND)
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=SEQ, timed_plan=True)
    peak = StepPeak()
    blockwise = _fit(qwen2_checkpoint, strategy, callbacks=[peak])
    plan = strategy.residency_plan
    assert plan is not None and strategy._planner is not None and set(plan.kept) - set(plan.resident)
    first = dataclasses.replace(strategy._planner.budget, times=None).plan(SEQ).residency
    print(f"\n[timed plan] steps' allocated peak {peak.allocated / 2**30:.3f} GiB; predicted: the first plan"
          f" {first.predicted_peak / 2**30:.3f} GiB, the timed one {plan.predicted_peak / 2**30:.3f} GiB")  # fmt: skip
    # The memory model of kept graphs is never under, for streamed blocks' graphs too.
    assert peak.allocated <= max(first.predicted_peak, plan.predicted_peak)
    assert_equal_runs(resident, blockwise)


def test_control_blocks_back_in_another_slot_differ(
    qwen2_checkpoint: Path, budget: int, resident: RunResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_planner, "step_times", lambda *args, **kwargs: COMPUTE_BOUND)
    backward_blocks_come_back_elsewhere(monkeypatch)
    broken = _fit(qwen2_checkpoint, BlockwiseStrategy(vram_budget=budget, budget_tokens=SEQ, timed_plan=True))
    assert runs_differ(resident, broken)


def test_streamed_kept_graphs_wait_for_delayed_compute(
    qwen2_checkpoint: Path, budget: int, resident: RunResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """~10 ms of GPU sleep before every layer's forward: the host runs far ahead, copies must still wait."""
    monkeypatch.setattr(step_planner, "step_times", lambda *args, **kwargs: COMPUTE_BOUND)
    original = remat.RematLayer.run

    def slow_run(self: remat.RematLayer, hidden: torch.Tensor, call: Any) -> torch.Tensor:
        torch.cuda._sleep(20_000_000)
        return original(self, hidden, call)

    monkeypatch.setattr(remat.RematLayer, "run", slow_run)
    delayed = _fit(qwen2_checkpoint, BlockwiseStrategy(vram_budget=budget, budget_tokens=SEQ, timed_plan=True))
    assert_equal_runs(resident, delayed)


def test_measured_times_plan_equals_resident(qwen2_checkpoint: Path, budget: int, resident: RunResult) -> None:
    """The times this GPU measures choose the plan; whichever it is, the run is exact."""
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=SEQ, timed_plan=True)
    blockwise = _fit(qwen2_checkpoint, strategy)
    assert strategy._planner is not None and strategy._planner.budget.times is not None
    plan = strategy.residency_plan
    assert plan is not None
    times = strategy._planner.budget.times
    print(f"\n[timed plan] measured: {times.describe()}; resident {plan.resident}, kept {plan.kept}")
    assert_equal_runs(resident, blockwise)
