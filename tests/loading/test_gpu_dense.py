"""GPU parity of a dense (bf16, unquantized) base: `load_blockwise(quantize=False)` streamed == resident bf16.

A Qwen2.5-1.5B-shaped bf16 checkpoint (random init), LoRA r=16 on the seven projections, seq 512,
bf16-mixed, deterministic mode (DESIGN.md section 2: resident == resident needs it on the H100):
`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/loading/test_gpu_dense.py -s`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import (
    DEFAULT_TARGETS,
    RunResult,
    assert_equal_runs,
    fit_on_gpu,
    runs_differ,
)

pytestmark = pytest.mark.gpu

SEQ = 512
STEPS = 8
ACCUMULATE = 2
BLOCK_SIZE = 2


def _builder(path: Path, loader: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        if loader == "standard":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0").train()
        else:
            model = load_blockwise(path, block_size=BLOCK_SIZE, quantize=False, progress=False, share=False)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=DEFAULT_TARGETS)
        return get_peft_model(model, lora)

    return build


def _fit_gpu(path: Path, loader: str, strategy: Any) -> RunResult:
    return fit_on_gpu(_builder(path, loader), strategy, STEPS, ACCUMULATE, SEQ)


def test_dense_load_bytes_equal_from_pretrained_on_the_gpu(qwen2_checkpoint: Path) -> None:
    """Dense tensors are read on the host, never the device: the same bytes as `from_pretrained` on the GPU."""
    expected = {
        name: tensor.cpu()
        for name, tensor in AutoModelForCausalLM.from_pretrained(
            qwen2_checkpoint, dtype=torch.bfloat16, device_map="cuda:0"
        )
        .state_dict()
        .items()
    }
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_blockwise(qwen2_checkpoint, block_size=BLOCK_SIZE, quantize=False, progress=False, share=False)
    assert torch.cuda.max_memory_allocated() == before  # nothing of a dense load touches the device
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert tensor.dtype == actual[name].dtype and torch.equal(tensor, actual[name]), name
    assert host_copy_of(model).arena.pinned


def test_dense_deterministic_parity_and_control(qwen2_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    resident = _fit_gpu(qwen2_checkpoint, "standard", "auto")
    strategy = BlockwiseStrategy(vram_budget=None, block_size=BLOCK_SIZE)
    blockwise = _fit_gpu(qwen2_checkpoint, "blockwise", strategy)
    assert_equal_runs(resident, blockwise)
    print(f"[gpu dense parity] {len(resident.losses)} micro-batches, {STEPS} steps: torch.equal on all")

    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    broken = _fit_gpu(qwen2_checkpoint, "blockwise", BlockwiseStrategy(vram_budget=None, block_size=BLOCK_SIZE))
    assert runs_differ(resident, broken), "control: RNG restore off with dropout on must differ"
