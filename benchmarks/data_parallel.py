"""Data-parallel throughput: tokens/s on 1 and N GPUs, blockwise (streamed or resident) and `strategy="ddp"`.

One arm per command; the command is the rank-0 process and Lightning's launcher starts the other ranks by running
it again (as a user's script would). Every rank builds the same random-init NF4 model of ``--shape`` on its own GPU
(seed 0, LoRA r=16 on the seven projections, dropout 0) and trains ``--warmup`` + ``--steps`` optimizer steps of
``--accumulate`` micro-batches of ``--seq`` random tokens each (batch 1 per rank, bf16-mixed, AdamW, default mode).
Each rank times its own optimizer steps (synchronized, from a step's first micro-batch's start to its last one's
end, median after warm-up) and counts its host-to-device bytes; every figure is reported per micro-batch (a step's
divided by ``--accumulate``), so rows with and without accumulation compare. Rank 0 appends one JSON line with
every rank's numbers to ``--out`` (``s_per_step`` and ``h2d_gb_per_step`` per micro-batch, ``times`` each timed
optimizer step's seconds). Tokens/s is the sum over ranks of ``seq`` over the seconds per micro-batch.

Arms (``--arm``): ``blockwise`` (the defaults: every block streamed, every layer recomputed), ``blockwise:BUDGET``
(``vram_budget=BUDGET``: blocks that fit stay resident and keep their activations), ``blockwise:block_major``
(every block streamed, ``block_major_accumulation=True``: each block copied once per window of ``--accumulate``
micro-batches and pass; needs ``--accumulate`` of at least 2), ``ddp`` (resident training, no checkpointing,
PyTorch DDP).

    NCCL_NVLS_ENABLE=0 python benchmarks/data_parallel.py --arm blockwise --devices 2 --shape 7b --seq 2048 \\
        --out results.jsonl
    NCCL_NVLS_ENABLE=0 python benchmarks/data_parallel.py --arm blockwise --devices 2 --shape 72b --seq 2048 \\
        --random-init --out results.jsonl
    NCCL_NVLS_ENABLE=0 python benchmarks/data_parallel.py --arm blockwise:block_major --accumulate 4 --devices 2 \\
        --shape 72b --seq 2048 --random-init --steps 3 --warmup 1 --out results.jsonl

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


#: The arm that runs block-major windows (``blockwise:BUDGET`` otherwise reads a budget).
BLOCK_MAJOR = "blockwise:block_major"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; an arm and options that do not go together are refused here, before any model work."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", required=True, help=f"blockwise, blockwise:BUDGET, {BLOCK_MAJOR} or ddp")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps timed")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps before the timed ones")
    parser.add_argument(
        "--accumulate", type=int, default=1, help="micro-batches per optimizer step (Trainer accumulate_grad_batches)"
    )
    parser.add_argument("--out", type=Path, required=True, help="append the arm's JSON line here (rank 0)")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="build the base with random_blockwise(share=True) into one host copy for the machine, not on each GPU",
    )
    args = parser.parse_args(argv)
    if args.arm != "ddp" and args.arm.split(":")[0] != "blockwise":
        parser.error(f"--arm {args.arm!r}: one of blockwise, blockwise:BUDGET, {BLOCK_MAJOR}, ddp")
    if args.random_init and not args.arm.startswith("blockwise"):
        parser.error("--random-init builds the base into the host arena, which only the blockwise arms train from")
    if args.accumulate < 1:
        parser.error(f"--accumulate {args.accumulate}: at least 1 micro-batch per optimizer step")
    if args.arm == BLOCK_MAJOR and args.accumulate < 2:
        parser.error(f"--arm {BLOCK_MAJOR} runs windows of --accumulate micro-batches: give --accumulate 2 or more")
    return args


def arm_strategy(arm: str, devices: int, seq: int) -> Any:
    """The Trainer's ``strategy`` for ``arm`` (checked by :func:`parse_args`)."""
    if arm == "ddp":
        return "ddp" if devices > 1 else "auto"
    if arm == BLOCK_MAJOR:
        return BlockwiseStrategy(vram_budget=None, budget_tokens=seq, block_major_accumulation=True)
    _, *budget = arm.split(":")
    return BlockwiseStrategy(vram_budget=budget[0] if budget else None, budget_tokens=seq)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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

    group = args.accumulate
    # Whole optimizer steps: a block-major window runs its micro-batches' forwards in the first one's call and their
    # backwards in the last one's, so only a step's time means anything; per micro-batch it is divided by `group`.
    timer = StepTimer(args.warmup * group, group=group)
    trainer = pl.Trainer(
        accelerator="gpu", devices=args.devices, strategy=arm_strategy(args.arm, args.devices, args.seq),
        precision="bf16-mixed", max_steps=args.warmup + args.steps, accumulate_grad_batches=group, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
    )  # fmt: skip
    # Every rank draws its own micro-batches from the list (Lightning's DistributedSampler).
    data = _batches((args.warmup + args.steps) * group * args.devices, config.vocab_size, args.seq)
    trainer.fit(BenchModule(model), DataLoader(data, batch_size=None))
    median = statistics.median(timer.times) / group
    record = {
        "rank": trainer.global_rank, "s_per_step": median, "tokens_per_s": args.seq / median,
        "h2d_gb_per_step": statistics.median(timer.h2d_bytes) / group / 1e9,
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
            "shape": args.shape, "seq": args.seq, "arm": args.arm, "devices": args.devices, "accumulate": group,
            "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "tokens_per_s": sum(r["tokens_per_s"] for r in records), "ranks": records,
        }  # fmt: skip
        with args.out.open("a") as file:
            file.write(json.dumps(row) + "\n")
        per_rank = ", ".join(
            f"rank {r['rank']} {r['s_per_step']:.3f} s, {r['h2d_gb_per_step']:.1f} GB" for r in records
        )
        print(
            f"RESULT {args.shape} seq {args.seq} {args.arm} x{args.devices}, G={group}:"
            f" {row['tokens_per_s']:.0f} tokens/s ({per_rank}, per micro-batch)"
        )


if __name__ == "__main__":
    main()
