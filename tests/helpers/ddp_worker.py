"""One rank of a data-parallel test run (tests/distributed): fit, then save what the run computed.

Run as ``python -m tests.helpers.ddp_worker OUT --strategy blockwise --devices N ...``, either once with no
``LOCAL_RANK`` in the environment (Lightning's launcher starts the other ranks, re-running this command) or once per
rank with ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK`` set, as torchrun does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from lightning.pytorch.strategies import DDPStrategy

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy
from tests.helpers.models import CausalLMModule, build_model, fit, padded_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a tiny Llama checkpoint, loaded as NF4")
    parser.add_argument("--strategy", choices=["blockwise", "ddp"], required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--ddp-kwargs", type=json.loads, default={}, help="JSON keyword arguments of DDP")
    parser.add_argument("--max-steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    module = CausalLMModule(lambda: build_model("llama", args.checkpoint, quantized=True, lora_dropout=0.1))
    if args.strategy == "blockwise":
        strategy = BlockwiseStrategy(ddp_kwargs=args.ddp_kwargs)
    else:
        strategy = DDPStrategy(**args.ddp_kwargs)
    # Every rank draws 2 micro-batches per optimizer step from its shard of the data (Lightning's DistributedSampler).
    batches = padded_batches(args.devices * 2 * args.max_steps, seed=7)
    result = fit(module, strategy, batches, devices=args.devices, max_steps=args.max_steps, accumulate_grad_batches=2)
    rank = module.trainer.global_rank
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
