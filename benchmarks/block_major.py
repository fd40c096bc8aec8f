"""Block-major gradient accumulation against streaming per micro-batch and resident training, in one process.

    python -m benchmarks.block_major --shape 72b --accumulate 4 --windows 2 --warmup 1 \
        --arms resident blockwise blockwise:block_major --out results.jsonl
    python -m benchmarks.block_major --shape 123b --random-init --arms blockwise blockwise:block_major
    python -m benchmarks.block_major --shape 123b --random-init --seq 2048 --accumulate 2 --cap-gib 22 \
        --arms blockwise:block_major

The step benchmark's model (random-init NF4, or with ``--base dense`` bf16, of a real Qwen2.5 shape, LoRA r=16
on the seven projections without dropout: block-major accumulation refuses it), trained through ``Trainer.fit`` with
``accumulate_grad_batches=G`` (bf16-mixed, batch 1, ``--seq`` tokens, AdamW) in each arm: ``resident`` (no
checkpointing, the denominator), ``blockwise`` (streaming every micro-batch, defaults) and
``blockwise:block_major`` (``block_major_accumulation=True``). Per optimizer step (a window of G micro-batches,
timed from its first batch's start to its last batch's end, synchronized): wall time, time per micro-batch and
host-to-device bytes (the streamer's counters); the medians over ``--windows`` windows after ``--warmup``, and
the peak allocated memory over the measured windows. One JSON line per arm. ``--random-init`` builds the base
with ``random_blockwise`` straight into the host arena (shapes whose base does not fit the GPU: ``123b``), afresh
for each arm, without the ``resident`` arm.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks.data_parallel import build_in_arena
from benchmarks.step_benchmark import BASES, SHAPES, BenchModule, StepTimer, build_model
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.residency.placement import detach_host_copy


def run_arm(model: torch.nn.Module, arm: str, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    steps = (args.warmup + args.windows) * args.accumulate
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, args.seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    strategy: Any = "auto"
    if arm.startswith("blockwise"):
        strategy = BlockwiseStrategy(
            vram_budget=None, budget_tokens=args.seq, block_major_accumulation=arm.endswith(":block_major")
        )
    timer = StepTimer(args.warmup * args.accumulate, group=args.accumulate)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=args.warmup + args.windows,
        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer], deterministic=args.deterministic,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
    fit_s = time.perf_counter() - start
    window = statistics.median(timer.times)
    return {
        "s_per_window": window,
        "s_per_micro_batch": window / args.accumulate,
        "h2d_gb_per_window": statistics.median(timer.h2d_bytes) / 1e9,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        "windows": [round(t, 3) for t in timer.times],
        "fit_s": fit_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--base", default="nf4", choices=BASES, help="the frozen base: NF4, or dense bf16")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--arms", nargs="+", default=["resident", "blockwise", "blockwise:block_major"])
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="build the base with random_blockwise into the host arena (never whole on the GPU), afresh for each arm",
    )
    parser.add_argument(
        "--cap-gib", type=float, default=None, help="cap the caching allocator from the start (a smaller card)"
    )
    args = parser.parse_args()
    if args.random_init and "resident" in args.arms:
        parser.error(
            "--random-init builds the base into the host arena; drop the `resident` arm, which needs it on the GPU"
        )
    # With its index: set_per_process_memory_fraction refuses a bare "cuda" (the first GPU run of --cap-gib did).
    device = torch.device("cuda", torch.cuda.current_device())
    if args.cap_gib is not None:
        # Before anything is allocated, as benchmarks/long_context.py's `card` does.
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total, device)

    def build() -> tuple[torch.nn.Module, Any]:
        start = time.perf_counter()
        # LoRA r=16 on the seven projections, PEFT's default dropout of 0 (block-major accumulation refuses dropout).
        if args.random_init:
            built = build_in_arena(args.shape, device, quantize=args.base == "nf4")
        else:
            built = build_model(args.shape, device, args.base)
        print(f"built {args.shape} in {time.perf_counter() - start:.0f} s", flush=True)
        return built

    model, config = build()
    rows = []
    for arm in args.arms:
        if args.random_init and rows:
            # The earlier arm's base is dropped before this arm builds its own (a 123B NF4 arena is 68 GB).
            del model
            gc.collect()
            model, config = build()
        elif not args.random_init:
            model.to(device)  # a blockwise run leaves the base in host memory, as its teardown moves the module
            # The earlier arm's arena is no longer bound: freed before this arm packs its own (a 32B dense base is a
            # 62 GB arena; two at once do not fit a 128 GB host).
            detach_host_copy(model.get_base_model())
        gc.collect()
        torch.cuda.empty_cache()
        row = {
            "shape": args.shape,
            "base": args.base,
            "seq": args.seq,
            "accumulate": args.accumulate,
            "mode": "deterministic" if args.deterministic else "default",
            "arm": arm,
            "device": torch.cuda.get_device_name(),
            **run_arm(model, arm, args, config.vocab_size),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(row) + "\n")
    resident = next((r for r in rows if r["arm"] == "resident"), None)
    for row in rows:
        ratio = f"{row['s_per_micro_batch'] / resident['s_per_micro_batch']:.2f}x" if resident else "-"
        print(
            f"| {row['arm']} | {row['s_per_micro_batch']:.3f} s | {ratio} | {row['h2d_gb_per_window']:.1f} GB |"
            f" {row['peak_gb']:.2f} GB |"
        )


if __name__ == "__main__":
    main()
