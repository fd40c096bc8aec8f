"""Budgets found from the planner: the smallest one under which a plan has the wanted shape."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning.step_budget import StepBudget
from lightning_blockwise.planning.step_plan import StepPlan
from tests.helpers.models import CausalLMModule, fit


def probed_budget(build: Callable[[], Any], tokens: int) -> StepBudget:
    """The step budget ``BlockwiseStrategy`` sets up for ``build()``'s model at ``tokens`` (a one-step fit)."""
    probe = BlockwiseStrategy(budget_tokens=tokens)
    fit(CausalLMModule(build), probe, max_steps=1)
    assert probe._planner is not None
    return probe._planner.budget


def budget_where(
    step_budget: StepBudget, tokens: int, wanted: Callable[[StepPlan], bool], step: int = 2**8
) -> tuple[int, StepPlan]:
    """The smallest budget (from the plan's minimum, in ``step`` bytes) whose plan at ``tokens`` is ``wanted``."""
    minimum = dataclasses.replace(step_budget, budget=None).plan(tokens).residency.minimum
    for candidate in range(minimum, 3 * minimum, step):
        plan = dataclasses.replace(step_budget, budget=candidate, keep_activations=True).plan(tokens)
        if wanted(plan):
            return candidate, plan
    raise AssertionError(f"no budget from {minimum} to {3 * minimum} bytes gives the wanted plan at {tokens} tokens")


def keeps_every_attention(num_blocks: int) -> Callable[[StepPlan], bool]:
    """Every block streams and is recomputed, keeping its layers' attention outputs (NOTE [ Kept attention ])."""
    everything = tuple(range(num_blocks))
    return lambda plan: plan.residency.attention == everything and not plan.residency.resident
