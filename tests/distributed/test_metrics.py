"""torchmetrics metrics on two gloo ranks: blockwise logs what `strategy="ddp"` logs, synced across the ranks (issue
42, item 2). Each rank is a process of its own (tests/helpers/metrics_worker.py), with one thread.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.metered import records_differ
from tests.helpers.models import assert_equal_runs, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(out: Path, checkpoint: Path, strategy: str, *extra: str) -> list[dict[str, Any]]:
    """Start one process per rank, as torchrun does; what each rank saved."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "tests.helpers.metrics_worker", str(out), str(checkpoint), strategy, *extra]
    processes = [
        subprocess.Popen(
            command,
            cwd=ROOT,
            env={
                **env,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": str(WORLD),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "NODE_RANK": "0",
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(WORLD)
    ]
    outputs = [process.communicate(timeout=300)[0].decode() for process in processes]
    for process, output in zip(processes, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    return [torch.load(out / f"{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_metrics_on_two_ranks_as_under_ddp(checkpoint: Path, tmp_path: Path) -> None:
    """Perplexity, MeanMetric and MulticlassAccuracy on 2 ranks: every logged value and state equal to DDP's; the
    epoch values are synced (equal on both ranks) while the step values are each rank's own.

    Control: with the metrics' sync off, blockwise logs other epoch values than DDP, and the ranks disagree.
    """
    ddp = _run(tmp_path / "ddp", checkpoint, "ddp")
    blockwise = _run(tmp_path / "blockwise", checkpoint, "blockwise")
    for rank in range(WORLD):
        assert_equal_runs(ddp[rank]["result"], blockwise[rank]["result"])
        assert not records_differ(ddp[rank]["records"], blockwise[rank]["records"])
        states = ddp[rank]["states"]
        assert all(torch.equal(states[k], blockwise[rank]["states"][k]) for k in states)
    # Each epoch's end: its synced values (the `_step` keys still hold each rank's last step).
    ends = [[_epoch_values(blockwise[rank]["records"][i]) for i in (4, 9)] for rank in range(WORLD)]
    assert len(ends[0][0]) == 3 and not records_differ(ends[0], ends[1])
    assert records_differ(blockwise[0]["records"][:4], blockwise[1]["records"][:4])
    unsynced = _run(tmp_path / "unsynced", checkpoint, "blockwise", "--no-sync")
    assert records_differ(ddp[0]["records"], unsynced[0]["records"])
    assert records_differ([_epoch_values(unsynced[0]["records"][4])], [_epoch_values(unsynced[1]["records"][4])])


def _epoch_values(record: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in record.items() if k.endswith("_epoch")}
