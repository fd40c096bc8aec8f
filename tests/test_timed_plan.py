"""A timed plan (NOTE [ Spending the budget on time ]) and kept graphs of streamed blocks (NOTE [ Kept graphs of
streamed blocks ]): exact against resident training, with dropout, whichever way the timed step tips the plan.

The timed step's times are replaced by fixed ones where a test needs the plan to tip one way (the CPU's own times
tip it as they happen to fall); one test runs on the times the CPU measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import ResidencyPlan
from lightning_blockwise.planning.speed import StepTimes
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.strategy import step_planner
from lightning_blockwise.strategy.step_budget import StepBudget
from tests.helpers.models import (
    SEQ,
    CausalLMModule,
    RunResult,
    assert_equal_runs,
    build_model,
    collect,
    fit,
    loader,
    padded_batches,
    runs_differ,
    trainer,
    trainer_optimizer,
)
from tests.helpers.streaming import backward_blocks_come_back_elsewhere

NUM_LAYERS = 8
TOKENS = 2 * SEQ
#: Copies hide under compute: graphs first, streamed blocks' too.
COMPUTE_BOUND = StepTimes(1e-3, 2.5e-3, 1.5e-3, link_bytes_per_s=1e15, tokens=TOKENS)
#: Copies take far longer than compute: residency first.
LINK_BOUND = StepTimes(1e-3, 2.5e-3, 1.5e-3, link_bytes_per_s=1e3, tokens=TOKENS)


@pytest.fixture(scope="module")
def checkpoint(tiny_llama8_checkpoint: Path) -> Path:
    return tiny_llama8_checkpoint


def _module(checkpoint: Path) -> CausalLMModule:
    return CausalLMModule(lambda: build_model("llama", checkpoint=checkpoint, quantized=True))


@pytest.fixture(scope="module")
def step_budget(checkpoint: Path) -> StepBudget:
    probe = BlockwiseStrategy(budget_tokens=TOKENS)
    fit(_module(checkpoint), probe, max_steps=1)
    assert probe._planner is not None
    return dataclasses.replace(probe._planner.budget, keep_activations=True)


def _find_budget(step_budget: StepBudget, wanted: Callable[[ResidencyPlan, ResidencyPlan], bool]) -> int:
    """The smallest budget whose first plan and compute-bound timed plan are as ``wanted``."""
    minimum = step_budget.plan(TOKENS).residency.minimum
    for candidate in range(minimum, minimum + 2**21, 2**12):
        first = dataclasses.replace(step_budget, budget=candidate).plan(TOKENS).residency
        timed = dataclasses.replace(step_budget, budget=candidate, times=COMPUTE_BOUND).plan(TOKENS).residency
        if wanted(first, timed):
            return candidate
    raise AssertionError("no budget gives the plans wanted")


@pytest.fixture(scope="module")
def budget(step_budget: StepBudget) -> int:
    """A budget whose compute-bound timed plan has every kind of block: resident and kept, streamed and kept
    (at least 2), streamed and recomputed. (This model's graphs are 7x its blocks, so its first plan makes
    every block resident and keeps the first graphs.)
    """

    def wanted(first: ResidencyPlan, timed: ResidencyPlan) -> bool:
        streamed_kept = set(timed.kept) - set(timed.resident)
        return len(timed.resident) >= 2 and len(streamed_kept) >= 2 and len(timed.kept) < NUM_LAYERS

    return _find_budget(step_budget, wanted)


@pytest.fixture(scope="module")
def streaming_budget(step_budget: StepBudget) -> int:
    """A budget whose first plan streams some blocks, keeps graphs and makes more blocks resident than it keeps."""
    return _find_budget(step_budget, lambda first, _: 0 < len(first.kept) < len(first.resident) < NUM_LAYERS)


@pytest.fixture(scope="module")
def resident(checkpoint: Path) -> Any:
    return fit(_module(checkpoint), "auto")


class _Plans(Callback):
    """The plan in force at each micro-batch's start, and each layer's attention forwards."""

    def __init__(self) -> None:
        self.plans: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.counts = [0] * NUM_LAYERS

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for index, layer in enumerate(pl_module.model.get_decoder().layers):
            # Counted in the module's forward: a hook fires once per step (replay/hooks.py), a forward per run.
            attn, forward = layer.self_attn, layer.self_attn.forward
            attn.forward = lambda *a, index=index, forward=forward, **k: (self._count(index), forward(*a, **k))[1]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        plan = trainer.strategy.step_plan
        self.plans.append((plan.residency.resident, plan.residency.kept))

    def _count(self, index: int) -> None:
        self.counts[index] += 1


def _timed_as(monkeypatch: pytest.MonkeyPatch, times: StepTimes) -> None:
    monkeypatch.setattr(step_planner, "step_times", lambda *args, **kwargs: times)


def test_streamed_blocks_keep_their_graphs_exactly(
    checkpoint: Path, budget: int, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _timed_as(monkeypatch, COMPUTE_BOUND)
    plans = _Plans()
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
    blockwise = fit(_module(checkpoint), strategy, callbacks=[plans])
    assert_equal_runs(resident, blockwise)
    first, timed = plans.plans[0], plans.plans[-1]
    # Micro-batches 0 and 1 ran the first plan; from micro-batch 2 on, the timed one.
    assert plans.plans[:2] == [first] * 2 and plans.plans[2:] == [timed] * 6
    streamed_kept = set(timed[1]) - set(timed[0])
    assert len(timed[1]) > len(first[1]) and streamed_kept
    # A kept layer runs once per micro-batch; a recomputed one twice.
    for layer in range(NUM_LAYERS):
        expected = [1 if layer in plan[1] else 2 for plan in plans.plans]
        assert plans.counts[layer] == sum(expected), f"layer {layer}"


def test_control_a_kept_graph_whose_block_comes_back_elsewhere_differs(
    checkpoint: Path, budget: int, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: the backward brings streamed blocks into another slot than the forward's; kept graphs read stale bytes.

    The same displacement with graphs kept on resident blocks only (`timed_plan=False`) stays exact: the recompute reads
    the block where it is now, so what the control breaks is the affinity kept graphs of streamed blocks need.
    """
    _timed_as(monkeypatch, COMPUTE_BOUND)
    backward_blocks_come_back_elsewhere(monkeypatch)
    broken = fit(_module(checkpoint), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True))
    assert runs_differ(resident, broken)
    untimed = fit(_module(checkpoint), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=False))
    assert_equal_runs(resident, untimed)


