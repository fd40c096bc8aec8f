"""Where a budget plan's step goes, layer by kind: kept or recomputed, resident or streamed (issue 13, item 2).

Builds the step benchmark's model (random-init NF4 of a real shape, LoRA r=16 on the seven projections), then for
each arm fits `--warmup + --steps` batches of `--seq` tokens and traces the last one with the streamer's observer
(CUDA events on the compute and copy streams, no synchronize until the step ends). Per arm it reports the step's
wall time, and per pass and kind of layer (resident or streamed, kept or recomputed; layers of resident blocks
that keep their graphs run plain autograd and are not observed) the count and summed compute-stream span, the gaps
between one observed layer's end and the next one's start (the host's work between layers: the streamer's
acquire and release, the wrappers), the compute stream's waits for copies, and the copies.

    python -m benchmarks.plan_breakdown --shape 7b --arms 6GB none [--seq 512 --steps 6 --warmup 3]

(block_size 1: a block is a layer.)

Arms: `BUDGET` is `BlockwiseStrategy(vram_budget=BUDGET)`; `none` streams every block. (`BUDGET:timed` arms in
older results ran the removed `timed_plan=True`.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from benchmarks.step_benchmark import SHAPES, BenchModule, build_model
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.stream_trace import Tee, Trace, elapsed_ms


class TraceLastBatch(pl.Callback):
    """Traces batch ``index``: the streamer's layer runs, copies and waits, and the batch's wall time."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.result: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx != self.index:
            return
        strategy = trainer.strategy
        self.trace = Trace(cuda=True, block_of=strategy.plan.block_of)
        self.trace.start()
        self.previous = strategy.observer
        strategy.set_observer(Tee(self.previous, self.trace))
        torch.cuda.synchronize()
        self.start = self.trace.mark()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if args[-1] != self.index:
            return
        end = self.trace.mark()
        self.trace.stop()
        trainer.strategy.set_observer(self.previous)
        torch.cuda.synchronize()
        plan = trainer.strategy.residency_plan
        self.result = summarize(self.trace, elapsed_ms(self.start, end), set(plan.resident), set(plan.kept))


def summarize(trace: Trace, wall_ms: float, resident: set[int], kept: set[int]) -> dict[str, Any]:
    """The traced step by pass and kind of layer, in milliseconds."""
    spans: dict[str, list[float]] = defaultdict(list)
    gaps: dict[str, list[float]] = defaultdict(list)
    previous: tuple[int, Pass, Any] | None = None
    for block, phase, start, end in trace.layers:
        kind = f"{phase.value}:{'resident' if block in resident else 'streamed'}:{'kept' if block in kept else 'remat'}"
        spans[kind].append(elapsed_ms(start, end))
        # Only between neighbours in one pass (layers of resident kept blocks are not observed: no gap across them).
        step = 1 if phase is Pass.FORWARD else -1
        if previous is not None and previous[1] is phase and block == previous[0] + step:
            gaps[kind].append(elapsed_ms(previous[2], start))
        previous = (block, phase, end)
    return {
        "wall_ms": wall_ms,
        "layers": {k: {"count": len(v), "sum_ms": sum(v), "median_ms": statistics.median(v)} for k, v in spans.items()},
        "gaps_before": {k: {"count": len(v), "sum_ms": sum(v)} for k, v in gaps.items()},
        "wait_ms": sum(elapsed_ms(s, e) for _, s, e in trace.waits),
        "copy_ms": sum(elapsed_ms(s, e) for _, s, e in trace.copies),
        "copy_gb": trace.bytes / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--arms", nargs="+", default=["6GB", "6GB:timed"])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    args = parser.parse_args()
    device = torch.device("cuda")
    model, config = build_model(args.shape, device)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    for arm in args.arms:
        model.to(device)
        strategy = BlockwiseStrategy(vram_budget=None if arm == "none" else arm, budget_tokens=args.seq)
        tracer = TraceLastBatch(len(batches) - 1)
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=len(batches),
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[tracer],
        )  # fmt: skip
        trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
        plan = strategy.residency_plan
        row = {
            "shape": args.shape, "seq": args.seq, "arm": arm, "device": torch.cuda.get_device_name(),
            "resident": len(plan.resident), "kept": len(plan.kept),
            "streamed_kept": len(set(plan.kept) - set(plan.resident)), **tracer.result,
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
