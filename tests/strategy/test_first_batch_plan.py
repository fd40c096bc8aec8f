"""The first plan is made for the first training batch when nothing declares a count (issue 43, "also found").

NOTE [ The first batch read ahead ] in strategy/step_tokens.py: the batch is built ahead without iterating the
loader, and the run draws, shuffles and trains exactly as it would have without the read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning.step_budget import StepBudget
from lightning_blockwise.strategy import step_tokens
from lightning_blockwise.strategy.step_planner import StepPlanner
from lightning_blockwise.strategy.step_tokens import DEFAULT_TOKENS, first_batch
from tests.helpers.models import CausalLMModule, build_model, padded_batches, trainer
from tests.strategy.made_up import made_up_budget

#: The rows' tokens: 2 rows of 12 per batch, far below the 2048 planned for without a count.
ROWS, SEQ = 2, 12


class _SeenBatches(CausalLMModule):
    """Records the input ids of every training batch, to compare which batches trained."""

    def __init__(self) -> None:
        super().__init__(lambda: build_model("llama"))
        self.seen: list[Tensor] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append(batch["input_ids"].clone())
        return super().training_step(batch, batch_idx)


def _examples() -> list[dict[str, Tensor]]:
    """Eight rows, batched by the loader (a map-style dataset, shuffled from torch's global generator)."""
    rows = padded_batches(4, batch_size=ROWS, seq=SEQ)
    return [{key: value[i] for key, value in batch.items()} for batch in rows for i in range(ROWS)]


def _run(strategy: BlockwiseStrategy, generator: torch.Generator | None = None) -> tuple[_SeenBatches, Tensor]:
    """Fit 4 steps from seed 0 on a shuffled loader; the module and torch's global RNG state after.

    Args:
        strategy: The strategy to fit with.
        generator: The loader's own generator (its sampler shuffles with it), else torch's global one.
    """
    module = _SeenBatches()
    pl.seed_everything(0, verbose=False)
    data = DataLoader(_examples(), batch_size=ROWS, shuffle=True, generator=generator)
    trainer(strategy, accumulate_grad_batches=1).fit(module, data)
    return module, torch.get_rng_state()


def test_the_first_plan_is_for_the_first_batch() -> None:
    strategy = BlockwiseStrategy()
    module, _ = _run(strategy)
    assert strategy._planner is not None and strategy._planner.plan is not None
    assert strategy._planner.plan.tokens == ROWS * SEQ and len(module.seen) == 4


def test_reading_the_first_batch_ahead_changes_no_batch_and_no_rng() -> None:
    """The run that reads ahead trains the batches, losses and RNG of one that is told the count (no read)."""
    read, read_rng = _run(BlockwiseStrategy())
    told, told_rng = _run(BlockwiseStrategy(budget_tokens=ROWS * SEQ))
    assert len(read.seen) == len(told.seen) == 4
    assert all(torch.equal(a, b) for a, b in zip(read.seen, told.seen, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(read.losses, told.losses, strict=True))
    assert torch.equal(read_rng, told_rng)


def test_control_reading_ahead_without_restoring_the_rng_changes_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: with the RNG left as the read leaves it, the shuffle draws another order: the test above can fail."""

    @contextlib.contextmanager
    def nothing_kept() -> Iterator[None]:
        yield

    told, _ = _run(BlockwiseStrategy(budget_tokens=ROWS * SEQ))
    monkeypatch.setattr(step_tokens, "kept_rng_states", nothing_kept)
    read, _ = _run(BlockwiseStrategy())
    assert not all(torch.equal(a, b) for a, b in zip(read.seen, told.seen, strict=True))


def test_a_sampler_with_its_own_generator_keeps_its_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The read draws from a copy of the sampler (its generator with it); control: from the sampler itself, it
    advances the generator the run shuffles with, and another order trains."""
    told, _ = _run(BlockwiseStrategy(budget_tokens=ROWS * SEQ), torch.Generator().manual_seed(5))
    read, _ = _run(BlockwiseStrategy(), torch.Generator().manual_seed(5))
    assert all(torch.equal(a, b) for a, b in zip(read.seen, told.seen, strict=True))
    monkeypatch.setattr(step_tokens, "copy", SimpleNamespace(deepcopy=lambda value, memo=None: value))
    uncopied, _ = _run(BlockwiseStrategy(), torch.Generator().manual_seed(5))
    assert not all(torch.equal(a, b) for a, b in zip(uncopied.seen, told.seen, strict=True))


def test_the_batch_read_ahead_is_the_first_that_trains() -> None:
    """Unshuffled: the batch built ahead equals the first batch the step sees."""
    seen: list[Tensor] = []

    class _Peek(_SeenBatches):
        def on_fit_start(self) -> None:
            batch, why = first_batch(self.trainer)
            assert why is None
            seen.append(batch["input_ids"])

    module = _Peek()
    pl.seed_everything(0, verbose=False)
    trainer(BlockwiseStrategy(), accumulate_grad_batches=1).fit(module, DataLoader(_examples(), batch_size=ROWS))
    assert torch.equal(seen[0], module.seen[0])


def _budgets() -> tuple[StepBudget, int]:
    """This model's step budget (planned for the first batch, unbudgeted) and a budget that holds its rows only."""
    strategy = BlockwiseStrategy()
    _run(strategy)
    assert strategy._planner is not None
    budget = strategy._planner.budget
    rows, default = budget.plan(ROWS * SEQ).residency.minimum, budget.plan(DEFAULT_TOKENS).residency.minimum
    assert rows < default
    return budget, rows + 2**20


def test_a_budget_that_holds_the_rows_but_not_2048_tokens_trains() -> None:
    budget, holds_rows = _budgets()
    # The budget's own planner agrees: 2048 tokens do not fit it.
    with pytest.raises(ValueError, match=f"at {DEFAULT_TOKENS} tokens per micro-batch"):
        replace(budget, budget=holds_rows).plan(DEFAULT_TOKENS, host_bytes=2**40)
    strategy = BlockwiseStrategy(vram_budget=holds_rows)
    module, _ = _run(strategy)
    assert len(module.seen) == 4 and strategy._planner is not None
    assert strategy._planner.plan is not None and strategy._planner.plan.tokens == ROWS * SEQ


def test_control_told_2048_tokens_the_same_budget_is_refused_naming_the_count_and_the_fix() -> None:
    _, holds_rows = _budgets()
    with pytest.raises(MisconfigurationException) as refusal:
        _run(BlockwiseStrategy(vram_budget=holds_rows, budget_tokens=DEFAULT_TOKENS))
    message = str(refusal.value)
    assert f"at {DEFAULT_TOKENS} tokens per micro-batch" in message
    assert f"Planned for {DEFAULT_TOKENS} tokens per micro-batch, `budget_tokens`." in message


def test_without_a_first_batch_the_default_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the batch cannot be read ahead, the refusal says the count is the default, why, and what to set."""
    _, holds_rows = _budgets()
    monkeypatch.setattr(step_tokens, "first_batch", lambda trainer: (None, "an iterable dataset"))
    with pytest.raises(MisconfigurationException) as refusal:
        _run(BlockwiseStrategy(vram_budget=holds_rows))
    message = str(refusal.value)
    assert (
        f"Planned for {DEFAULT_TOKENS} tokens per micro-batch, the default: neither `budget_tokens` nor the data"
        " module's `max_length` and `batch_size` say, and the first training batch was not read ahead (an iterable"
        " dataset)"
    ) in message
    assert "set `BlockwiseStrategy(budget_tokens=N)` to plan for N tokens" in message


def test_a_refusal_at_the_first_batch_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control of the wording: a budget below even the rows names the first batch's shape as the count's source."""
    budget, _ = _budgets()
    too_small = budget.plan(ROWS * SEQ).residency.minimum - 2**20
    with pytest.raises(MisconfigurationException) as refusal:
        _run(BlockwiseStrategy(vram_budget=too_small))
    message = str(refusal.value)
    assert f"at {ROWS * SEQ} tokens per micro-batch" in message
    assert f"Planned for {ROWS * SEQ} tokens per micro-batch, the first training batch's ({ROWS} x {SEQ};" in message


def test_an_iterable_dataset_is_not_read_ahead() -> None:
    """Its items may be a stream that reading would consume: the default, and the reason, instead."""

    class _Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[dict[str, Tensor]]:
            return iter(_examples())

    why, trained = _why_not_read_ahead(DataLoader(_Stream(), batch_size=ROWS))
    assert why == "an iterable dataset, which reading ahead could consume" and trained == 4


def _why_not_read_ahead(data: DataLoader) -> tuple[str | None, int]:
    """Fit 4 steps on ``data``: why the first batch was not read ahead (asked at fit start), and the batches trained."""
    seen: list[str | None] = []

    class _Peek(_SeenBatches):
        def on_fit_start(self) -> None:
            seen.append(first_batch(self.trainer)[1])

    module = _Peek()
    pl.seed_everything(0, verbose=False)
    trainer(BlockwiseStrategy(), accumulate_grad_batches=1).fit(module, data)
    (why,) = seen
    return why, len(module.seen)


def test_ranks_plan_for_the_most_of_their_first_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A first batch is each rank's own: the ranks agree on the most before planning (one all-reduce, MAX); a count
    every rank shares (declared, `budget_tokens`, the default) needs none (control)."""
    ops: list[Any] = []

    def all_reduce(tensor: Tensor, op: Any, group: Any = None) -> None:
        ops.append(op)
        tensor.copy_(torch.maximum(tensor, torch.full_like(tensor, 40)))  # the other rank's first batch: 40 tokens

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    planner = StepPlanner(made_up_budget(), "`BlockwiseStrategy()`")
    assert planner.first_plan(12, per_rank=True).tokens == 40 and ops == [torch.distributed.ReduceOp.MAX]
    ops.clear()
    assert planner.first_plan(12).tokens == 12 and ops == []


def test_a_sampler_that_cannot_be_copied_is_not_read_ahead() -> None:
    """A user's sampler holding a lock (deepcopy refuses it): the default and the reason, and the run trains."""

    class _LockedSampler(torch.utils.data.Sampler[int]):
        def __init__(self) -> None:
            self.lock = threading.Lock()

        def __iter__(self) -> Iterator[int]:
            return iter(range(8))

        def __len__(self) -> int:
            return 8

    why, trained = _why_not_read_ahead(DataLoader(_examples(), batch_size=ROWS, sampler=_LockedSampler()))
    assert why is not None and why.startswith("its sampler (BatchSampler) cannot be copied") and trained == 4