def test_a_link_bound_step_spends_on_residency(
    checkpoint: Path, budget: int, streaming_budget: int, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Link-bound, graphs stay with resident blocks, and the budget buys residency before graphs."""
    _timed_as(monkeypatch, LINK_BOUND)
    for vram_budget, more_resident in ((budget, False), (streaming_budget, True)):
        plans = _Plans()
        strategy = BlockwiseStrategy(vram_budget=vram_budget, budget_tokens=TOKENS, timed_plan=True)
        blockwise = fit(_module(checkpoint), strategy, callbacks=[plans])
        assert_equal_runs(resident, blockwise)
        first, timed = plans.plans[0], plans.plans[-1]
        assert strategy._planner is not None and strategy._planner.budget.times == LINK_BOUND
        # Kept graphs only where the block is resident. Where the first plan streams blocks and keeps a graph
        # (7x a block here), the timed one gives the graph up for residency: every block resident.
        assert set(timed[1]) <= set(timed[0])
        assert len(timed[0]) > len(first[0]) if more_resident else timed == first


def test_the_cpu_times_its_step_and_stays_exact(checkpoint: Path, budget: int, resident: Any) -> None:
    """No times replaced: the CPU's own (host clock) times choose the plan, whatever they choose is exact."""
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
    blockwise = fit(_module(checkpoint), strategy)
    assert_equal_runs(resident, blockwise)
    assert strategy._planner is not None
    times = strategy._planner.budget.times
    assert times is not None and times.tokens == TOKENS
    assert min(times.forward_s, times.recomputed_backward_s, times.kept_backward_s, times.link_bytes_per_s) > 0


@pytest.mark.parametrize(
    "options",
    [dict(), dict(keep_activations=False, timed_plan=True), dict(vram_budget=None, timed_plan=True)],
    ids=["default", "no keep", "no budget"],
)
def test_no_timing_where_it_cannot_change_the_plan(checkpoint: Path, budget: int, options: dict[str, Any]) -> None:
    kwargs = dict(vram_budget=budget, budget_tokens=TOKENS) | options
    strategy = BlockwiseStrategy(**kwargs)
    fit(_module(checkpoint), strategy, max_steps=2)
    assert strategy._planner is not None and strategy._planner.budget.times is None


def test_timed_plan_must_be_a_bool() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"timed_plan='yes'\)` must be True or False"):
        BlockwiseStrategy(timed_plan="yes")


def test_parity_check_steps_are_not_the_runs(
    checkpoint: Path, budget: int, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ParityCheck's arms run `training_step` too: the planner neither counts, times nor re-plans them.

    Control: without the pause the check's second arm would be the timed step (the timed plan from micro-batch 0).
    """
    from lightning_blockwise import ParityCheck

    _timed_as(monkeypatch, COMPUTE_BOUND)
    plans = _Plans()
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
    blockwise = fit(_module(checkpoint), strategy, callbacks=[ParityCheck(), plans])
    assert_equal_runs(resident, blockwise)
    assert strategy._planner is not None and strategy._planner._steps == len(plans.plans) == 8
    assert plans.plans[0] == plans.plans[1] != plans.plans[2] == plans.plans[-1]
    with monkeypatch.context() as unpaused:
        unpaused.setattr(step_planner.StepPlanner, "paused", lambda self: contextlib.nullcontext())
        plans = _Plans()
        fit(_module(checkpoint), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True),
            callbacks=[ParityCheck(), plans], max_steps=1)  # fmt: skip
        assert plans.plans[0] == plans.plans[-1] != first_plan(budget, checkpoint)


def first_plan(budget: int, checkpoint: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The untimed plan of ``budget`` (the one micro-batches 0 and 1 run)."""
    plans = _Plans()
    fit(
        _module(checkpoint), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS), callbacks=[plans], max_steps=1
    )
    return plans.plans[0]


