"""Data parallelism on two GPUs (NCCL): blockwise against `strategy="ddp"`, block-major windows, one host copy, resume.

Deterministic mode (`Trainer(deterministic=True)`, `CUBLAS_WORKSPACE_CONFIG=:4096:8`), bf16-mixed, NF4 with bf16
compute, LoRA r=16 with dropout 0.1 on every projection, 2 micro-batches of 512 tokens per optimizer step (block-major:
dropout 0, 3 micro-batches), on a Qwen2.5-1.5B-shaped model cut to 8 layers (each layer of the real shape). Each
rank is a process (`tests/helpers/ddp_worker.py --gpu`), as torchrun starts them. Needs two CUDA devices; skipped
otherwise.
Run: `NCCL_NVLS_ENABLE=0 CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/distributed/test_gpu_data_parallel.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tests.distributed.test_data_parallel import _worker, run_external
from tests.distributed.test_rank_watchdog import BOUND, _start, _survivor_exit
from tests.helpers.models import GPU_SHAPES, RunResult, assert_equal_runs, runs_differ

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
    pytest.mark.skipif(
        os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8", reason="deterministic mode: CUBLAS_WORKSPACE_CONFIG"
    ),
]

WORLD = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen2_8_layers")
    # Built anew with 8 layers: the per-layer lists (`layer_types`) must have that length too.
    fields = {**GPU_SHAPES["qwen2"]().to_dict(), "num_hidden_layers": 8}
    fields.pop("layer_types", None)
    config = Qwen2Config(**fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def _run(out: Path, checkpoint: Path, strategy: str, *extra: str) -> list[RunResult]:
    return run_external(out, checkpoint, strategy, WORLD, "--gpu", "--max-steps", "4", *extra)


def test_blockwise_on_two_gpus_equals_ddp(checkpoint: Path, tmp_path: Path) -> None:
    """Losses, reduced grads, adapters and Adam state `torch.equal` on both ranks; the control reduces nothing."""
    ddp = _run(tmp_path / "ddp", checkpoint, "ddp")
    blockwise = _run(tmp_path / "blockwise", checkpoint, "blockwise")
    for rank in range(WORLD):
        assert_equal_runs(ddp[rank], blockwise[rank])
    for name, grad in blockwise[0].grads[0].items():
        # Each rank's records were saved on its own device.
        assert torch.equal(grad.cpu(), blockwise[1].grads[0][name].cpu()), "the ranks' reduced gradients differ"
    local = _run(tmp_path / "local", checkpoint, "blockwise", "--no-reduce")
    assert runs_differ(ddp[0], local[0]) and runs_differ(ddp[1], local[1])


def test_block_major_on_two_gpus_equals_ddp(checkpoint: Path, tmp_path: Path) -> None:
    """Block-major windows of 3 micro-batches == `strategy="ddp"` with `accumulate_grad_batches=3`: losses, reduced
    grads, adapters and Adam state `torch.equal` on both ranks, every optimizer step one window whose backward fired
    DDP's hooks once per adapter (NOTE [ Block-major windows on several ranks ]); the control reduces nothing."""
    common = ("--accumulate", "3", "--lora-dropout", "0")
    windowed = _run(tmp_path / "windowed", checkpoint, "blockwise", "--block-major", *common)
    ddp = _run(tmp_path / "ddp", checkpoint, "ddp", *common)
    for rank in range(WORLD):
        assert_equal_runs(ddp[rank], windowed[rank])
        record = json.loads((tmp_path / "windowed" / f"rank{rank}.json").read_text())
        assert record["windows"] == [True] * 4, record["windows"]
    for name, grad in windowed[0].grads[0].items():
        assert torch.equal(grad.cpu(), windowed[1].grads[0][name].cpu()), "the ranks' reduced gradients differ"
    local = _run(tmp_path / "local", checkpoint, "blockwise", "--block-major", "--no-reduce", *common)
    assert runs_differ(ddp[0], local[0]) and runs_differ(ddp[1], local[1])


def test_one_host_copy_on_two_gpus_trains_exactly(checkpoint: Path, tmp_path: Path) -> None:
    """`load_blockwise` on both ranks: one pinned host copy, served by one rank, mapped read-only (and page-locked)
    by the other; training equals DDP over `from_pretrained` models, and the shared bytes stay unchanged."""
    shared = _run(tmp_path / "shared", checkpoint, "blockwise", "--load-blockwise")
    ddp = _run(tmp_path / "ddp", checkpoint, "ddp")
    for rank in range(WORLD):
        assert_equal_runs(ddp[rank], shared[rank])
    roles = [json.loads((tmp_path / "shared" / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert sorted((role["serving"], role["read_only"]) for role in roles) == [(False, True), (True, False)]
    assert all(role["unchanged"] for role in roles)


def test_a_dead_rank_ends_the_run_and_the_run_resumes_exactly(checkpoint: Path, tmp_path: Path) -> None:
    """Rank 1 SIGKILLed before a backward of the second epoch: rank 0, blocked in NCCL's all-reduce, ends within
    the bound naming rank 1 (NOTE [ A dead rank ends the run ]); resumed from the first epoch's checkpoint, the run
    ends as the uninterrupted one. Without the ranks' own RNG states (control) it does not."""
    whole = _run(tmp_path / "whole", checkpoint, "blockwise", "--epochs", "2")
    command = _worker(tmp_path / "killed", checkpoint, "blockwise", WORLD, "--gpu", "--epochs", "2")
    ranks = _start([*command, "--die-at-batch", "6"])
    seconds, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[1].returncode == -9, "rank 1 was SIGKILLed"
    assert seconds is not None and seconds < BOUND and ranks[0].returncode == 1, output[-3000:]
    assert "rank 1 (process" in output and "died during training" in output, output[-3000:]
    [first] = sorted((tmp_path / "killed" / "checkpoints").glob("epoch=0*.ckpt"))
    resumed = _run(tmp_path / "resumed", checkpoint, "blockwise", "--epochs", "2", "--resume", str(first))
    tails = [RunResult(run.losses[4:], run.grads[2:], run.weights, run.optimizer) for run in whole]
    for rank in range(WORLD):
        assert_equal_runs(tails[rank], resumed[rank])
    control = _run(
        tmp_path / "control", checkpoint, "blockwise", "--epochs", "2", "--resume", str(first), "--drop-rank-rng"
    )
    assert runs_differ(tails[1], control[1])
