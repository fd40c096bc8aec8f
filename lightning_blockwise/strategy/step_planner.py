"""A run's step plan over its life: made at setup, made again before a longer batch, applied to the streamed stack."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.residency.stream_trace import Tee, Trace
from lightning_blockwise.strategy.step_budget import StepBudget, StepPlan, batch_tokens
from lightning_blockwise.strategy.step_timing import link_rate, step_times
from lightning_blockwise.strategy.streamed_stack import StreamedStack

#: The training step (counted from 0) timed for the plan: the first one also pays for warming up
#: (cuBLAS handles, the allocator's first segments).
TIMED_STEP = 1


@contextmanager
def budget_errors(owner: str) -> Iterator[None]:
    """The planner's and the allocator cap's ``ValueError`` as the user's mistake, prefixed with ``owner``."""
    try:
        yield
    except ValueError as error:
        raise MisconfigurationException(f"{owner}: {error}") from None


class StepPlanner:
    """Holds the run's :class:`~.step_budget.StepPlan` and keeps the streamed stack in step with it.

    The first plan is made for a declared token count (:meth:`first_plan`, before the stack exists:
    its resident blocks decide which blocks the stack keeps on the device); :meth:`attach` then applies
    it, and :meth:`see_batch` plans again, between steps, for a batch longer than any planned for
    (NOTE [ A budget that sees the batches ] in step_budget.py). With ``timed``, :meth:`before_step`
    times one training step and plans again from what it measured (NOTE [ Spending the budget on
    time ] in planning/speed.py).

    Args:
        budget: What a step's device memory depends on.
        owner: How errors name the option they are about, e.g. ```BlockwiseStrategy(vram_budget=...)```.
        timed: Time a training step and spend the budget by its times.
    """

    def __init__(self, budget: StepBudget, owner: str, timed: bool = False) -> None:
        self.budget = budget
        self.owner = owner
        self.timed = timed
        self.plan: StepPlan | None = None
        self._layers: StreamedStack | None = None
        self._steps = 0
        self._timed_step = TIMED_STEP
        self._trace: Trace | None = None
        self._trace_tokens = 0
        self._paused = 0

    def first_plan(self, tokens: int) -> StepPlan:
        """The plan for micro-batches of up to ``tokens`` tokens, made the run's.

        Raises:
            MisconfigurationException: If the step does not fit the budget even with every block streamed.
        """
        self.plan = self._plan_for(tokens)
        return self.plan

    def attach(self, layers: StreamedStack) -> None:
        """Apply the plan's offload to ``layers``, built with the plan's resident blocks, and follow it from now on."""
        assert self.plan is not None
        self._layers = layers
        layers.offload_inputs(self.plan.shape.input_bytes() if self.plan.offload else None)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Steps run inside are not the run's (``ParityCheck``'s arms): not counted, timed or planned for."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def before_step(self, batch: Any) -> list[str]:
        """Before a training step: plan again from a step just timed, or for a longer ``batch``; lines for the log.

        Raises:
            MisconfigurationException: If the longer batch does not fit the budget.
        """
        if self._paused:
            return []
        lines = [line for line in (self._end_timing(), self.see_batch(batch)) if line is not None]
        if self.timed and self._steps == self._timed_step and self._layers is not None and self.plan is not None:
            if self.budget.timing_helps(self.plan):
                self._trace = Trace(cuda=self._layers.device.type == "cuda", block_of=self._layers.plan.block_of)
                self._trace_tokens = batch_tokens(batch) or self.plan.tokens
                self._trace.start()
                self._layers.set_observer(Tee(self._layers.observer, self._trace))
        self._steps += 1
        return lines

    def see_batch(self, batch: Any) -> str | None:
        """Plan again before a step whose ``batch`` holds more tokens than planned for; a line for the log if so.

        A timed step's times are for fewer tokens then: they are dropped, and the next step is timed.

        Raises:
            MisconfigurationException: If the longer batch does not fit the budget.
        """
        tokens = batch_tokens(batch)
        if tokens is None or self.plan is None or tokens <= self.plan.tokens:
            return None
        # Times of fewer tokens do not hold for these: plan untimed, and time the next step (the plan may stream now).
        self.budget = dataclasses.replace(self.budget, times=None)
        self._timed_step = self._steps + 1
        self._adopt(self._plan_for(tokens))
        return f"longer batch: {self.describe()}"

    def after_backward(self) -> None:
        """A backward has been issued: the timed step's trace ends here, before validation or anything else runs."""
        if not self._paused:
            self._stop_trace()

    def _stop_trace(self) -> None:
        if self._trace is not None and self._trace.active and self._layers is not None:
            self._trace.stop()
            observer = self._layers.observer
            self._layers.set_observer(observer.observers[0] if isinstance(observer, Tee) else observer)

    def _end_timing(self) -> str | None:
        """Read the step timed last and plan by its times (NOTE [ Spending the budget on time ]); a line for the log."""
        trace, layers, old = self._trace, self._layers, self.plan
        if trace is None or layers is None or old is None:
            return None
        self._stop_trace()
        self._trace = None
        if layers.device.type == "cuda":
            torch.cuda.synchronize(layers.device)
        times = step_times(
            trace,
            frozenset(old.residency.kept),
            self._trace_tokens,
            probe=lambda: link_rate(layers.host_copy.arena.slabs[0], layers.device),
        )
        if times is None:
            return None
        self.budget = dataclasses.replace(self.budget, times=times)
        self._adopt(self._plan_for(old.tokens))
        before, after = self.budget.predicted_seconds(old), self.budget.predicted_seconds(self.plan)
        assert before is not None and after is not None
        return (
            f"timed training step {self._steps - 1} ({times.describe()}): {self.describe()}; predicted decoder time"
            f" {after:.3f} s per step against {before:.3f} s with the plan it ran"
        )

    def describe(self) -> str:
        """One line for the log: tokens, peak, offload."""
        assert self.plan is not None
        return self.budget.describe(self.plan)

    def resident_prefix_bytes(self, num_blocks: int) -> int:
        """Device bytes that running the first ``num_blocks`` blocks resident needs beyond the planned peak.

        See :meth:`~lightning_blockwise.strategy.blockwise.BlockwiseStrategy.resident_prefix_bytes`.
        """
        assert self._layers is not None and self.plan is not None
        return self._layers.prefix_bytes(num_blocks, self.budget.layer_graph(self.plan.tokens))

    def _plan_for(self, tokens: int) -> StepPlan:
        with budget_errors(self.owner):
            return self.budget.plan(tokens)

    def _adopt(self, plan: StepPlan) -> None:
        """Make ``plan`` the run's: its resident blocks and its offload (between steps only)."""
        assert self._layers is not None and self.plan is not None
        old, self.plan = self.plan, plan
        self._layers.offload_inputs(plan.shape.input_bytes() if plan.offload else None)
        if (old.residency.resident, old.residency.kept) != (plan.residency.resident, plan.residency.kept):
            self._layers.restream(plan.residency.resident, plan.residency.kept)


__all__ = ["StepPlanner", "budget_errors"]
