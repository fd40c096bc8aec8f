"""Kept activations (NOTE [ Kept activations ]): blocks whose graphs fit the budget are not recomputed, and exact.

A budget is chosen from the planner so that the eight blocks of the test model split three ways: kept
(resident, plain autograd), resident only (rematerialized) and streamed (eight: with fewer, once one
block is resident the slots it frees pay for the rest). The run with dropout is
`torch.equal` to resident training; the kept layers run their forward once per micro-batch, the others
twice (the recompute); a control that writes into a kept block's device copy makes the run differ.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning.step_plan import StepPlan
from tests.helpers.callbacks import ForwardCounts
from tests.helpers.models import (
    SEQ,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    padded_batches,
    runs_differ,
)

NUM_LAYERS = 8

#: Tokens of the test batches (2 rows of SEQ): planned for from the start, so that no longer batch re-plans.
TOKENS = 2 * SEQ


@pytest.fixture(scope="module")
def checkpoint(tiny_llama8_checkpoint: Path) -> Path:
    return tiny_llama8_checkpoint


def _nf4(checkpoint: Path) -> Any:
    return lambda: build_model("llama", checkpoint=checkpoint, quantized=True)


@pytest.fixture(scope="module")
def mixed_budget(checkpoint: Path) -> tuple[int, StepPlan]:
    """A budget under which 2 blocks are kept, 2 more resident and 4 stream, and the plan it gives."""
    probe = BlockwiseStrategy(budget_tokens=TOKENS)
    fit(CausalLMModule(_nf4(checkpoint)), probe, max_steps=1)
    assert probe.step_plan is not None and probe._planner is not None
    budget = probe._planner.budget
    minimum = probe.step_plan.residency.minimum
    for candidate in range(minimum, 2 * minimum, 2**10):
        plan = dataclasses.replace(budget, budget=candidate, keep_activations=True).plan(TOKENS)
        if (len(plan.residency.kept), len(plan.residency.resident)) == (2, 4):
            return candidate, plan
    raise AssertionError("no budget splits the blocks into kept, resident and streamed")


def test_kept_blocks_are_exact_and_run_once(checkpoint: Path, mixed_budget: tuple[int, StepPlan]) -> None:
    budget, plan = mixed_budget
    assert plan.residency.kept == (0, 1) and plan.residency.resident == (0, 1, 2, 3)
    resident = fit(CausalLMModule(_nf4(checkpoint)), "auto", max_steps=2)
    counts = ForwardCounts()
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS)
    blockwise = fit(CausalLMModule(_nf4(checkpoint)), strategy, callbacks=[counts], max_steps=2)
    assert strategy.step_plan is not None and strategy.step_plan.residency.kept == (0, 1)
    assert_equal_runs(resident, blockwise)
    micro_batches = len(blockwise.losses)
    # Layers 0 and 1 are kept: one forward per micro-batch. The others are recomputed in the backward.
    assert counts.counts == [micro_batches] * 2 + [2 * micro_batches] * (NUM_LAYERS - 2)


def test_keep_activations_off_recomputes_every_layer(checkpoint: Path, mixed_budget: tuple[int, StepPlan]) -> None:
    budget, _ = mixed_budget
    counts = ForwardCounts()
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, keep_activations=False)
    run = fit(CausalLMModule(_nf4(checkpoint)), strategy, callbacks=[counts], max_steps=1)
    assert strategy.step_plan is not None and strategy.step_plan.residency.kept == ()
    # The budget buys resident blocks only, more of them than with kept graphs.
    assert len(strategy.step_plan.residency.resident) > 4
    assert counts.counts == [2 * len(run.losses)] * NUM_LAYERS


class _WriteIntoKeptBlock(Callback):
    """Control: after setup, change one weight of the kept block's device copy (what its layer computes from)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        weight = pl_module.model.get_decoder().layers[0].mlp.down_proj.base_layer.weight
        with torch.no_grad():
            weight.data.view(torch.uint8)[0] ^= 1


def test_control_kept_layers_read_their_device_copy(checkpoint: Path, mixed_budget: tuple[int, StepPlan]) -> None:
    budget, _ = mixed_budget
    resident = fit(CausalLMModule(_nf4(checkpoint)), "auto", max_steps=2)
    blockwise = fit(
        CausalLMModule(_nf4(checkpoint)),
        BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS),
        callbacks=[_WriteIntoKeptBlock()],
        max_steps=2,
    )
    assert runs_differ(resident, blockwise)


def test_keep_activations_must_be_a_bool() -> None:
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=r"keep_activations='yes'\)` must be True or False"):
        BlockwiseStrategy(keep_activations="yes")


