"""Where layer inputs wait, chosen by the planner (NOTE [ Where layer inputs wait ] in planning/input_choice.py).

With a budget and neither `offload_activations` nor `input_checkpoint_every` set, the plan puts every input on the
card where the budget holds them, else splits them with host memory, else keeps one in k; it refuses what fits no
way with the longest length that would. The planner's own tests use a made-up 8-layer model; the runs, the tests'
8-layer NF4 Llama on the CPU with the host memory stood in, are `torch.equal` to resident training.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import StepShape, step_budget
from lightning_blockwise.planning.input_levels import INPUTS_IN_FLIGHT, InputLevels
from lightning_blockwise.planning.step_budget import StepBudget, host_room
from lightning_blockwise.replay.segments import Segment
from lightning_blockwise.residency.activations import ActivationOffload
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.strategy import module_budget, step_planner
from lightning_blockwise.strategy import run as strategy_run
from lightning_blockwise.strategy.step_planner import StepPlanner
from lightning_blockwise.strategy.streamed_stack import StreamedStack
from tests.helpers.callbacks import ForwardCounts
from tests.helpers.models import (
    CONFIGS,
    SEQ,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    padded_batches,
    runs_differ,
    unmasked,
)
from tests.strategy.made_up import LAYERS, ONE, TOKENS, made_up_budget


def _budget(**overrides: Any) -> StepBudget:
    return made_up_budget(**{"choose_inputs": True, **overrides})


def _holding(budget: StepBudget, count: int, tokens: int) -> int:
    """The smallest budget that holds ``count`` layer inputs on the card at a time, every block streamed.

    A split with every other input in host memory keeps ``count`` on the card (those in flight counted).
    """
    host = 0 if count >= budget.num_layers else budget.num_layers - count + INPUTS_IN_FLIGHT
    forced = replace(budget, budget=None, choose_inputs=False, offload=host > 0, offloaded_layers=host or None)
    return forced.plan(tokens).residency.minimum


def _made_up(count: int) -> int:
    return _holding(_budget(), count, TOKENS)


# --- the planner ---------------------------------------------------------------------------------------------------


def test_a_budget_that_holds_every_input_keeps_them_all_on_the_card() -> None:
    budget = _budget(budget=_made_up(LAYERS))
    plan = budget.plan(TOKENS, host_bytes=0)
    assert plan.inputs is not None and plan.inputs.levels == InputLevels(LAYERS, 0, None)
    assert not plan.offload and plan.shape.checkpoint_every is None and plan.offload_host_bytes == 0
    assert "layer inputs: all 8 on the card (the budget holds them)" in budget.describe(plan)


def test_a_tight_card_and_a_roomy_host_split_the_inputs() -> None:
    """A card for 5 inputs: 2 kept there and 3 in flight, 6 in host memory (input_levels' fewest offloaded)."""
    budget = _budget(budget=_made_up(5))
    plan = budget.plan(TOKENS, host_bytes=LAYERS * ONE)
    assert plan.inputs is not None and plan.inputs.levels == InputLevels(2, 6, None)
    assert (plan.inputs.card_holds, plan.inputs.host_holds) == (5, LAYERS)
    assert plan.offload and plan.shape.offloaded_layers == 6 and plan.shape.checkpoint_every is None
    assert plan.offload_host_bytes == 6 * ONE and plan.residency.predicted_reserved <= _made_up(5)
    line = budget.describe(plan)
    assert "layer inputs: 2 on the card, 6 in host memory" in line and "the budget holds 5 at a time" in line
    # Control: one byte less holds 4, so one input more goes to the host.
    assert _budget(budget=_made_up(5) - 1).plan(TOKENS, host_bytes=LAYERS * ONE).inputs.levels == (1, 7, None)


@pytest.mark.parametrize("host_inputs", [0, 2])
def test_a_tight_card_and_a_tight_host_keep_one_input_in_two(host_inputs: int) -> None:
    """A card for 6 and a host for at most 2: no split holds 8 inputs; k=2 keeps 4 on the card, 2 replayed at a time."""
    budget = _budget(budget=_made_up(6))
    plan = budget.plan(TOKENS, host_bytes=host_inputs * ONE)
    assert plan.inputs is not None and plan.inputs.levels == InputLevels(4, 0, 2)
    assert plan.shape.checkpoint_every == 2 and not plan.offload
    # The memory model counts the 4 kept and the 2 a segment replays: what the budget holds.
    assert plan.residency.minimum == _made_up(6)
    assert (
        "one in 2 kept (4 on the card), the others replayed in the backward: no split of all 8 fits"
        in budget.describe(plan)
    )


def test_what_fits_no_way_is_refused_with_the_longest_length_that_fits() -> None:
    """A card for 4 and a host for 2: nothing fits 256 tokens; the answer is the longest length that does.

    (A card for 5 would fit: k=4 with both checkpoints in host memory holds a segment's 4 and the next one coming
    back, 5 inputs.)
    """
    budget = _budget(budget=_made_up(4))
    with pytest.raises(ValueError) as failure:
        budget.plan(TOKENS, host_bytes=2 * ONE)
    message = str(failure.value)
    assert message.startswith(f"at {TOKENS} tokens per micro-batch the budget holds 4 layer inputs on the card")
    longest = int(message.split("for the layer inputs is ")[1].split(" tokens")[0])
    assert 0 < longest < TOKENS and "raise `vram_budget`, free host memory" in message
    # That length fits the same budget and host memory, one token more does not (tokens under 1024: any length).
    assert budget.plan(longest, host_bytes=2 * ONE).inputs is not None
    with pytest.raises(ValueError):
        budget.plan(longest + 1, host_bytes=2 * ONE)
    # Control: with host memory for every input the same budget splits them.
    assert budget.plan(TOKENS, host_bytes=LAYERS * ONE).inputs.levels == (1, 7, None)


def test_a_budget_under_the_step_without_its_inputs_is_refused_too() -> None:
    with pytest.raises(ValueError, match="3 on the card at a time, the fewest any choice keeps") as failure:
        _budget(budget=_made_up(3) - 1).plan(TOKENS, host_bytes=LAYERS * ONE)
    assert "The longest micro-batch that fits this budget" in str(failure.value)


def test_set_options_and_no_budget_decide_as_before() -> None:
    """An explicit option wins; without a budget, or with block-major windows, offload is all or nothing."""
    tight = _made_up(5)
    # The option unset but the choice off (`offload_activations` or `input_checkpoint_every` set): all offloaded.
    forced = _budget(budget=tight, choose_inputs=False).plan(TOKENS, host_bytes=LAYERS * ONE)
    assert forced.inputs is None and forced.offload and forced.shape.offloaded_layers is None
    assert _budget(budget=tight, choose_inputs=False, offload=True).plan(TOKENS).shape.offloaded_layers is None
    with pytest.raises(ValueError, match="tokens per micro-batch, the budget"):
        _budget(budget=tight, choose_inputs=False, offload=False).plan(TOKENS)
    # The user's k is the plan's, counted: k=4 keeps 2 and replays 4, which a card for 6 holds without offload.
    every4 = _budget(budget=_made_up(6), choose_inputs=False, checkpoint_every=4).plan(TOKENS)
    assert every4.inputs is None and not every4.offload and every4.shape.checkpoint_every == 4
    # No budget: the device limit decides, all or nothing; a window keeps every input on the card.
    unbudgeted = _budget(device_limit=tight).plan(TOKENS, host_bytes=0)
    assert unbudgeted.inputs is None and unbudgeted.offload and unbudgeted.shape.offloaded_layers is None
    window = _budget(budget=10 * tight, window=2).plan(TOKENS, host_bytes=0)
    assert window.inputs is None and not window.offload


def test_the_cards_budget_that_fits_no_choice_gives_way_to_streaming() -> None:
    """NOTE [ The card as the default budget ]: streamed unbudgeted, saying why and the longest length that fits.

    Host memory for 2 inputs cannot take all 8 the all-or-nothing offload would send there: one in 4 kept instead,
    and the warning says the host was the limit.
    """
    plan = _budget(budget=_made_up(4), card=True).plan(TOKENS, host_bytes=2 * ONE)
    assert plan.over_card is not None and "The longest micro-batch that fits" in plan.over_card
    assert "Host memory was the limit too: " in plan.over_card and "holds 2 of the 8" in plan.over_card
    # The fewest on the card: one in 4 kept, both checkpoints in host memory (a segment's 4 and the next coming back).
    assert plan.inputs is not None and plan.inputs.levels == InputLevels(0, 2, 4) and plan.offload
    assert plan.shape.checkpoint_every == 4 and plan.residency.resident == ()
    # Control: with host memory for every input, the card that holds too few gives way to offloading them all.
    roomy = _budget(budget=_made_up(3) - 1, card=True).plan(TOKENS, host_bytes=LAYERS * ONE)
    assert roomy.over_card is not None and "Host memory was the limit" not in roomy.over_card
    assert roomy.inputs is None and roomy.offload and roomy.shape.offloaded_layers is None


@pytest.mark.parametrize(
    ("offload", "every", "chooses"), [(None, None, True), (False, None, False), (None, 3, False), (2, None, False)]
)
def test_the_strategy_chooses_only_where_both_options_are_unset(offload: Any, every: Any, chooses: bool) -> None:
    module = CausalLMModule(lambda: build_model("llama"))
    split = offload if offload is None or isinstance(offload, bool) else True
    budget = module_budget.module_budget(
        module,
        module.model,
        [1024] * 4,
        torch.device("cpu"),
        prefetch_depth=2,
        budget=None,
        offload=split,
        offloaded_layers=offload if split is True else None,
        checkpoint_every=every,
    )
    assert budget.choose_inputs is chooses and budget.checkpoint_every == every


def test_the_memory_model_counts_input_checkpoints() -> None:
    """k=2 of 8 layers keeps 4 inputs and replays 2: the peak of 6 inputs on the card, as a split of 6 has."""
    shape = StepShape(tokens=TOKENS, hidden_size=64, intermediate_size=128, vocab_size=100, num_layers=LAYERS)
    every2 = replace(shape, checkpoint_every=2)
    split_of_six = replace(shape, offload_inputs=True, offloaded_layers=5)
    assert every2.activation_peak() == split_of_six.activation_peak() < shape.activation_peak()
    # Offloaded, only the checkpoints among the first 5 layers (0, 2, 4) wait in host memory.
    offloaded = replace(every2, offload_inputs=True, offloaded_layers=5)
    assert offloaded.host_inputs() == 3 and offloaded.offloaded_host_bytes() == 3 * ONE


@pytest.mark.parametrize("norms", [0, 17])
def test_the_budget_plans_for_liger_rmsnorm_where_it_runs(monkeypatch: pytest.MonkeyPatch, norms: int) -> None:
    """``fused_norm`` comes from the model's Liger RMSNorms, as ``fused_mlp`` from its MLPs; control: none installed."""
    model = build_model("llama")
    counts = {"rms_norm": norms, "rope": 0, "mlp": 0}
    monkeypatch.setattr(module_budget, "liger_kernels_in", lambda _: counts)
    base = model.get_base_model()
    budget = module_budget.module_budget(model, base, [1000] * LAYERS, torch.device("cpu"), 2, None, None)
    assert budget.kernels.fused_norm is (norms > 0) and not budget.kernels.fused_mlp
    assert budget.shape(TOKENS, offload=False).fused_norm is (norms > 0)


def test_host_room_is_what_the_arenas_check_sees_less_its_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_budget, "available_host_memory", lambda: step_budget.HOST_RAM_RESERVE + 10 * ONE)
    assert (host_room(), host_room(2)) == (10 * ONE, 5 * ONE)
    # The plan's share is that of the ranks on this machine.
    assert _budget(budget=_made_up(5), host_ranks=2).plan(TOKENS).inputs.host_holds == 5
    monkeypatch.setattr(step_budget, "available_host_memory", lambda: 1)
    assert host_room() == 0


