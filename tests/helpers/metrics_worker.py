"""One rank of the two-rank metric tests (tests/distributed/test_metrics.py): fit `MeteredModule`, save what it logged.

Run once per rank as ``python -m tests.helpers.metrics_worker OUT CHECKPOINT ARM...`` with the variables torchrun
sets (``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK``). The arms run in turn in
this one process over one process group (CI has two cores; each process pays its imports once), each a fresh module
and Trainer: ``ddp`` (`strategy="ddp"`), ``blockwise``, and ``unsynced`` (blockwise, the metrics do not sync when
they compute: the control). Arm ARM's rank R saves ``OUT/ARM/R.pt``.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy
from tests.helpers.metered import MeteredModule, RecordLogged, metric_states
from tests.helpers.models import build_model, fit, padded_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("checkpoint", type=Path, help="a tiny Llama checkpoint, loaded as NF4")
    parser.add_argument("arms", nargs="+", choices=["ddp", "blockwise", "unsynced"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for arm in args.arms:
        _run_arm(args.out / arm, args.checkpoint, arm)
        # The arm's host copy goes with its module; no rank starts the next arm while another still holds it.
        gc.collect()
        torch.distributed.barrier()


def _run_arm(out: Path, checkpoint: Path, arm: str) -> None:
    module = MeteredModule(lambda: build_model("llama", checkpoint, quantized=True), sync=arm != "unsynced")
    strategy = "ddp" if arm == "ddp" else BlockwiseStrategy(vram_budget=None)
    recorder = RecordLogged()
    # Two epochs of 2 optimizer steps per rank, each rank on its shard (Lightning's DistributedSampler).
    batches = padded_batches(8, seed=7)
    result = fit(module, strategy, batches, devices=2, max_steps=-1, max_epochs=2, callbacks=[recorder])
    rank = module.trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"result": result, "records": recorder.records, "states": metric_states(module)}, out / f"{rank}.pt")


if __name__ == "__main__":
    main()
