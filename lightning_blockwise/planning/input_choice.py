"""Where a step's layer inputs wait: on the card, in host memory, or one in k kept and the others replayed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from lightning_blockwise.planning.input_levels import InputLevels, card_inputs, fewest_on_card, input_levels
from lightning_blockwise.planning.longest import GRANULARITY, longest_fit
from lightning_blockwise.planning.memory import ResidencyPlan
from lightning_blockwise.planning.step_plan import InputChoice, StepPlan
from lightning_blockwise.planning.step_shape import StepShape
from lightning_blockwise.planning.units import format_gib

# NOTE [ Where layer inputs wait ]
# A step's saved layer inputs (layers x tokens x hidden x 2 B) can wait on the card, in host memory
# (``offload_activations=m``: NOTE [ Split layer inputs ] in residency/activations.py), or only one in
# k of them, the others replayed in the backward (``input_checkpoint_every=k``: NOTE [ Input
# checkpoints ] in replay/segments.py). Where the user sets neither and the run plans for a budget
# (a ``vram_budget`` or the card's), the planner chooses both, for each plan, so again before a longer
# batch: first the most inputs the budget holds on the card beside the rest of the step with every
# block streamed (the memory model's count of inputs on the card, ``card_inputs``, is monotone, and
# the splits of every input reach each count from the inputs in flight up to all of them, so a
# bisection over the splits finds it), then ``input_levels`` for that card and the host memory free
# now: every input on the card, else the fewest in host memory, else the smallest k. Blocks stay
# resident or keep their graphs with what the budget has left, as before. Where no split and no k
# fit, the run is refused before the step, with the longest micro-batch that would fit
# (``longest_fit`` over the same choice). Without a budget, offload is decided as before: all or
# nothing against the device's limit; the card's budget that gives way to streaming (NOTE [ The card
# as the default budget ]) is one such plan, except where the host memory cannot take every input:
# there the inputs wait where the fewest stay on the card within it (``fewest_on_card``), and the
# warning says that host memory was the limit. Block-major windows keep every input on the card.
# Re-planning changes the levels between steps only, where no input is held
# (``StreamedStack.set_input_levels``).
#
# Inputs on the card save no compute: in host memory they cost copies, which overlap the step. So where
# the plan leaves layers that neither keep their graphs nor their attention outputs (NOTE [ Kept
# attention ] in replay/kept_attention.py), it also plans with as many inputs in host memory as the host
# holds, and takes that plan where it skips more forward FLOPs (kept graphs' whole forwards, kept
# attention outputs' attention forwards: ``StepShape.layer_flops``, ``attention_flops``). That is long
# context on a small card: the 7B shape at 32k tokens on a 22 GiB cap kept the attention outputs of 8 of
# 28 layers beside the inputs on the card.
#
# The host memory free for the inputs (``StepPlanner``'s, for every plan) is what the arena's own
# check sees, less its reserve, divided among the ranks on this machine (each offloads its own), plus,
# at a re-plan, this rank's current slabs: they are freed before the new ones are allocated, so they
# are room, not a shortage. With several processes every rank plans from the least of the ranks'
# rooms (one all-reduce), and a step's tokens are the most of any rank's (one all-reduce before each
# step), so every rank re-plans at the same step, from the same numbers, and chooses the same: one
# rank alone refusing would leave the others waiting in DDP's first collective.


class _Budget(Protocol):
    """What the choice reads of a :class:`~lightning_blockwise.planning.step_budget.StepBudget`."""

    num_layers: int
    activation_bytes: int
    budget: int | None
    block_layers: Sequence[int]

    def shape(self, tokens: int, offload: bool, levels: InputLevels | None = None) -> StepShape: ...

    def residency(self, shape: StepShape, budget: int | None) -> ResidencyPlan: ...

    def attention_bytes(self, shape: StepShape) -> list[int] | None: ...


def plan_inputs(budget: _Budget, tokens: int, host_bytes: int) -> StepPlan:
    """The plan at ``tokens`` tokens with the layer inputs where they fit (NOTE [ Where layer inputs wait ])."""
    try:
        choice = _choose_inputs(budget, tokens, host_bytes)
    except ValueError as error:
        longest = _longest(budget, tokens, host_bytes)
        raise ValueError(f"at {tokens} tokens per micro-batch {error} {longest}") from None
    shape = budget.shape(tokens, False, choice.levels)
    plan = StepPlan(tokens, budget.residency(shape, budget.budget), shape.offload_inputs, shape, inputs=choice)
    return _inputs_out_for_kept(budget, plan, host_bytes)


def host_limited(budget: _Budget, tokens: int, host_bytes: int, all_bytes: int) -> tuple[StepPlan, str]:
    """The unbudgeted plan whose layer inputs keep the fewest on the card within ``host_bytes``, and why."""
    one = budget.shape(tokens, False).input_bytes()
    levels = fewest_on_card(budget.num_layers, host_bytes // one)
    shape = budget.shape(tokens, False, levels)
    choice = InputChoice(levels, card_inputs(budget.num_layers, levels.host_count, levels.k), host_bytes // one)
    plan = StepPlan(tokens, budget.residency(shape, None), shape.offload_inputs, shape, inputs=choice)
    why = (
        f". Host memory was the limit too: {format_gib(host_bytes)} free for the layer inputs holds"
        f" {host_bytes // one} of the {budget.num_layers} ({format_gib(all_bytes)} to offload them all), so they"
        f" wait {levels.device_count} on the card, {levels.host_count} in host memory"
        + (f", one in {levels.k} kept" if levels.k is not None else "")
    )
    return plan, why


def _inputs_out_for_kept(budget: _Budget, plan: StepPlan, host_bytes: int) -> StepPlan:
    """``plan``, or one with more inputs in host memory skipping more compute (NOTE [ Where layer inputs wait ])."""
    assert plan.inputs is not None
    host = min(budget.num_layers, host_bytes // plan.shape.input_bytes())
    if plan.inputs.levels.k is not None or host <= plan.inputs.levels.host_count:
        return plan
    layers = budget.block_layers
    if budget.attention_bytes(plan.shape) is None or plan.residency.covered_layers(layers) == budget.num_layers:
        return plan
    levels = InputLevels(budget.num_layers - host, host, None)
    shape = budget.shape(plan.tokens, False, levels)
    try:
        residency = budget.residency(shape, budget.budget)
    except ValueError:
        return plan
    moved = StepPlan(plan.tokens, residency, True, shape, inputs=replace(plan.inputs, levels=levels, for_kept=True))
    skipped = moved.residency.skipped_flops(layers, moved.shape) > plan.residency.skipped_flops(layers, plan.shape)
    return moved if skipped else plan


def _choose_inputs(budget: _Budget, tokens: int, host_bytes: int) -> InputChoice:
    """Where the layer inputs at ``tokens`` tokens wait under the budget and ``host_bytes`` of host memory.

    Raises:
        ValueError: If no split and no checkpoint spacing fits, or the step does not fit the budget even with
            the fewest inputs on the card.
    """
    assert budget.budget is not None
    layers = budget.num_layers
    # One split of every input per count of inputs on the card (NOTE [ Where layer inputs wait ]), fewest first.
    splits = sorted({card_inputs(layers, host, None): host for host in range(layers, -1, -1)}.items())
    fitting, failure = -1, None
    low, high = 0, len(splits) - 1
    while low <= high:
        middle = (low + high) // 2
        host = splits[middle][1]
        try:
            budget.residency(budget.shape(tokens, False, InputLevels(layers - host, host, None)), budget.budget)
        except ValueError as error:
            failure, high = error, middle - 1
            continue
        fitting, low = middle, middle + 1
    if fitting < 0:
        assert failure is not None
        fewest = f"{splits[0][0]} on the card at a time, the fewest any choice keeps"
        raise ValueError(f"with the layer inputs offloaded to host memory ({fewest}), {failure}")
    shape = budget.shape(tokens, False)
    holds, one = splits[fitting][0], shape.input_bytes()
    try:
        levels = input_levels(layers, tokens, shape.hidden_size, holds * one, host_bytes, budget.activation_bytes)
    except ValueError as error:
        raise ValueError(
            f"the budget holds {holds} layer inputs on the card beside the rest of the step and the host memory"
            f" {host_bytes // one}: {error}"
        ) from None
    return InputChoice(levels, holds, host_bytes // one)


def _longest(budget: _Budget, tokens: int, host_bytes: int) -> str:
    """What a refused length says: the longest micro-batch whose layer inputs have a place, and what to change."""

    def fits(length: int) -> bool:
        try:
            _choose_inputs(budget, length, host_bytes)
        except ValueError:
            return False
        return True

    granularity = GRANULARITY if tokens > GRANULARITY else 1
    longest = longest_fit(fits, granularity, limit=tokens)
    change = (
        "raise `vram_budget`, free host memory, or make the step smaller (`loss_chunk_tokens` with a chunked"
        " loss, `mlp_tile_tokens` with tiled MLPs)"
    )
    if longest is None:
        return f"Not even {granularity} tokens per micro-batch fit this budget: {change}."
    return (
        f"The longest micro-batch that fits this budget and {format_gib(host_bytes)} of host memory for the layer"
        f" inputs is {longest} tokens: train on at most that many per micro-batch (batch size x sequence"
        f" length; at setup `budget_tokens`, else the data module's `max_length` x `batch_size`), or {change}."
    )


__all__ = ["host_limited", "plan_inputs"]