def _planner(monkeypatch: pytest.MonkeyPatch, measured: int, own_slabs: int | None) -> StepPlanner:
    """A planner of the card for 4 inputs whose host share is ``measured``, with ``own_slabs`` allocated (or none)."""
    monkeypatch.setattr(step_planner, "host_room", lambda ranks=1: measured)
    planner = StepPlanner(_budget(budget=_made_up(4)), "`vram_budget`")
    offload = None if own_slabs is None else SimpleNamespace(host_bytes=own_slabs)
    planner._layers = SimpleNamespace(offload=offload)  # type: ignore[assignment]
    return planner


def test_a_replan_counts_this_ranks_own_slabs_as_host_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """The slabs allocated now are freed before the new plan's: with them, the host holds the split of 7."""
    planner = _planner(monkeypatch, measured=2 * ONE, own_slabs=5 * ONE)
    assert planner.host_room() == 7 * ONE
    assert planner._plan_for(TOKENS).inputs.levels == InputLevels(1, 7, None)
    # Control: the same measured room without slabs of its own holds 2 inputs, and nothing fits.
    with pytest.raises(MisconfigurationException, match="the host memory 2:"):
        _planner(monkeypatch, measured=2 * ONE, own_slabs=None)._plan_for(TOKENS)


def test_a_masked_batch_is_planned_for_once_before_its_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Masked attention ]: the first padded batch re-plans at the same tokens; the next ones do not."""
    monkeypatch.setattr(step_planner, "host_room", lambda ranks=1: LAYERS * ONE)
    # A card with room for the mask: the masked plan fits it too.
    planner = StepPlanner(_budget(budget=2 * _made_up(LAYERS)), "`vram_budget`")
    planner.first_plan(TOKENS)
    planner._layers = SimpleNamespace(  # type: ignore[assignment]
        offload=None, set_input_levels=lambda *a: None, offload_inputs=lambda b: None
    )
    assert planner.plan is not None
    before = planner.plan.residency.predicted_peak
    ids = torch.ones(2, TOKENS // 2, dtype=torch.long)
    # Control: an unmasked batch of the same tokens changes nothing.
    assert planner.see_batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)}) is None
    padded = torch.ones_like(ids)
    padded[1, -3:] = 0
    line = planner.see_batch({"input_ids": ids, "attention_mask": padded})
    assert line is not None and line.startswith(f"masked attention over rows of {TOKENS // 2} tokens")
    assert planner.budget.masked_row == TOKENS // 2 and planner.plan.residency.predicted_peak > before
    assert planner.plan.shape.masked_row == TOKENS // 2
    # The same rows again: planned for already.
    assert planner.see_batch({"input_ids": ids, "attention_mask": padded}) is None


def test_the_masks_are_read_on_the_host_before_the_copy(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Masked attention ]: the planner reads a batch's mask before its copy to the device (no device sync),
    and plans for it before the step. Control: without the strategy's note, it reads the copy the step gets."""
    read: list[Any] = []
    stepped: list[Any] = []
    masked_row = step_planner.masked_row

    def reading(batch: Any, config: Any) -> int | None:
        read.append(batch)
        return masked_row(batch, config)

    monkeypatch.setattr(step_planner, "masked_row", reading)

    class Recording(CausalLMModule):
        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            stepped.append(batch)
            return super().training_step(batch, batch_idx)

    strategy = BlockwiseStrategy(budget_tokens=RUN_TOKENS)
    fit(Recording(_nf4(checkpoint)), strategy, padded_batches(2), max_steps=2)
    assert strategy._planner is not None and strategy._planner.budget.masked_row == SEQ
    assert read and stepped and not any(batch is copy for batch in read for copy in stepped)
    read.clear(), stepped.clear()
    monkeypatch.setattr(BlockwiseStrategy, "batch_to_device", Strategy.batch_to_device)
    fit(Recording(_nf4(checkpoint)), BlockwiseStrategy(budget_tokens=RUN_TOKENS), padded_batches(2), max_steps=2)
    assert read and read[0] is stepped[0]


