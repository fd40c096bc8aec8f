"""A run's step plan over its life: made at setup, made again before a longer batch, applied to the streamed stack."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.strategy.step_budget import StepBudget, StepPlan
from lightning_blockwise.strategy.step_tokens import batch_tokens
from lightning_blockwise.strategy.streamed_stack import StreamedStack


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
    (NOTE [ A budget that sees the batches ] in step_budget.py).

    Args:
        budget: What a step's device memory depends on.
        owner: How errors name the option they are about, e.g. ```BlockwiseStrategy(vram_budget=...)```.
    """

    def __init__(self, budget: StepBudget, owner: str) -> None:
        self.budget = budget
        self.owner = owner
        self.plan: StepPlan | None = None
        self._layers: StreamedStack | None = None
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
        """Steps run inside are not the run's (``ParityCheck``'s arms): not planned for."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def before_step(self, batch: Any) -> str | None:
        """Before a training step: plan again for a longer ``batch``; a line for the log if so.

        Raises:
            MisconfigurationException: If the longer batch does not fit the budget.
        """
        return None if self._paused else self.see_batch(batch)

    def see_batch(self, batch: Any) -> str | None:
        """Plan again before a step whose ``batch`` holds more tokens than planned for; a line for the log if so.

        Raises:
            MisconfigurationException: If the longer batch does not fit the budget.
        """
        tokens = batch_tokens(batch)
        if tokens is None or self.plan is None or tokens <= self.plan.tokens:
            return None
        self._adopt(self._plan_for(tokens))
        return f"longer batch: {self.describe()}"

    def describe(self) -> str:
        """One line for the log: tokens, peak, offload, and where the layer inputs wait where the plan chose it."""
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
            plan = self.budget.plan(tokens)
        if plan.over_card is not None:
            # Every rank plans for its own card: each says so (not rank 0 alone).
            warnings.warn(f"BlockwiseStrategy: at {tokens} tokens per micro-batch, {plan.over_card}.", stacklevel=2)
        return plan

    def _adopt(self, plan: StepPlan) -> None:
        """Make ``plan`` the run's: where its layer inputs wait, its resident blocks and its offload (between steps)."""
        assert self._layers is not None and self.plan is not None
        old, self.plan = self.plan, plan
        # NOTE [ Where layer inputs wait ] in step_budget.py: a re-plan may move them (the same levels: no change).
        self._layers.set_input_levels(plan.shape.offloaded_layers, plan.shape.checkpoint_every)
        self._layers.offload_inputs(plan.shape.input_bytes() if plan.offload else None)
        if (old.residency.resident, old.residency.kept) != (plan.residency.resident, plan.residency.kept):
            self._layers.restream(plan.residency.resident, plan.residency.kept)


__all__ = ["StepPlanner", "budget_errors"]
