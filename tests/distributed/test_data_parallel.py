"""Data-parallel blockwise training on CPUs (gloo): exact against `strategy="ddp"`, launched like Lightning or torchrun.

Every arm runs its ranks as separate processes (`tests/helpers/ddp_worker.py`), each with one thread.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.models import CONFIGS, RunResult, assert_equal_runs, runs_differ, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def checkpoint_without_dropout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama without attention dropout: block-major accumulation refuses dropout in the decoder."""
    path = tmp_path_factory.mktemp("llama_without_dropout")
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.0
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(out: Path, checkpoint: Path, strategy: str, devices: int, *extra: str) -> list[str]:
    command = [sys.executable, "-m", "tests.helpers.ddp_worker", str(out), "--checkpoint", str(checkpoint)]
    return [*command, "--strategy", strategy, "--devices", str(devices), *extra]


def _env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(variables)
    return env


def run_external(out: Path, checkpoint: Path, strategy: str, world: int, *extra: str) -> list[RunResult]:
    """Start one process per rank with the variables torchrun sets; each rank's results."""
    port = str(_free_port())
    processes = [
        subprocess.Popen(
            _worker(out, checkpoint, strategy, world, *extra),
            cwd=ROOT,
            env=_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE=str(world),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    outputs = [process.communicate(timeout=300)[0].decode() for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def test_three_ranks_exact_against_ddp(checkpoint: Path, tmp_path: Path) -> None:
    """Blockwise on 3 ranks is `torch.equal` to `strategy="ddp"` on 3 ranks: losses, reduced grads, weights, Adam.

    With 3 ranks a sum's order depends on where a gradient sits in DDP's buckets (gloo and NCCL reduce chunk by
    chunk, starting at different ranks); the control shows that: DDP with other buckets computes other numbers.
    """
    blockwise = run_external(tmp_path / "blockwise", checkpoint, "blockwise", 3)
    ddp = run_external(tmp_path / "ddp", checkpoint, "ddp", 3)
    for rank in range(3):
        assert_equal_runs(ddp[rank], blockwise[rank])
    # The ranks packed one host copy (share_host_copy=None shares among a run's ranks): one serves, two map it.
    roles = [json.loads((tmp_path / "blockwise" / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert sorted((role["serving"], role["read_only"]) for role in roles) == [(False, True)] * 2 + [(True, False)]
    # Reduced gradients are the same on every rank, and not any one rank's own.
    for name, grad in blockwise[0].grads[0].items():
        assert torch.equal(grad, blockwise[2].grads[0][name])
    # Control: without the reduction each rank steps on its own gradients, which differ (the ranks see other data).
    local = run_external(tmp_path / "local", checkpoint, "blockwise", 3, "--no-reduce")
    assert runs_differ(ddp[0], local[0])
    assert any(not torch.equal(grad, local[1].grads[0][name]) for name, grad in local[0].grads[0].items())
    # Control: buckets of another layout sum in another order.
    other = run_external(tmp_path / "other", checkpoint, "ddp", 3, "--ddp-kwargs", '{"bucket_cap_mb": 0.0005}')
    assert runs_differ(ddp[0], other[0])


def test_resume_on_two_ranks_is_exact(checkpoint: Path, tmp_path: Path) -> None:
    """Resumed after its first epoch, a 2-rank run ends as the uninterrupted one: every rank's RNG comes back.

    The ranks draw different dropout masks (`_RankSeed`), so a resume that gave rank 1 rank 0's random numbers
    would differ: the control resumes from the same checkpoint without the per-rank states.
    """
    whole = run_external(tmp_path / "whole", checkpoint, "blockwise", 2, "--epochs", "2")
    first = sorted((tmp_path / "whole" / "checkpoints").glob("epoch=0*.ckpt"))
    assert len(first) == 1, list((tmp_path / "whole" / "checkpoints").iterdir())
    resumed = run_external(tmp_path / "resumed", checkpoint, "blockwise", 2, "--epochs", "2", "--resume", str(first[0]))
    # The resumed run's records start at the second epoch: compare them with the uninterrupted run's.
    tails = [RunResult(run.losses[4:], run.grads[2:], run.weights, run.optimizer) for run in whole]
    for rank in range(2):
        assert_equal_runs(tails[rank], resumed[rank])
    control = run_external(
        tmp_path / "control", checkpoint, "blockwise", 2, "--epochs", "2", "--resume", str(first[0]), "--drop-rank-rng"
    )
    # Rank 1 draws rank 0's masks from the first micro-batch on; after the first reduction both ranks differ.
    assert not torch.equal(whole[1].losses[4], control[1].losses[0])
    assert torch.equal(whole[0].losses[4], control[0].losses[0])
    assert runs_differ(tails[0], control[0]) and runs_differ(tails[1], control[1])


def test_block_major_on_two_ranks_exact_against_ddp(checkpoint_without_dropout: Path, tmp_path: Path) -> None:
    """Block-major windows of 3 micro-batches on 2 ranks are `torch.equal` to `strategy="ddp"` with
    `accumulate_grad_batches=3`: losses, reduced grads, weights, Adam, over 3 optimizer steps on both ranks.

    NOTE [ Block-major windows on several ranks ]: DDP's reducer sees each adapter once per window, after the window's
    local sum. Control: the same block-major run without the reduction differs, and its ranks' gradients too.
    """
    common = ("--accumulate", "3", "--lora-dropout", "0")
    windowed = run_external(tmp_path / "windowed", checkpoint_without_dropout, "blockwise", 2, "--block-major", *common)
    ddp = run_external(tmp_path / "ddp", checkpoint_without_dropout, "ddp", 2, *common)
    for rank in range(2):
        assert_equal_runs(ddp[rank], windowed[rank])
        record = json.loads((tmp_path / "windowed" / f"rank{rank}.json").read_text())
        # Every optimizer step was one window whose backward fired DDP's hooks once per adapter.
        assert record["windows"] == [True] * 3
    for name, grad in windowed[0].grads[0].items():
        assert torch.equal(grad, windowed[1].grads[0][name])
    local = run_external(
        tmp_path / "local", checkpoint_without_dropout, "blockwise", 2, "--block-major", "--no-reduce", *common
    )
    assert runs_differ(ddp[0], local[0]) and runs_differ(ddp[1], local[1])
    assert any(not torch.equal(grad, local[1].grads[0][name]) for name, grad in local[0].grads[0].items())


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")
def test_two_ranks_share_one_host_copy(checkpoint: Path, tmp_path: Path) -> None:
    """Ranks that load with `load_blockwise` keep one host copy: one serves it, the other maps it read-only.

    And training is unchanged: exact against `strategy="ddp"` over `from_pretrained` models (the same bytes).
    """
    shared = run_external(tmp_path / "shared", checkpoint, "blockwise", 2, "--load-blockwise")
    ddp = run_external(tmp_path / "ddp", checkpoint, "ddp", 2)
    for rank in range(2):
        assert_equal_runs(ddp[rank], shared[rank])
    roles = [json.loads((tmp_path / "shared" / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert sorted((role["serving"], role["read_only"]) for role in roles) == [(False, True), (True, False)]
    # DDP broadcast nothing into the arena: its bytes are those loaded, in the rank that owns it too.
    assert all(role["unchanged"] for role in roles)


def test_callbacks_on_two_ranks(checkpoint: Path, tmp_path: Path) -> None:
    """`ParityCheck` passes on every rank (each checks its own first micro-batch, before DDP's reduction) and leaves
    no trace; `BlockwiseProfiler` profiles every rank's own steps."""
    checked = run_external(tmp_path / "checked", checkpoint, "blockwise", 2, "--callbacks")
    plain = run_external(tmp_path / "plain", checkpoint, "blockwise", 2)
    for rank in range(2):
        assert_equal_runs(plain[rank], checked[rank])
        record = json.loads((tmp_path / "checked" / f"callbacks{rank}.json").read_text())
        assert record == {"passed": True, "profiled": True}


def test_lightnings_launcher_starts_the_other_rank(checkpoint: Path, tmp_path: Path) -> None:
    """`python script.py` with `devices=2` (no launcher variables): Lightning starts rank 1 itself, as for `ddp`.

    The run is the one torchrun-style processes give (that the comparison can fail, the controls above show).
    """
    launched = subprocess.run(
        _worker(tmp_path / "lightning", checkpoint, "blockwise", 2),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stdout.decode()[-4000:] + launched.stderr.decode()[-4000:]
    external = run_external(tmp_path / "external", checkpoint, "blockwise", 2)
    for rank in range(2):
        assert_equal_runs(external[rank], torch.load(tmp_path / "lightning" / f"rank{rank}.pt", weights_only=False))