def test_a_noted_row_is_what_the_copy_is_planned_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row read on the host stands for its copy (here an all-ones stand-in, which alone re-plans nothing)."""
    monkeypatch.setattr(step_planner, "host_room", lambda ranks=1: LAYERS * ONE)
    ids = torch.ones(2, TOKENS // 2, dtype=torch.long)
    padded = torch.ones_like(ids)
    padded[1, -3:] = 0
    lines = []
    for note in (False, True):
        planner = StepPlanner(_budget(budget=2 * _made_up(LAYERS)), "`vram_budget`")
        planner.first_plan(TOKENS)
        planner._layers = SimpleNamespace(  # type: ignore[assignment]
            offload=None, set_input_levels=lambda *a: None, offload_inputs=lambda b: None
        )
        copy = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if note:
            planner.note_host_batch({"input_ids": ids, "attention_mask": padded}, copy)
        lines.append(planner.see_batch(copy))
    assert lines[0] is None and lines[1] is not None and lines[1].startswith("masked attention")


class _TwoRanks:
    """A stand-in for the process group of 2 ranks: the other rank's numbers, and the all-reduces made."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, others: list[int]) -> None:
        self.others = others
        self.ops: list[Any] = []
        self.calls: list[tuple[Any, torch.device]] = []
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(torch.distributed, "all_reduce", self._all_reduce)

    def _all_reduce(self, tensor: Tensor, op: Any, group: Any = None) -> None:
        self.ops.append(op)
        self.calls.append((group, tensor.device))
        # The other rank's values: one number for a one-element reduce, else a list (a number: the rest 0).
        other = self.others.pop(0)
        others = torch.as_tensor(other if isinstance(other, list) else [other] + [0] * (tensor.numel() - 1))
        least = op == torch.distributed.ReduceOp.MIN
        tensor.copy_(torch.minimum(tensor, others) if least else torch.maximum(tensor, others))


