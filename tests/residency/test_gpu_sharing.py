"""GPU: a process that maps another process's host copy (read-only, page-locked) trains exactly as with its own.

`python -m pytest tests/residency/test_gpu_sharing.py -s` (NOTE [ One host copy per machine ] in
residency/shared_arena.py). Two processes on one GPU: a worker loads the base and holds it; this process
loads the same checkpoint, maps the worker's arena with `cudaHostRegisterReadOnly`, and streams from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy, load_blockwise
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import CausalLMModule, assert_equal_runs, fit, padded_batches

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _module(checkpoint: Path, share: bool) -> CausalLMModule:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        # fp32 as the owner worker loads it: other settings would name another copy.
        model = load_blockwise(checkpoint, compute_dtype=torch.float32, progress=False, share=share)
        return get_peft_model(model, LoraConfig(r=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]))

    return CausalLMModule(build)


def test_training_from_a_shared_read_only_copy_is_exact(small_llama_checkpoint: Path, tmp_path: Path) -> None:
    hold, report = tmp_path / "release", tmp_path / "owner.json"
    command = [sys.executable, "-m", "tests.helpers.share_worker", str(small_llama_checkpoint), str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([*command, "--hold", str(hold), "--device", "cuda"], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 300
        while not report.exists():
            assert owner.poll() is None and time.monotonic() < deadline, "the owner's load failed or hung"
            time.sleep(0.1)
        assert json.loads(report.read_text())["pinned"]
        batches = padded_batches(8, batch_size=2, seq=128, vocab=1024)
        shared = _module(small_llama_checkpoint, share=True)
        copy = host_copy_of(shared.model.get_base_model())
        assert copy is not None and copy.arena.read_only and copy.arena.pinned
        mapped = fit(
            shared,
            BlockwiseStrategy(vram_budget=None, block_size=1),
            batches,
            accelerator="gpu",
            precision="bf16-mixed",
        )
    finally:
        hold.touch()
        assert owner.wait(timeout=120) == 0
    own = _module(small_llama_checkpoint, share=False)
    own_copy = host_copy_of(own.model.get_base_model())
    assert own_copy is not None and not own_copy.arena.read_only
    mine = fit(
        own, BlockwiseStrategy(vram_budget=None, block_size=1), batches, accelerator="gpu", precision="bf16-mixed"
    )
    print(f"\n[shared copy] losses {[round(x.item(), 4) for x in mapped.losses]}")
    assert_equal_runs(mine, mapped)