def test_the_timed_trace_ends_with_the_backward(checkpoint: Path, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation right after the timed micro-batch stays out of its trace: every observed layer ran once each way.

    Control: a trace left on until the next training step records the validation forwards too.
    """
    traces: list[Any] = []

    def record(trace: Any, *args: Any, **kwargs: Any) -> StepTimes:
        traces.append(trace)
        return COMPUTE_BOUND

    monkeypatch.setattr(step_planner, "step_times", record)
    batches = padded_batches(8)
    val = {"val_check_interval": 2, "limit_val_batches": 2}
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
    trainer(strategy, **val).fit(_module(checkpoint), loader(batches), loader(batches[:2]))
    phases = [phase for _, phase, _, _ in traces[0].layers]
    assert phases.count(Pass.FORWARD) == phases.count(Pass.BACKWARD) > 0
    monkeypatch.setattr(step_planner.StepPlanner, "after_backward", lambda self: None)
    traces.clear()
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
    trainer(strategy, **val).fit(_module(checkpoint), loader(batches), loader(batches[:2]))
    phases = [phase for _, phase, _, _ in traces[0].layers]
    assert phases.count(Pass.FORWARD) > phases.count(Pass.BACKWARD)


class _TwoBackwards(CausalLMModule):
    """Manual optimization, two objectives through one forward (`retain_graph=True` on the first)."""

    def __init__(self, build: Any) -> None:
        super().__init__(build)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.model(**batch).loss
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(0.5 * loss)
        optimizer.step()


def test_a_second_backward_through_a_kept_streamed_layer_is_refused(
    checkpoint: Path, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error names `retain_graph` and the fix; the untimed plan (graphs on resident blocks only) runs it."""
    _timed_as(monkeypatch, COMPUTE_BOUND)

    def module() -> _TwoBackwards:
        return _TwoBackwards(lambda: build_model("llama", checkpoint=checkpoint, quantized=True))

    untimed = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS)
    trainer(untimed, accumulate_grad_batches=1).fit(module(), loader(padded_batches(4)))
    timed = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
    with pytest.raises(RuntimeError, match=r"retain_graph=True.*timed_plan=False"):
        trainer(timed, accumulate_grad_batches=1).fit(module(), loader(padded_batches(4)))


def test_the_timed_line_states_the_choice(
    checkpoint: Path, budget: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _timed_as(monkeypatch, COMPUTE_BOUND)
    # Lightning's logger does not propagate to the root logger, where `caplog` listens.
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            fit(_module(checkpoint), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True))
    finally:
        lightning_logger.removeHandler(caplog.handler)
    line = next(record.getMessage() for record in caplog.records if "timed training step 1" in record.getMessage())
    assert re.search(r"\d+ of 8 blocks resident, \d+ blocks keep their activations \(not recomputed; \d+ of them"
                     r" streamed\).*predicted decoder time [\d.]+ s per step against [\d.]+ s", line)  # fmt: skip


def test_lightnings_default_checkpoint_saves_and_resumes_a_timed_run_exactly(
    checkpoint: Path, budget: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NF4 module, `Trainer`'s own `ModelCheckpoint`: saved at the first epoch's end, resumed into the second.

    The resumed run times and re-plans again (micro-batches 0-1 of the resumed fit run the first plan); its losses,
    grads, weights and AdamW state equal the uninterrupted run's. Control: the second epoch started afresh differs.
    """
    _timed_as(monkeypatch, COMPUTE_BOUND)

    def run(root: Path, epochs: int, ckpt_path: Path | None = None) -> Any:
        module = _module(checkpoint)
        strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, timed_plan=True)
        seed_everything(0, verbose=False)
        fitted = trainer(strategy, max_steps=-1, max_epochs=epochs, enable_checkpointing=True, default_root_dir=root)
        fitted.fit(module, loader(padded_batches(8)), ckpt_path=ckpt_path)
        return collect(module, trainer_optimizer(module))

    whole = run(tmp_path / "whole", 2)
    run(tmp_path / "first", 1)
    (saved,) = (tmp_path / "first").rglob("*.ckpt")
    resumed = run(tmp_path / "second", 2, ckpt_path=saved)
    tail = RunResult(whole.losses[-8:], whole.grads[-4:], whole.weights, whole.optimizer)
    assert len(resumed.losses) == 8
    assert_equal_runs(tail, resumed)
    assert runs_differ(tail, run(tmp_path / "afresh", 1))