def test_every_rank_plans_from_the_least_host_room_and_the_longest_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 2 ranks: the host room is the least of both ranks' (so both split alike), a step's tokens the most."""
    planner = _planner(monkeypatch, measured=LAYERS * ONE, own_slabs=None)
    ranks = _TwoRanks(monkeypatch, others=[2 * ONE, 2 * ONE])
    assert planner.host_room() == 2 * ONE and ranks.ops == [torch.distributed.ReduceOp.MIN]
    # The other rank's host holds 2 inputs: both refuse, though this one alone would split (control: one rank).
    with pytest.raises(MisconfigurationException, match="the host memory 2:"):
        planner.first_plan(TOKENS)
    ranks.others = [LAYERS * ONE]
    planner.first_plan(TOKENS // 2)
    assert planner.plan is not None and planner.plan.tokens == TOKENS // 2
    # A short batch here, a long one on the other rank: both re-plan before this step, for the long one.
    stack = SimpleNamespace(offload=None, set_input_levels=lambda *a: None, offload_inputs=lambda b: None)
    planner._layers = stack  # type: ignore[assignment]
    ranks.others, ranks.ops = [TOKENS, LAYERS * ONE], []
    assert planner.see_batch({"input_ids": torch.zeros(1, TOKENS // 4, dtype=torch.long)}) is not None
    assert planner.plan.tokens == TOKENS and planner.plan.inputs.levels == InputLevels(1, 7, None)
    assert ranks.ops == [torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.MIN]
    # Control: every step agrees on its tokens, one all-reduce; no longer batch anywhere, no re-plan.
    ranks.others, ranks.ops = [TOKENS], []
    assert planner.see_batch({"input_ids": torch.zeros(1, 1, dtype=torch.long)}) is None
    assert ranks.ops == [torch.distributed.ReduceOp.MAX]


def test_the_host_share_is_that_of_the_ranks_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """`host_ranks` is Lightning's processes on this node (3 here, stood in), not the world size (6: two nodes)."""
    captured: dict[str, Any] = {}
    build = module_budget.module_budget

    def capture(*args: Any, **kwargs: Any) -> StepBudget:
        captured.update(kwargs)
        return build(*args, **kwargs)

    monkeypatch.setattr(strategy_run, "module_budget", capture)
    monkeypatch.setattr(BlockwiseStrategy, "num_processes", property(lambda self: 3))
    monkeypatch.setattr(BlockwiseStrategy, "world_size", property(lambda self: 6))
    monkeypatch.setattr(BlockwiseStrategy, "is_distributed", property(lambda self: False))
    strategy = BlockwiseStrategy(budget_tokens=SHORT)
    fit(CausalLMModule(lambda: build_model("llama")), strategy, max_steps=1)
    assert (captured["host_ranks"], captured["ranks"]) == (3, 6)
    assert strategy._planner is not None and strategy._planner.budget.host_ranks == 3


