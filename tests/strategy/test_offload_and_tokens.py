"""The step budget's offload decision, the tokens of batches and data modules, and re-plans before a longer batch.

Its layer-input levels (splits, input checkpoints, the card's budget) are in test_step_budget.py beside it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning.step_budget import StepBudget
from lightning_blockwise.planning.step_plan import StepPlan
from lightning_blockwise.strategy.module_budget import module_budget
from lightning_blockwise.strategy.step_tokens import batch_tokens, declared_tokens
from tests.helpers.models import SEQ, CausalLMModule, build_model, fit, padded_batches
from tests.strategy.made_up import CONFIG, TOKENS, made_up_budget

_budget = made_up_budget


def _minimum(offload: bool) -> int:
    """The smallest budget of a step at ``TOKENS`` tokens with every block streamed."""
    return _budget(offload=offload).plan(TOKENS).residency.minimum


@pytest.fixture(scope="module")
def minima() -> tuple[int, int]:
    """The minimum without and with offload; the gap is where automatic offload has to decide."""
    without, with_offload = _minimum(False), _minimum(True)
    assert without > with_offload
    return without, with_offload


def test_a_budget_that_fits_without_offload_keeps_it_off(minima: tuple[int, int]) -> None:
    without, _ = minima
    plan = _budget(budget=without).plan(TOKENS)
    assert isinstance(plan, StepPlan) and plan.tokens == TOKENS
    assert plan.offload is False and not plan.shape.offload_inputs and plan.offload_host_bytes == 0
    assert plan.residency.minimum == without


@pytest.mark.parametrize("just_below_without", [True, False], ids=["just-below-the-minimum", "the-offloaded-minimum"])
def test_a_budget_that_fits_only_with_offload_turns_it_on(minima: tuple[int, int], just_below_without: bool) -> None:
    without, with_offload = minima
    budget = without - 1 if just_below_without else with_offload
    plan = _budget(budget=budget).plan(TOKENS)
    assert plan.offload is True and plan.shape.offload_inputs
    assert plan.residency.minimum == with_offload and plan.residency.predicted_peak <= budget
    assert plan.offload_host_bytes == 8 * TOKENS * CONFIG.hidden_size * 2


def test_offload_forced_off_with_that_budget_names_the_tokens(minima: tuple[int, int]) -> None:
    without, _ = minima
    with pytest.raises(ValueError, match=f"^at {TOKENS} tokens per micro-batch, the budget") as failure:
        _budget(budget=without - 1, offload=False).plan(TOKENS)
    assert "offloaded" not in str(failure.value)


def test_nothing_fits_says_offload_was_tried(minima: tuple[int, int]) -> None:
    _, with_offload = minima
    match = f"^at {TOKENS} tokens per micro-batch with the layer inputs offloaded to host memory, the budget"
    with pytest.raises(ValueError, match=match):
        _budget(budget=with_offload - 1).plan(TOKENS)


def test_offload_forced_on_stays_on_where_it_is_not_needed(minima: tuple[int, int]) -> None:
    without, _ = minima
    assert _budget(budget=10 * without, offload=True).plan(TOKENS).offload is True


def test_device_limit_without_a_budget_decides_automatic_offload(minima: tuple[int, int]) -> None:
    without, with_offload = minima
    assert _budget(device_limit=without).plan(TOKENS).offload is False
    assert _budget(device_limit=without - 1).plan(TOKENS).offload is True
    # Without a budget nothing is refused: a limit below even the offloaded minimum still plans, with offload.
    assert _budget(device_limit=with_offload - 1).plan(TOKENS).offload is True
    # No limit (the CPU), or offload forced off: the limit decides nothing.
    assert _budget().plan(TOKENS).offload is False
    assert _budget(device_limit=without - 1, offload=False).plan(TOKENS).offload is False
    # A budget takes the limit's place.
    assert _budget(budget=without, device_limit=1).plan(TOKENS).offload is False


def test_the_cards_budget_gives_way_to_streaming_where_the_set_budget_refuses(minima: tuple[int, int]) -> None:
    # NOTE [ The card as the default budget ]: an estimate the user did not ask for does not refuse a run.
    _, with_offload = minima
    plan = _budget(budget=with_offload - 1, card=True, device_limit=with_offload - 1).plan(TOKENS)
    assert plan.residency.resident == () and plan.residency.kept == ()  # every block streamed, nothing kept
    assert plan.offload is True  # the device limit still turns offload on
    assert plan.over_card is not None and "card's budget" in plan.over_card and "loss_chunk_tokens" in plan.over_card
    # Control: the same budget set by the user is refused.
    with pytest.raises(ValueError, match="tokens per micro-batch"):
        _budget(budget=with_offload - 1, device_limit=with_offload - 1).plan(TOKENS)
    # Offload is decided against the card's budget (another job on the card), not the whole card's device limit.
    shared = _budget(budget=with_offload - 1, card=True, device_limit=100 * with_offload).plan(TOKENS)
    assert shared.over_card is not None and shared.offload is True
    # And a card's budget that holds the step plans with it, saying nothing.
    assert _budget(budget=10 * with_offload, card=True).plan(TOKENS).over_card is None


def test_batch_tokens() -> None:
    ids = torch.ones(2, 6, dtype=torch.long)
    floats = torch.ones(2, 5)
    assert batch_tokens({"input_ids": ids, "pixel_values": floats}) == 12
    assert batch_tokens({"pixel_values": floats, "tokens": torch.ones(3, dtype=torch.int32)}) == 3
    assert batch_tokens(ids) == 12
    assert batch_tokens((floats, torch.tensor(7), ids)) == 12  # floats and 0-dim tensors are not tokens
    assert batch_tokens([ids[:1]]) == 6
    assert batch_tokens(floats) is None
    assert batch_tokens((floats, floats)) is None
    assert batch_tokens({"pixel_values": floats}) is None
    assert batch_tokens(None) is None


class _DataModule(pl.LightningDataModule):
    def __init__(self, max_length: Any = None, batch_size: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()


def test_declared_tokens_from_attributes_and_hparams() -> None:
    assert declared_tokens(SimpleNamespace(max_length=128, batch_size=4)) == 512
    assert declared_tokens(_DataModule(max_length=128, batch_size=4)) == 512
    mixed = SimpleNamespace(max_length=128, hparams={"batch_size": 2})
    assert declared_tokens(mixed) == 256


@pytest.mark.parametrize(
    "datamodule",
    [
        None,
        SimpleNamespace(max_length=128),
        SimpleNamespace(hparams={"batch_size": 4}),
        _DataModule(max_length=128),
        SimpleNamespace(max_length=0, batch_size=4),
        SimpleNamespace(max_length=-128, batch_size=4),
        SimpleNamespace(max_length=128.0, batch_size=4),
        SimpleNamespace(max_length=128, batch_size=True),
        _DataModule(max_length="128", batch_size=4),
    ],
    ids=["none", "no-batch-size", "no-max-length", "hparams-missing-one", "zero", "negative", "float", "bool", "str"],
)
def test_declared_tokens_is_none_unless_both_are_positive_ints(datamodule: Any) -> None:
    assert declared_tokens(datamodule) is None


class _PlanRecording(CausalLMModule):
    """Records the tokens of each batch its step sees, and the strategy's plan at that step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, StepPlan]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append((batch["input_ids"].numel(), self.trainer.strategy.step_plan))
        return super().training_step(batch, batch_idx)


