"""A rank killed mid-step ends the run within seconds, naming the dead rank; the run then resumes exactly.

NOTE [ A dead rank ends the run ] in lightning_blockwise/strategy/rank_watchdog.py. On CPUs gloo notices a closed
peer socket by itself, so the watchdog's own part is tested with a survivor that waits outside any collective (as a
rank blocked in NCCL does); the training run checks the bound, the freed processes and the exact resume. The GPU test
(tests/distributed/test_gpu_data_parallel.py) kills a rank of an NCCL run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.distributed.test_data_parallel import _arm, _results, _worker, run_arms
from tests.helpers.models import RunResult, assert_equal_runs
from tests.helpers.ranks import start_ranks

#: Seconds the surviving rank may take to end after its peer died (the watchdog checks every second).
BOUND = 30.0


def _start(command: list[str]) -> list[subprocess.Popen[bytes]]:
    """Two ranks of ``command``, started as torchrun starts them."""
    return start_ranks(command, world=2)


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


@pytest.fixture(scope="module")
def waiting() -> Iterator[dict[str, list[subprocess.Popen[bytes]]]]:
    """The three 2-rank runs of the watchdog alone, started at once: each spends most of its life asleep or waiting
    on its dead peer (CI has two cores), and each test below reads its own run's ranks. The first test watches its
    run from before rank 1 dies, so the seconds it measures are the survivor's whole way out."""
    runs = {
        "watched": _start(_watchdog_worker()),
        "unwatched": _start(_watchdog_worker("--no-watchdog", "--sleep", "8")),
        "finishing": _start(_watchdog_worker("--finish")),
    }
    yield runs
    for rank in (rank for ranks in runs.values() for rank in ranks if rank.poll() is None):
        rank.kill()  # a test that failed before its run ended
        rank.communicate()


def test_the_watchdog_ends_a_waiting_rank_and_names_the_dead_one(waiting: dict) -> None:
    ranks = waiting["watched"]
    seconds, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[1].returncode == -9, "rank 1 was SIGKILLed"
    assert seconds is not None and seconds < BOUND, output[-3000:]
    assert ranks[0].returncode == 1 and "survived" not in output
    assert "rank 1 (process" in output and "died during training" in output and "resume" in output, output[-3000:]


def test_control_without_the_watchdog_the_waiting_rank_goes_on(waiting: dict) -> None:
    ranks = waiting["unwatched"]
    _, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[0].returncode == 0 and "survived" in output, output[-3000:]


def test_a_rank_that_ends_normally_first_is_no_death(waiting: dict) -> None:
    """Rank 1 finishes and exits while rank 0 is still busy: rank 0 finishes too (its store waits for rank 1)."""
    ranks = waiting["finishing"]
    outputs = [rank.communicate(timeout=120)[0].decode() for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert "rank 0 finished" in outputs[0] and "rank 1 finished" in outputs[1]


def test_a_dead_rank_ends_the_training_run_and_it_resumes_exactly(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    checkpoint, epochs = checkpoints["llama"], ("--epochs", "2", "--load-blockwise")
    ranks = _start([*_worker(tmp_path / "killed", checkpoint, "blockwise", 2, *epochs), "--die-at-batch", "6"])
    seconds, output = _survivor_exit(ranks, limit=BOUND)
    assert ranks[1].returncode == -9, "rank 1 was SIGKILLed"
    # Ended by the watchdog or, on gloo, by the peer's closed socket, whichever comes first.
    assert seconds is not None and seconds < BOUND and ranks[0].returncode != 0, output[-3000:]
    # Whichever came first, the survivor's output names the dead rank in the watchdog's words (issue 41.10).
    assert "rank 1 (process" in output and "died during training" in output, output[-3000:]
    # Both processes are gone, so is every mapping and the pinned registration of the shared host copy.
    assert all(rank.poll() is not None for rank in ranks)
    # The run resumes from its last checkpoint (the first epoch's) and ends as the uninterrupted one (both arms in
    # one launch, after the kill: a launch's imports cost ~10 s a process on CI's two cores).
    [first] = sorted((tmp_path / "killed" / "checkpoints").glob("epoch=0*.ckpt"))
    arms = {
        "whole": _arm(tmp_path / "whole", checkpoint, "blockwise", 2, *epochs),
        "resumed": _arm(tmp_path / "resumed", checkpoint, "blockwise", 2, *epochs, "--resume", str(first)),
    }
    run_arms(tmp_path / "launch", 2, arms)
    whole, resumed = _results(tmp_path / "whole", 2), _results(tmp_path / "resumed", 2)
    for rank in range(2):
        tail = RunResult(whole[rank].losses[4:], whole[rank].grads[2:], whole[rank].weights, whole[rank].optimizer)
        assert_equal_runs(tail, resumed[rank])