# --- runs: the tests' 8-layer NF4 Llama, two rows of SEQ tokens per micro-batch -----------------------------------

RUN_TOKENS = 2 * SEQ
#: One layer input of the runs' model at ``RUN_TOKENS``.
RUN_ONE = RUN_TOKENS * CONFIGS["llama"]().hidden_size * 2


@pytest.fixture(scope="module")
def checkpoint(tiny_llama8_checkpoint: Path) -> Path:
    return tiny_llama8_checkpoint


def _nf4(checkpoint: Path) -> Any:
    return lambda: build_model("llama", checkpoint=checkpoint, quantized=True)


@pytest.fixture(scope="module")
def probe(checkpoint: Path) -> StepBudget:
    """The run's step budget (no budget on the CPU): what the budgets below are computed from."""
    strategy = BlockwiseStrategy(budget_tokens=RUN_TOKENS)
    fit(CausalLMModule(_nf4(checkpoint)), strategy, max_steps=1)
    assert strategy._planner is not None and strategy._planner.budget.choose_inputs
    return strategy._planner.budget


@pytest.fixture(scope="module")
def resident(checkpoint: Path) -> Any:
    return fit(CausalLMModule(_nf4(checkpoint)), "auto", max_steps=2)


@pytest.fixture
def no_host_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host memory free for layer inputs stood in: none, so that only the card and k remain."""
    monkeypatch.setattr(step_planner, "host_room", lambda ranks=1: 0)


def _every2(micro_batches: int) -> list[int]:
    return [micro_batches * (2 if layer % 2 else 3) for layer in range(LAYERS)]


@pytest.mark.usefixtures("no_host_memory")
def test_a_budget_the_inputs_do_not_fit_trains_one_in_two_exactly(checkpoint: Path, probe: StepBudget, resident: Any):
    """A budget for 6 of the 8 inputs and no host memory: the strategy keeps one in 2 by itself, == resident."""
    strategy = BlockwiseStrategy(vram_budget=_holding(probe, 6, RUN_TOKENS), budget_tokens=RUN_TOKENS)
    counts = ForwardCounts()
    run = fit(CausalLMModule(_nf4(checkpoint)), strategy, callbacks=[counts], max_steps=2)
    plan = strategy.step_plan
    assert plan is not None and plan.inputs is not None and plan.inputs.levels == InputLevels(4, 0, 2)
    assert plan.shape.checkpoint_every == 2 and not plan.offload and plan.residency.kept == ()
    assert_equal_runs(resident, run)
    # The segments were replayed: each layer but a segment's top ran three times per micro-batch.
    assert counts.counts == _every2(len(run.losses))


@pytest.mark.usefixtures("no_host_memory")
def test_control_the_chosen_replay_under_another_rng_state_differs(
    checkpoint: Path, probe: StepBudget, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def replay_without_rng(self: Segment, below: int, position: int) -> None:
        hidden = self._inputs[below]
        for index in range(below, position):
            layer, call, _ = self.members[index]
            layer.residency.acquire(layer.index, Pass.REPLAY)
            with torch.random.fork_rng(devices=[]), torch.no_grad(), call.autocast_context():
                hidden = layer.rerun(hidden, call)
            layer.residency.release(layer.index, Pass.REPLAY)
            self._inputs[index + 1] = hidden

    monkeypatch.setattr(Segment, "_replay", replay_without_rng)
    strategy = BlockwiseStrategy(vram_budget=_holding(probe, 6, RUN_TOKENS), budget_tokens=RUN_TOKENS)
    assert runs_differ(resident, fit(CausalLMModule(_nf4(checkpoint)), strategy, max_steps=2))


SHORT = 2 * 6


def _growing_batches() -> list[dict[str, Tensor]]:
    return unmasked(padded_batches(2, seq=6) + padded_batches(2, seq=SEQ) + padded_batches(2, seq=6, seed=99))


@pytest.mark.usefixtures("no_host_memory")
def test_a_longer_batch_moves_the_inputs_between_steps_exactly(
    checkpoint: Path, probe: StepBudget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned for the short batches, every input on the card; the long one re-plans to one in 2, still exact.

    The re-plan changes k and the resident blocks at once: one new streamer, the resident blocks copied once.
    """
    probe = replace(probe, masked_row=None)  # the batches are unmasked
    budget = _holding(probe, 6, RUN_TOKENS)
    short = replace(probe, budget=budget).plan(SHORT, host_bytes=0)
    assert short.inputs is not None and short.inputs.levels == InputLevels(LAYERS, 0, None)
    assert short.residency.resident != ()
    streamers: list[tuple[int, ...]] = []
    new_streamer = StreamedStack._new_streamer

    def counted(self: StreamedStack, resident: Any) -> Any:
        streamers.append(tuple(sorted(resident)))
        return new_streamer(self, resident)

    monkeypatch.setattr(StreamedStack, "_new_streamer", counted)
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=SHORT)
    counts = ForwardCounts()
    run = fit(CausalLMModule(_nf4(checkpoint)), strategy, _growing_batches(), callbacks=[counts], max_steps=3)
    plan = strategy.step_plan
    assert plan is not None and plan.tokens == RUN_TOKENS and plan.inputs is not None
    assert plan.inputs.levels == InputLevels(4, 0, 2)
    # Setup's streamer, then one for the re-plan (resident blocks and k together); control: they did change.
    assert streamers == [short.residency.resident, plan.residency.resident] != [short.residency.resident] * 2
    assert_equal_runs(fit(CausalLMModule(_nf4(checkpoint)), "auto", _growing_batches(), max_steps=3), run)
    # Two short micro-batches recomputed each layer once; from the long one on (the plan only grows), one in 2.
    assert counts.counts == [2 * 2 + runs for runs in _every2(4)]


