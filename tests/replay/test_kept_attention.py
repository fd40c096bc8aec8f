"""Kept attention (NOTE [ Kept attention ]): recomputed layers take their attention outputs from the forward.

The budget is found from the planner so that every layer is recomputed and keeps its attention outputs (no kept
graph). The run is `torch.equal` to resident training, padded batches and adapter dropout included, and each
layer's attention kernel runs once per micro-batch, as in resident training, where the recompute ran it twice.
Controls: outputs served with one bit changed make the run differ, so the served tensors are what the backward
reads; a recompute whose calls do not match the record computes them, exact either way.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import step_budget as planner
from lightning_blockwise.planning.step_budget import StepBudget
from lightning_blockwise.planning.step_plan import StepPlan
from lightning_blockwise.replay import kept_attention, remat
from lightning_blockwise.replay.kept_attention import KeptAttention
from tests.helpers.attention import CountAttention, record_one_bit_off
from tests.helpers.budgets import budget_where, keeps_every_attention, probed_budget
from tests.helpers.models import SEQ, CausalLMModule, assert_equal_runs, build_model, fit, runs_differ

NUM_LAYERS = 4
TOKENS = 2 * SEQ


@pytest.fixture(scope="module", autouse=True)
def no_flops_floor() -> Iterator[None]:
    """Tiny layers: their attention is far under the floor that keeps it on a real card (controlled below)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "KEPT_ATTENTION_MIN_FLOPS", 0)
        yield


@pytest.fixture(scope="module")
def checkpoint(llama_no_attention_dropout: Path) -> Path:
    """The tests' tiny Llama without attention dropout (a call with dropout is never kept)."""
    return llama_no_attention_dropout


def _nf4(checkpoint: Path) -> Any:
    return lambda: build_model("llama", checkpoint=checkpoint, quantized=True)


@pytest.fixture(scope="module")
def probed(checkpoint: Path) -> StepBudget:
    """The step budget the strategy sets up for the test model at :data:`TOKENS` (one probe for the module)."""
    return probed_budget(_nf4(checkpoint), TOKENS)


@pytest.fixture(scope="module")
def attention_budget(probed: StepBudget) -> tuple[int, StepPlan]:
    """A budget under which every block streams and is recomputed, keeping its attention outputs."""
    return budget_where(probed, TOKENS, keeps_every_attention(NUM_LAYERS))


def _attention_calls(strategy: Any, checkpoint: Path) -> tuple[Any, int]:
    with CountAttention() as mode:
        run = fit(CausalLMModule(_nf4(checkpoint)), strategy, max_steps=2)
    return run, mode.total


def test_kept_attention_is_exact_and_runs_each_kernel_once(
    checkpoint: Path, attention_budget: tuple[int, StepPlan]
) -> None:
    budget, plan = attention_budget
    assert plan.residency.kept == () and plan.residency.attention == tuple(range(NUM_LAYERS))
    resident, resident_calls = _attention_calls("auto", checkpoint)
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS)
    blockwise, blockwise_calls = _attention_calls(strategy, checkpoint)
    assert strategy.step_plan is not None and strategy.step_plan.residency.attention == tuple(range(NUM_LAYERS))
    assert_equal_runs(resident, blockwise)
    micro_batches = len(blockwise.losses)
    # One kernel per layer and micro-batch in the forward; the recompute runs none (resident training: the same).
    assert resident_calls == blockwise_calls == NUM_LAYERS * micro_batches
    assert all(remat.installed(layer) is None for layer in strategy.layers)  # uninstalled after the run
    # Control: the same budget without kept attention recomputes every kernel.
    without = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS, keep_activations=False)
    recomputed, recomputed_calls = _attention_calls(without, checkpoint)
    assert_equal_runs(resident, recomputed)
    assert recomputed_calls == 2 * NUM_LAYERS * micro_batches


