"""torchmetrics metrics on two gloo ranks: blockwise logs what `strategy="ddp"` logs, synced across the ranks (issue
42, item 2). Each rank is a process of its own (tests/helpers/metrics_worker.py), with one thread; one launch runs
every arm in turn (CI has two cores, and each process pays ~10 s of imports).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers.metered import records_differ
from tests.helpers.models import assert_equal_runs
from tests.helpers.ranks import assert_succeeded, run_ranks

WORLD = 2


def _load(out: Path, arm: str) -> list[dict[str, Any]]:
    return [torch.load(out / arm / f"{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_metrics_on_two_ranks_as_under_ddp(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Perplexity, MeanMetric and MulticlassAccuracy on 2 ranks: every logged value and state equal to DDP's; the
    epoch values are synced (equal on both ranks) while the step values are each rank's own.

    Control: with the metrics' sync off, blockwise logs other epoch values than DDP, and the ranks disagree.
    """
    command = [sys.executable, "-m", "tests.helpers.metrics_worker", str(tmp_path), str(checkpoints["llama"])]
    assert_succeeded(run_ranks([*command, "ddp", "blockwise", "unsynced"], WORLD, timeout=900))
    ddp, blockwise = _load(tmp_path, "ddp"), _load(tmp_path, "blockwise")
    for rank in range(WORLD):
        assert_equal_runs(ddp[rank]["result"], blockwise[rank]["result"])
        assert not records_differ(ddp[rank]["records"], blockwise[rank]["records"])
        states = ddp[rank]["states"]
        assert all(torch.equal(states[k], blockwise[rank]["states"][k]) for k in states)
    # Each epoch's end: its synced values (the `_step` keys still hold each rank's last step).
    ends = [[_epoch_values(blockwise[rank]["records"][i]) for i in (4, 9)] for rank in range(WORLD)]
    assert len(ends[0][0]) == 3 and not records_differ(ends[0], ends[1])
    assert records_differ(blockwise[0]["records"][:4], blockwise[1]["records"][:4])
    unsynced = _load(tmp_path, "unsynced")
    assert records_differ(ddp[0]["records"], unsynced[0]["records"])
    assert records_differ([_epoch_values(unsynced[0]["records"][4])], [_epoch_values(unsynced[1]["records"][4])])


def _epoch_values(record: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in record.items() if k.endswith("_epoch")}
