"""Kept attention on the GPU (NOTE [ Kept attention ]): exact in deterministic mode, each attention kernel run once.

The 1.5B Qwen2 shape of the parity tests (NF4, LoRA r16 on the seven projections, bf16-mixed, 512-token rows), with a
budget found from the planner under which every block streams and every layer is recomputed keeping its attention
outputs. Run with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (``tools/gpu-suite 4``).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import step_budget as planner
from tests.helpers.attention import CountAttention, record_one_bit_off
from tests.helpers.budgets import budget_where, keeps_every_attention
from tests.helpers.models import (
    DEFAULT_TARGETS,
    GPU_SHAPES,
    assert_equal_runs,
    fit_on_gpu,
    nf4_lora_builder,
    runs_differ,
)

pytestmark = pytest.mark.gpu

SEQ = 512
STEPS = 4
ACCUMULATE = 2


@pytest.fixture(scope="module")
def checkpoint(qwen2_checkpoint: Path) -> Path:
    return qwen2_checkpoint


def _fit(path: Path, strategy: Any) -> tuple[Any, Counter[str]]:
    with CountAttention() as mode:
        run = fit_on_gpu(nf4_lora_builder(path, DEFAULT_TARGETS, r=16), strategy, STEPS, ACCUMULATE, SEQ)
    return run, mode.calls


def test_kept_attention_is_exact_on_the_gpu(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    # 512-token rows: far under the floor that keeps attention outputs on a real step (KEPT_ATTENTION_MIN_FLOPS).
    monkeypatch.setattr(planner, "KEPT_ATTENTION_MIN_FLOPS", 0)
    probe = BlockwiseStrategy(vram_budget=None)
    fit_on_gpu(nf4_lora_builder(checkpoint, DEFAULT_TARGETS, r=16), probe, 1, 1, SEQ)
    assert probe._planner is not None
    layers = GPU_SHAPES["qwen2"]().num_hidden_layers
    budget, _ = budget_where(probe._planner.budget, SEQ, keeps_every_attention(layers), step=2**20)

    resident, resident_calls = _fit(checkpoint, "auto")
    strategy = BlockwiseStrategy(vram_budget=budget)
    blockwise, blockwise_calls = _fit(checkpoint, strategy)
    assert strategy.step_plan is not None and len(strategy.step_plan.residency.attention) == layers
    assert_equal_runs(resident, blockwise)
    micro_batches = len(blockwise.losses)
    # One kernel per layer and micro-batch, as in resident training: the recompute ran none.
    assert sum(resident_calls.values()) == sum(blockwise_calls.values()) == layers * micro_batches, blockwise_calls
    print(f"[gpu kept attention] budget {budget} B, {micro_batches} micro-batches: torch.equal on all;"
          f" kernels {dict(blockwise_calls)}")  # fmt: skip

    # Control: a recorded output with its first element one ulp up makes the gradients differ.
    record_one_bit_off(monkeypatch)
    broken, _ = _fit(checkpoint, BlockwiseStrategy(vram_budget=budget))
    assert torch.equal(broken.losses[0], resident.losses[0]), "the forward itself must be unaffected"
    assert runs_differ(resident, broken)