def test_control_served_outputs_are_what_the_backward_reads(
    checkpoint: Path, attention_budget: tuple[int, StepPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bit changed in every recorded attention output: the forward is unchanged, the gradients differ."""
    budget, _ = attention_budget
    resident = fit(CausalLMModule(_nf4(checkpoint)), "auto", max_steps=2)
    record_one_bit_off(monkeypatch)
    broken = fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS),
                 max_steps=2)  # fmt: skip
    assert torch.equal(broken.losses[0], resident.losses[0]), "the forward itself must be unaffected"
    assert runs_differ(resident, broken)


def _sdpa_inputs(requires_grad: bool) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    return tuple(torch.randn(1, 2, 8, 4, requires_grad=requires_grad) for _ in range(3))


def test_a_call_that_does_not_match_the_record_is_computed() -> None:
    """Another shape, a written output or dropout: computed again (``misses``), the gradients those of no record."""
    q, k, v = _sdpa_inputs(True)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    (grad_reference,) = torch.autograd.grad(reference.sum(), q)
    cases = {
        "another length": lambda: F.scaled_dot_product_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True),
        "written since": None,
        "dropout": lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True),
    }
    for case, call in cases.items():
        kept = KeptAttention()
        with torch.no_grad(), kept.record():
            out = (call or (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))()
        if case == "written since":
            kept.entries[0].outputs[0].add_(1.0)  # type: ignore[union-attr]
        if case == "dropout":
            # Not recorded (on the CPU, SDPA with dropout is not even a fused kernel but its math decomposition).
            assert not any(kept.entries)
        with kept.serve():
            served = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        (grad,) = torch.autograd.grad(served.sum(), q)
        assert kept.misses == 1, case
        assert torch.equal(served, reference) and torch.equal(grad, grad_reference), case
        assert not any(kept.entries), "an entry is dropped once its call came"
        del out


def test_a_matching_call_is_answered_with_the_recorded_bits() -> None:
    q, k, v = _sdpa_inputs(True)
    kept = KeptAttention()
    with torch.no_grad(), kept.record():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert kept.nbytes > q.nbytes  # the output and its log-sum-exp
    recorded = kept.entries[0].outputs[0]  # type: ignore[union-attr]
    with kept.serve():
        served = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert kept.misses == 0 and kept.entries == [None]
    assert served.untyped_storage().data_ptr() == recorded.untyped_storage().data_ptr()
    (grad,) = torch.autograd.grad(served.sum(), q)
    (grad_reference,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True).sum(), q)
    assert torch.equal(grad, grad_reference)


def test_the_planner_keeps_attention_before_graphs(probed: StepBudget, attention_budget: tuple[int, StepPlan]) -> None:
    budget, plan = attention_budget
    step_budget = dataclasses.replace(probed, budget=budget, keep_activations=True)
    assert "4 recomputed layers keep their attention outputs" in step_budget.describe(plan)
    # A larger budget keeps whole graphs from the first block on; those blocks give their attention outputs back.
    larger = None
    for candidate in range(budget, 4 * budget, 2**10):
        candidate_plan = dataclasses.replace(step_budget, budget=candidate).plan(TOKENS)
        if candidate_plan.residency.kept:
            larger = candidate_plan
            break
    assert larger is not None
    assert not set(larger.residency.kept) & set(larger.residency.attention)
    assert set(larger.residency.kept) | set(larger.residency.attention) == set(range(NUM_LAYERS))
    # Not with input checkpoints, nor without keep_activations, nor with attention dropout, nor under the FLOPs floor.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "KEPT_ATTENTION_MIN_FLOPS", plan.shape.attention_flops() + 1)
        assert not step_budget.plan(TOKENS).residency.attention
    every = dataclasses.replace(step_budget, checkpoint_every=2, choose_inputs=False)
    assert not every.plan(TOKENS).residency.attention
    assert not dataclasses.replace(step_budget, keep_activations=False).plan(TOKENS).residency.attention
    config = step_budget.config.__class__.from_dict({**step_budget.config.to_dict(), "attention_dropout": 0.1})
    assert not dataclasses.replace(step_budget, config=config).plan(TOKENS).residency.attention


def test_inputs_wait_in_host_memory_where_that_keeps_more_attention(checkpoint: Path, probed: StepBudget) -> None:
    """Where the card cannot hold every layer's attention outputs beside the inputs, the inputs move out; exact."""
    step_budget = dataclasses.replace(probed, budget=None, choose_inputs=True)

    def moved(plan: StepPlan) -> bool:
        return plan.inputs is not None and plan.inputs.for_kept

    budget, plan = budget_where(step_budget, TOKENS, moved, step=2**6)
    assert plan.inputs is not None and plan.inputs.levels.host_count == NUM_LAYERS and plan.offload
    assert "so that the card keeps attention outputs" in step_budget.describe(plan)
    # Controls: with no host memory for them the inputs stay on the card, and fewer layers keep attention outputs;
    # without kept attention they stay on the card too.
    on_card = dataclasses.replace(step_budget, budget=budget).plan(TOKENS, host_bytes=0)
    assert on_card.inputs is not None and on_card.inputs.levels.host_count == 0 and not on_card.offload
    assert len(plan.residency.attention) > len(on_card.residency.attention) and not plan.residency.kept
    without = dataclasses.replace(step_budget, budget=budget, keep_attention=False).plan(TOKENS)
    assert without.inputs is not None and not without.inputs.for_kept
    resident = fit(CausalLMModule(_nf4(checkpoint)), "auto", max_steps=2)
    strategy = BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS)
    blockwise = fit(CausalLMModule(_nf4(checkpoint)), strategy, max_steps=2)
    assert strategy.step_plan is not None and strategy.step_plan.inputs is not None
    assert strategy.step_plan.inputs.for_kept and strategy.step_plan.offload
    assert_equal_runs(resident, blockwise)


def test_a_layer_without_a_fused_attention_kernel_says_its_plan_goes_unused(
    checkpoint: Path, attention_budget: tuple[int, StepPlan], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager attention runs no SDPA kernel: nothing is recorded, the run is exact, and one warning says so."""

    def eager() -> Any:
        model = build_model("llama", checkpoint=checkpoint, quantized=True)
        model.get_base_model().set_attn_implementation("eager")
        return model

    budget, _ = attention_budget
    monkeypatch.setattr(kept_attention, "_WARNED", set())
    resident = fit(CausalLMModule(eager), "auto", max_steps=2)
    with pytest.warns(UserWarning, match="ran no fused attention kernel") as caught:
        blockwise = fit(CausalLMModule(eager), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS), max_steps=2)
    assert_equal_runs(resident, blockwise)
    assert sum("ran no fused attention kernel" in str(w.message) for w in caught) == 1
    # Control: the same run with SDPA records every layer's attention and says nothing.
    monkeypatch.setattr(kept_attention, "_WARNED", set())
    with warnings.catch_warnings(record=True) as quiet:
        warnings.simplefilter("always")
        fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(vram_budget=budget, budget_tokens=TOKENS), max_steps=2)
    assert not [w for w in quiet if "attention kernel" in str(w.message) or "record did not answer" in str(w.message)]
