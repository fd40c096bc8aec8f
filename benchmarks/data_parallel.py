"""Data-parallel throughput: tokens/s on 1 and N GPUs, blockwise (streamed or resident) and `strategy="ddp"`.

One arm per command; the command is the rank-0 process and Lightning's launcher starts the other ranks by running
it again (as a user's script would). Every rank builds the same random-init NF4 model of ``--shape`` on its own GPU
(seed 0, LoRA r=16 on the seven projections) and trains ``--warmup`` + ``--steps`` micro-batches of ``--seq``
random tokens (batch 1 per rank, bf16-mixed, AdamW, default mode). Each rank times its own micro-batches
(synchronized, median after warm-up) and counts its host-to-device bytes; rank 0 appends one JSON line with every
rank's numbers to ``--out``. Tokens/s is the sum over ranks of ``seq / median``.

Arms (``--arm``): ``blockwise`` (the defaults: every block streamed, every layer recomputed), ``blockwise:BUDGET``
(``vram_budget=BUDGET``: blocks that fit stay resident and keep their activations), ``ddp`` (resident training,
no checkpointing, PyTorch DDP).

    NCCL_NVLS_ENABLE=0 python benchmarks/data_parallel.py --arm blockwise --devices 2 --shape 7b --seq 2048 \\
        --out results.jsonl
    NCCL_NVLS_ENABLE=0 python benchmarks/data_parallel.py --arm blockwise --devices 2 --shape 72b --seq 2048 \\
        --random-init --out results.jsonl

``--random-init`` (blockwise arms): each rank builds the base with ``random_blockwise(share=True)`` instead of on
its GPU: one host copy for the machine (the ranks' ``host_copy`` is ``own`` on one and ``mapped`` on the others).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.step_benchmark import SHAPES, TARGETS, BenchModule, StepTimer, build_model
from lightning_blockwise import BlockwiseStrategy, random_blockwise
from lightning_blockwise.residency.placement import host_copy_of
from lightning_blockwise.residency.shared_arena import shmem_bytes


def _batches(count: int, vocab: int, seq: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def build_in_arena(shape: str, device: torch.device, quantize: bool = True) -> tuple[Any, Any]:
    """``build_model``'s model (seed 0), its base built by ``random_blockwise`` into one host copy per machine.

    The first process on the machine builds the arena; the others build block by block to check the bytes and map
    its pages (NOTE [ One host copy per machine ] in residency/shared_arena.py). Block size 1, the arms'.
    ``quantize=False``: a dense bf16 base.
    """
    config = SHAPES[shape]()
    frozen = random_blockwise(
        config, seed=0, compute_dtype=torch.bfloat16, device=device, share=True, progress=False, quantize=quantize
    )
    torch.manual_seed(0)
    return get_peft_model(frozen, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)), config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", required=True, help="blockwise, blockwise:BUDGET or ddp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="append the arm's JSON line here (rank 0)")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="build the base with random_blockwise(share=True) into one host copy for the machine, not on each GPU",
    )
    args = parser.parse_args()
    if args.random_init and not args.arm.startswith("blockwise"):
        parser.error("--random-init builds the base into the host arena, which only the blockwise arms train from")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    built = time.perf_counter()
    if args.random_init:
        model, config = build_in_arena(args.shape, device)
    else:
        model, config = build_model(args.shape, device)
    built = time.perf_counter() - built
    copy = host_copy_of(model.get_base_model())

    strategy: Any
    if args.arm == "ddp":
        strategy = "ddp" if args.devices > 1 else "auto"
    elif args.arm.startswith("blockwise"):
        _, *budget = args.arm.split(":")
        strategy = BlockwiseStrategy(vram_budget=budget[0] if budget else None, budget_tokens=args.seq)
    else:
        parser.error(f"--arm {args.arm!r}: one of blockwise, blockwise:BUDGET, ddp")
    timer = StepTimer(args.warmup)
    trainer = pl.Trainer(
        accelerator="gpu", devices=args.devices, strategy=strategy, precision="bf16-mixed",
        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    # Every rank draws its own micro-batches from the list (Lightning's DistributedSampler).
    data = _batches((args.warmup + args.steps) * args.devices, config.vocab_size, args.seq)
    trainer.fit(BenchModule(model), DataLoader(data, batch_size=None))
    median = statistics.median(timer.times)
    record = {
        "rank": trainer.global_rank, "s_per_step": median, "tokens_per_s": args.seq / median,
        "h2d_gb_per_step": statistics.median(timer.h2d_bytes) / 1e9,
        "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9, "threads": torch.get_num_threads(),
        "build_s": built, "times": timer.times,
        "host_copy": None if copy is None else "mapped" if copy.arena.read_only else "own",
        "host_copy_gb": None if copy is None else copy.arena.nbytes / 1e9, "shmem_gb": shmem_bytes() / 1e9,
    }  # fmt: skip
    records = [None] * trainer.world_size
    if trainer.world_size > 1:
        torch.distributed.all_gather_object(records, record)
    else:
        records = [record]
    if trainer.global_rank == 0:
        row = {
            "shape": args.shape, "seq": args.seq, "arm": args.arm, "devices": args.devices,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "tokens_per_s": sum(r["tokens_per_s"] for r in records), "ranks": records,
        }  # fmt: skip
        with args.out.open("a") as file:
            file.write(json.dumps(row) + "\n")
        per_rank = ", ".join(
            f"rank {r['rank']} {r['s_per_step']:.3f} s, {r['h2d_gb_per_step']:.1f} GB" for r in records
        )
        print(
            f"RESULT {args.shape} seq {args.seq} {args.arm} x{args.devices}:"
            f" {row['tokens_per_s']:.0f} tokens/s ({per_rank})"
        )


if __name__ == "__main__":
    main()