def test_a_budget_that_fits_no_way_is_refused_at_setup_with_the_longest_length(
    checkpoint: Path, probe: StepBudget, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_planner, "host_room", lambda ranks=1: 2 * RUN_ONE)
    budget = _holding(probe, 5, RUN_TOKENS)
    module = CausalLMModule(_nf4(checkpoint))
    with pytest.raises(MisconfigurationException) as failure:
        fit(module, BlockwiseStrategy(vram_budget=budget, budget_tokens=RUN_TOKENS), max_steps=1)
    message = str(failure.value)
    assert message.startswith(f"`BlockwiseStrategy(vram_budget={budget})`: at {RUN_TOKENS} tokens per micro-batch")
    planned = replace(probe, budget=budget)
    longest = max(n for n in range(1, RUN_TOKENS) if _fits(planned, n, 2 * RUN_ONE))
    assert f"for the layer inputs is {longest} tokens" in message and module.losses == []
    # Control: with host memory for every input the same budget plans (a split).
    assert _fits(planned, RUN_TOKENS, LAYERS * RUN_ONE)


def _fits(budget: StepBudget, tokens: int, host_bytes: int) -> bool:
    try:
        budget.plan(tokens, host_bytes=host_bytes)
    except ValueError:
        return False
    return True


@pytest.mark.usefixtures("no_host_memory")
def test_an_explicit_option_wins(checkpoint: Path, probe: StepBudget) -> None:
    budget = _holding(probe, 6, RUN_TOKENS)
    every4 = BlockwiseStrategy(vram_budget=budget, budget_tokens=RUN_TOKENS, input_checkpoint_every=4)
    fit(CausalLMModule(_nf4(checkpoint)), every4, max_steps=1)
    assert every4.step_plan is not None and every4.step_plan.inputs is None
    assert every4.step_plan.shape.checkpoint_every == 4
    # Every input on the card, as asked: refused where the choice would have kept one in 2.
    kept = BlockwiseStrategy(vram_budget=budget, budget_tokens=RUN_TOKENS, offload_activations=False)
    with pytest.raises(MisconfigurationException, match=f"at {RUN_TOKENS} tokens per micro-batch, the budget"):
        fit(CausalLMModule(_nf4(checkpoint)), kept, max_steps=1)


