"""A rank killed mid-step ends the run within seconds, naming the dead rank; the run then resumes exactly.

NOTE [ A dead rank ends the run ] in lightning_blockwise/strategy/rank_watchdog.py. On CPUs gloo notices a closed
peer socket by itself, so the watchdog's own part is tested with a survivor that waits outside any collective (as a
rank blocked in NCCL does); the training run checks the bound, the freed processes and the exact resume. The GPU test
(tests/gpu/test_gpu_data_parallel.py) kills a rank of an NCCL run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.test_data_parallel import ROOT, _env, _free_port, _worker, run_external
from tests.helpers.models import RunResult, assert_equal_runs, save_checkpoint

#: Seconds the surviving rank may take to end after its peer died (the watchdog checks every second).
BOUND = 30.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _start(command: list[str]) -> list[subprocess.Popen[bytes]]:
    """Two ranks of ``command``, started as torchrun starts them."""
    port = str(_free_port())
    return [
        subprocess.Popen(
            command,
            env=_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE="2",
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
            ),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]


def _survivor_exit(ranks: list[subprocess.Popen[bytes]], limit: float) -> tuple[float | None, str]:
    """Seconds from rank 1's death to rank 0's exit (``None`` if rank 0 still runs after ``limit``), rank 0's log."""
    dead, survivor = ranks[1], ranks[0]
    dead.wait(timeout=300)
    died = time.monotonic()
    try:
        output = survivor.communicate(timeout=limit)[0].decode()
    except subprocess.TimeoutExpired:
        survivor.kill()
        return None, survivor.communicate()[0].decode()
    return time.monotonic() - died, output


def _watchdog_worker(*extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.watchdog_worker", *extra]


def test_the_watchdog_ends_a_waiting_rank_and_names_the_dead_one() -> None:
    ranks = _start(_watchdog_worker())
    seconds, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[1].returncode == -9, "rank 1 was SIGKILLed"
    assert seconds is not None and seconds < BOUND, output[-3000:]
    assert ranks[0].returncode == 1 and "survived" not in output
    assert "rank 1 (process" in output and "died during training" in output and "resume" in output, output[-3000:]


def test_control_without_the_watchdog_the_waiting_rank_goes_on() -> None:
    ranks = _start(_watchdog_worker("--no-watchdog", "--sleep", "8"))
    _, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[0].returncode == 0 and "survived" in output, output[-3000:]


def test_a_rank_that_ends_normally_first_is_no_death() -> None:
    """Rank 1 finishes and exits while rank 0 is still busy: rank 0 finishes too (its store waits for rank 1)."""
    ranks = _start(_watchdog_worker("--finish"))
    outputs = [rank.communicate(timeout=120)[0].decode() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert "rank 0 finished" in outputs[0] and "rank 1 finished" in outputs[1]


def test_a_dead_rank_ends_the_training_run_and_it_resumes_exactly(checkpoint: Path, tmp_path: Path) -> None:
    whole = run_external(tmp_path / "whole", checkpoint, "blockwise", 2, "--epochs", "2", "--load-blockwise")
    command = _worker(tmp_path / "killed", checkpoint, "blockwise", 2, "--epochs", "2", "--load-blockwise")
    ranks = _start([*command, "--die-at-batch", "6"])
    seconds, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[1].returncode == -9, "rank 1 was SIGKILLed"
    # Ended by the watchdog or, on gloo, by the peer's closed socket, whichever comes first.
    assert seconds is not None and seconds < BOUND and ranks[0].returncode != 0, output[-3000:]
    # Whichever came first, the survivor's output names the dead rank in the watchdog's words (issue 41.10).
    assert "rank 1 (process" in output and "died during training" in output, output[-3000:]
    # Both processes are gone, so is every mapping and the pinned registration of the shared host copy.
    assert all(rank.poll() is not None for rank in ranks)
    # The run resumes from its last checkpoint (the first epoch's) and ends as the uninterrupted one.
    [first] = sorted((tmp_path / "killed" / "checkpoints").glob("epoch=0*.ckpt"))
    resumed = run_external(
        tmp_path / "resumed", checkpoint, "blockwise", 2, "--epochs", "2", "--load-blockwise", "--resume", str(first)
    )
    for rank in range(2):
        tail = RunResult(whole[rank].losses[4:], whole[rank].grads[2:], whole[rank].weights, whole[rank].optimizer)
        assert_equal_runs(tail, resumed[rank])
