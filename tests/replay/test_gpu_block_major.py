"""Block-major gradient accumulation on the GPU: exact to resident accumulation at a 1.5B shape (NF4, seq 512).

`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/replay/test_gpu_block_major.py -s` (deterministic mode:
resident training is reproducible only there). The window's micro-batches run their forwards in threads of
their own (NOTE [ Block-major accumulation ]): on CUDA each thread has its own cuBLAS handle and workspace,
so this is where a difference between threads would show. Control: the window's backward taking its
micro-batches in reverse order differs.
"""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import pytest

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay import block_major
from tests.helpers.models import (
    DEFAULT_TARGETS,
    RunResult,
    assert_equal_runs,
    fit_on_gpu,
    nf4_lora_builder,
    runs_differ,
)

pytestmark = pytest.mark.gpu

SEQ = 512
STEPS = 3
ACCUMULATE = 4


def _fit(path: Path, strategy: Any) -> RunResult:
    build = nf4_lora_builder(path, DEFAULT_TARGETS, r=16, lora_dropout=0.0)
    return fit_on_gpu(build, strategy, STEPS, ACCUMULATE, SEQ)


def test_block_major_equals_resident_deterministic(qwen2_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    resident = _fit(qwen2_checkpoint, "auto")
    windowed = _fit(qwen2_checkpoint, BlockwiseStrategy(vram_budget=None, block_major_accumulation=True))
    assert_equal_runs(windowed, resident)
    monkeypatch.setattr(block_major, "sorted", lambda keys: builtins.sorted(keys, reverse=True), raising=False)
    reversed_order = _fit(qwen2_checkpoint, BlockwiseStrategy(vram_budget=None, block_major_accumulation=True))
    assert runs_differ(reversed_order, resident)