SHORT, LONG = 2 * 6, 2 * SEQ  # tokens of the micro-batches (2 rows of 6, then of SEQ = 12)


def _growing_batches() -> list[dict[str, Tensor]]:
    return padded_batches(2, seq=6) + padded_batches(2, seq=SEQ) + padded_batches(2, seq=6, seed=99)


@pytest.fixture(scope="module")
def grown() -> tuple[BlockwiseStrategy, _PlanRecording]:
    """A run planned for the short batches whose batches grow, then shrink again (3 steps of 2 micro-batches)."""
    strategy = BlockwiseStrategy(budget_tokens=SHORT)
    module = _PlanRecording(lambda: build_model("llama"))
    fit(module, strategy, _growing_batches(), max_steps=3)
    return strategy, module


def test_a_longer_batch_is_planned_for_and_plans_never_shrink(grown: tuple[BlockwiseStrategy, _PlanRecording]) -> None:
    strategy, module = grown
    assert [tokens for tokens, _ in module.seen] == [SHORT, SHORT, LONG, LONG, SHORT, SHORT]
    # The plan in force at each step: made for the short batches at setup, for the long one before its step.
    assert [plan.tokens for _, plan in module.seen] == [SHORT, SHORT, LONG, LONG, LONG, LONG]
    assert strategy.step_plan is not None and strategy.step_plan.tokens == LONG
    short_plan, long_plan = module.seen[0][1], module.seen[2][1]
    assert long_plan.residency.minimum > short_plan.residency.minimum  # a new plan, not a relabelled one
    assert strategy.step_plan is long_plan and not long_plan.offload  # no budget nor device limit on the CPU


@pytest.mark.parametrize("offload", [None, False], ids=["automatic-offload", "offload-forced-off"])
def test_a_longer_batch_over_the_budget_stops_before_its_step(
    grown: tuple[BlockwiseStrategy, _PlanRecording], offload: bool | None
) -> None:
    _, recorded = grown
    short_minimum = recorded.seen[0][1].residency.minimum
    strategy = BlockwiseStrategy(budget_tokens=SHORT, vram_budget=short_minimum + 1, offload_activations=offload)
    module = _PlanRecording(lambda: build_model("llama"))
    with pytest.raises(MisconfigurationException, match=f"at {LONG} tokens per micro-batch") as failure:
        fit(module, strategy, _growing_batches(), max_steps=3)
    # Without offload forced off the planner tried offloading the inputs first, and says so.
    assert ("with the layer inputs offloaded to host memory" in str(failure.value)) is (offload is None)
    assert f"vram_budget={short_minimum + 1}" in str(failure.value)
    # Control: the short batches fit that budget, without offload, and trained; the long one never reached its step.
    assert [tokens for tokens, _ in module.seen] == [SHORT, SHORT] and len(module.losses) == 2
    assert all(plan.tokens == SHORT and not plan.offload for _, plan in module.seen)


def test_several_ranks_count_ddps_gradient_buckets_on_each_device() -> None:
    """Under data parallelism DDP keeps a flat copy of the trainable gradients on each rank's device."""
    module = CausalLMModule(lambda: build_model("llama"))
    model = module.model
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)

    def budget(ranks: int) -> StepBudget:
        return module_budget(
            module, model, [1024] * 4, torch.device("cpu"), prefetch_depth=2, budget=None, offload=None, ranks=ranks
        )

    one, two = budget(1), budget(2)
    assert two.fixed_bytes - one.fixed_bytes == trainable > 0
    assert budget(3).fixed_bytes == two.fixed_bytes, "one set of buckets per rank, whatever the world size"
