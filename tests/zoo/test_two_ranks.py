"""Zoo: two clients on two CPU ranks (gloo), ``strategy="blockwise"`` against ``strategy="ddp"`` (issue 42, item 5).

One launch of two processes (tests/helpers/ranks.py) fits each client under both strategies in turn
(tests/zoo/ranks_worker.py); on every rank the runs are compared with ``torch.equal`` in every loss, gradient (as
the optimizer sees it: reduced over the ranks), trained tensor, optimizer state and logged metric (``sync_dist``
and a torchmetrics metric included), and on rank 0, which writes the checkpoints, in the files' names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.helpers.ranks import run_ranks
from tests.zoo.harness import ZooRun, assert_same, assert_sees_each_field, differences
from tests.zoo.ranks_worker import CLIENTS

WORLD = 2


def test_two_clients_on_two_ranks_blockwise_equals_ddp(zoo_base: Path, tmp_path: Path) -> None:
    ranks = run_ranks([sys.executable, "-m", "tests.zoo.ranks_worker", str(tmp_path), str(zoo_base)], WORLD, 600)
    for rank, (code, output) in enumerate(ranks):
        assert code == 0, f"rank {rank} exited with {code}:\n{output[-4000:]}"
    runs: list[dict[tuple[str, str], ZooRun]] = [
        torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(WORLD)
    ]
    for client in CLIENTS:
        first, second = (runs[rank][client, "ddp"] for rank in range(WORLD))
        assert_same(first, runs[0][client, "blockwise"])
        assert_sees_each_field(first)
        # Rank 1 writes no checkpoint: the same run in everything but the names of files it wrote itself.
        assert second.losses and not [d for d in differences(second, runs[1][client, "blockwise"]) if d != "files"]
        # Really two ranks: each its own micro-batches (own losses), the gradients reduced over both (equal).
        assert not any(torch.equal(a, b) for a, b in zip(first.losses, second.losses, strict=True)), client
        assert all(
            torch.equal(a[name], b[name]) for a, b in zip(first.grads, second.grads, strict=True) for name in a
        ), client
    # What is synced over the ranks is logged alike on both: the `sync_dist=True` loss, the torchmetrics metric.
    for client, synced in (("PlQLoRA", "train_loss_epoch"), ("LitConfigureModel", "train/ppl_epoch")):
        first, second = (runs[rank][client, "blockwise"].logged[-1] for rank in range(WORLD))
        assert torch.equal(first[synced], second[synced]), (client, synced)
    unsynced = [runs[rank]["LitConfigureModel", "blockwise"].logged[-1]["train/loss"] for rank in range(WORLD)]
    assert not torch.equal(*unsynced)  # control: a metric logged without syncing is each rank's own
