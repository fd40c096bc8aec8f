"""One rank of the two-rank metric tests (tests/distributed/test_metrics.py): fit `MeteredModule`, save what it logged.

Run once per rank as ``python -m tests.helpers.metrics_worker OUT CHECKPOINT STRATEGY`` with the variables torchrun
sets (``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK``).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("strategy", choices=["blockwise", "ddp"])
    parser.add_argument("--no-sync", action="store_true", help="control: the metrics do not sync when they compute")
    args = parser.parse_args()
    torch.set_num_threads(1)
    module = MeteredModule(lambda: build_model("llama", args.checkpoint, quantized=True), sync=not args.no_sync)
    strategy = BlockwiseStrategy(vram_budget=None) if args.strategy == "blockwise" else "ddp"
    recorder = RecordLogged()
    # Two epochs of 2 optimizer steps per rank, each rank on its shard (Lightning's DistributedSampler).
    batches = padded_batches(8, seed=7)
    result = fit(module, strategy, batches, devices=2, max_steps=-1, max_epochs=2, callbacks=[recorder])
    rank = module.trainer.global_rank
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"result": result, "records": recorder.records, "states": metric_states(module)}, args.out / f"{rank}.pt"
    )


if __name__ == "__main__":
    main()