@pytest.mark.parametrize("perturbed", [False, True])
def test_a_replan_moves_the_inputs_from_one_host_split_to_another_exactly(
    checkpoint: Path, probe: StepBudget, monkeypatch: pytest.MonkeyPatch, perturbed: bool
) -> None:
    """A card for 3 inputs at 24 tokens: 4 in host memory at 20 tokens, all 8 at 24, the slabs made again == resident.

    Control: the offloaded inputs brought back changed by a little differ from resident training.
    """
    monkeypatch.setattr(step_planner, "host_room", lambda ranks=1: 4 * LAYERS * RUN_ONE)
    if perturbed:
        load = ActivationOffload.load
        monkeypatch.setattr(ActivationOffload, "load", lambda self, saved: load(self, saved) * 1.001)
    seen: list[tuple[int, int]] = []

    class Slabs(Callback):
        def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, index: int) -> None:
            layers = strategy._run.layers
            assert layers is not None and layers.offload is not None
            seen.append((layers.offloaded_layers, layers.offload.host_bytes))

    def batches() -> list[dict[str, Tensor]]:
        return unmasked(padded_batches(2, seq=10) + padded_batches(2, seq=SEQ))

    causal = replace(probe, masked_row=None)  # the batches are unmasked
    strategy = BlockwiseStrategy(vram_budget=_holding(causal, 3, RUN_TOKENS), budget_tokens=20)
    run = fit(CausalLMModule(_nf4(checkpoint)), strategy, batches(), callbacks=[Slabs()], max_steps=2)
    resident = fit(CausalLMModule(_nf4(checkpoint)), "auto", batches(), max_steps=2)
    if perturbed:
        assert runs_differ(resident, run)
        return
    plan = strategy.step_plan
    assert plan is not None and plan.tokens == RUN_TOKENS and plan.inputs is not None
    assert plan.inputs.levels == InputLevels(0, LAYERS, None) and plan.shape.checkpoint_every is None
    # Before each micro-batch, as the one before left them (the strategy re-plans in its `training_step`): 4 layers'
    # inputs in host slabs until the first of 24 tokens moved all 8 there, in larger slabs.
    assert [layers for layers, _ in seen] == [4, 4, 4, LAYERS] and 0 < seen[0][1] == seen[2][1] < seen[3][1]
    assert_equal_runs(resident, run)


def test_ranks_agree_through_the_host_group_on_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under NCCL the agreement before every step goes through the gloo group: no CUDA tensor read back."""
    planner = _planner(monkeypatch, measured=LAYERS * ONE, own_slabs=None)
    gloo = object()
    planner.group = gloo
    ranks = _TwoRanks(monkeypatch, others=[LAYERS * ONE])
    planner.host_room()
    assert ranks.calls == [(gloo, torch.device("cpu"))]
    # Control: without the group the value goes through the default (NCCL) group, on the planner's device.
    seen: list[torch.device] = []
    tensor = torch.tensor

    def recording(*args: Any, **kwargs: Any) -> Tensor:
        seen.append(torch.device(kwargs.pop("device")))
        return tensor(*args, **kwargs)

    monkeypatch.setattr(step_planner.torch, "tensor", recording)
    planner.group, planner.device = None, torch.device("cuda", 3)
    ranks.others, ranks.calls = [LAYERS * ONE], []
    planner.host_room()
    assert [group for group, _ in ranks.calls] == [None] and seen == [torch.device("cuda", 3)]