class _KeptPerStep(Callback):
    def __init__(self) -> None:
        self.kept: list[tuple[int, ...]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        plan = trainer.strategy.step_plan
        self.kept.append(None if plan is None else plan.residency.kept)


def test_a_longer_batch_keeps_fewer_blocks_and_stays_exact(checkpoint: Path) -> None:
    """Planned for short batches, the run meets longer ones: fewer blocks keep their graphs, and the run is exact."""
    short, long = 2 * 6, 2 * SEQ
    probe = BlockwiseStrategy(budget_tokens=short)
    fit(CausalLMModule(_nf4(checkpoint)), probe, max_steps=1)
    assert probe._planner is not None and probe.step_plan is not None
    budget = None
    for candidate in range(probe.step_plan.residency.minimum, 3 * probe.step_plan.residency.minimum, 2**10):
        planner = dataclasses.replace(probe._planner.budget, budget=candidate, keep_activations=True)
        try:
            at_short, at_long = planner.plan(short).residency.kept, planner.plan(long).residency.kept
        except ValueError:
            continue
        if 0 < len(at_long) < len(at_short):
            budget = candidate
            break
    assert budget is not None, "no budget keeps fewer blocks for the longer batches"
    batches = padded_batches(4, batch_size=2, seq=6) + padded_batches(4, batch_size=2, seq=SEQ, seed=7)
    resident = fit(CausalLMModule(_nf4(checkpoint)), "auto", batches, max_steps=4)
    kept = _KeptPerStep()
    blockwise = fit(
        CausalLMModule(_nf4(checkpoint)),
        # The plan changes for the longer batches only.
        BlockwiseStrategy(vram_budget=budget, budget_tokens=short),
        batches,
        callbacks=[kept],
        max_steps=4,
    )
    assert_equal_runs(resident, blockwise)
    # The plan was made again in the first long micro-batch's training step (the fifth), before its forward:
    # fewer kept blocks from then on (the callback sees each micro-batch's plan before its step).
    assert len(kept.kept[5]) < len(kept.kept[0]) and kept.kept[:5] == [kept.kept[0]] * 5


def test_parity_check_rematerializes_the_kept_blocks(
    checkpoint: Path, mixed_budget: tuple[int, StepPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ParityCheck's blockwise arm recomputes every layer, kept ones too; a broken replay is caught with kept blocks.

    Control: without `all_rematerialized`, the kept layers would run as the reference does (nothing checked).
    """
    import contextlib

    from lightning_blockwise import ParityCheck
    from lightning_blockwise.replay import remat
    from lightning_blockwise.replay.rng import RngSnapshot
    from lightning_blockwise.strategy.streamed_stack import StreamedStack
    from lightning_blockwise.verification import check as verification_check
    from lightning_blockwise.verification.result import ParityError

    budget, _ = mixed_budget
    arms: list[list[bool]] = []
    original = verification_check._step

    def spy(strategy: BlockwiseStrategy, *args: Any) -> Any:
        arms.append([remat.installed(layer) is not None for layer in strategy.layers])
        return original(strategy, *args)

    monkeypatch.setattr(verification_check, "_step", spy)
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS)
    fit(CausalLMModule(_nf4(checkpoint)), strategy, callbacks=[ParityCheck()], max_steps=1)
    assert strategy.step_plan is not None and strategy.step_plan.residency.kept == (0, 1)
    assert arms[0] == [True] * NUM_LAYERS  # the blockwise arm: every layer rematerialized
    # The recompute draws other dropout masks than the forward: caught, kept blocks and all.
    with monkeypatch.context() as broken:
        broken.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
        with pytest.raises(ParityError):
            fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS),
                callbacks=[ParityCheck()], max_steps=1)  # fmt: skip
    # Control: the blockwise arm run as the stack stands leaves the kept layers unrecomputed.
    arms.clear()
    monkeypatch.setattr(StreamedStack, "all_rematerialized", lambda self: contextlib.nullcontext())
    fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS),
        callbacks=[ParityCheck()], max_steps=1)  # fmt: skip
    assert arms[0][:2] == [False, False]


def test_kept_layers_are_not_recomputed_by_hugging_face_checkpointing_either(
    checkpoint: Path, mixed_budget: tuple[int, StepPlan]
) -> None:
    """Under `gradient_checkpointing_enable()` (`prepare_model_for_kbit_training` calls it) kept layers run once."""

    def build() -> Any:
        model = build_model("llama", checkpoint=checkpoint, quantized=True)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        return model

    budget, _ = mixed_budget
    resident_counts = ForwardCounts()
    resident = fit(CausalLMModule(build), "auto", callbacks=[resident_counts], max_steps=2)
    micro_batches = len(resident.losses)
    # Under Hugging Face's checkpointing every layer runs twice per micro-batch (the arm that shows the count moves).
    assert resident_counts.counts == [2 * micro_batches] * NUM_LAYERS
    counts = ForwardCounts()
    module = CausalLMModule(build)
    blockwise = fit(
        module, BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS), callbacks=[counts], max_steps=2
    )
    assert_equal_runs(resident, blockwise)
    assert counts.counts == [micro_batches] * 2 + [2 * micro_batches] * (NUM_LAYERS - 2)
    # The user's setting is back after the run.
    assert all(vars(layer).get("gradient_checkpointing") for layer in module.model.get_decoder().layers)
