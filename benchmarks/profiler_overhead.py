"""What `BlockwiseProfiler` costs: the same blockwise fit with and without it, step times side by side.

Builds a random-init NF4 model of a real shape (`random_nf4_model` from step_benchmark.py), LoRA r=16 on
q,k,v,o,gate,up,down, and fits it with `BlockwiseStrategy` (bf16-mixed, batch 1, AdamW) in two arms
that differ only in the profiler: both log to a CSVLogger every `--log-every` steps. Arms alternate
(`off`, `on`, `off`, `on`, ...; `--profiled-first` swaps them) to spread drift. Two step times per
arm (medians over the repeats): the wall time of the steps after the warm-up divided by their
number, synchronized only at both ends (a per-step synchronize would hide the lazy event reads the
profiler relies on), and the median interval between batch starts, which a few slow steps do not
move. The target is an overhead below 2% at `--log-every 50`.

Separate fits differ by more than the profiler costs (3-12% between processes on the H100, and a
second fit in a process runs slower than the first), so `--interleave W` compares inside one fit
instead: the same profiler is driven for alternate windows of W steps and detached (a no-op
stream observer, no hooks) for the others, and the step intervals of the two kinds of window are
compared. Both kinds share the fit's drift; the profiler's logged steps keep their frequency
(every `--log-every` steps, half of them in profiled windows, which are half the steps).

    python -m benchmarks.profiler_overhead --shape 7b [--steps 100] [--warmup 5] [--log-every 50] [--repeats 2]
        [--profile-dir DIR]
    python -m benchmarks.profiler_overhead --shape 7b --interleave 10 --steps 200 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.step_benchmark import SHAPES, TARGETS, BenchModule
from lightning_blockwise import BlockwiseProfiler, BlockwiseStrategy
from lightning_blockwise.recipes.random_init import random_nf4_model


class Throughput(pl.Callback):
    """Step time after ``warmup``: the mean, synchronized only at both ends, and the median host interval."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.s_per_step = float("nan")
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            torch.cuda.synchronize()
            self._start = time.perf_counter()
        if idx >= self.warmup:
            self.starts.append(time.perf_counter())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.s_per_step = (time.perf_counter() - self._start) / (trainer.global_step - self.warmup)

    @property
    def median_interval(self) -> float:
        """Median time between consecutive batch starts: robust to a few slow steps, no synchronize."""
        return statistics.median(b - a for a, b in zip(self.starts, self.starts[1:], strict=False))


def _batches(args: argparse.Namespace, vocab: int) -> list[dict[str, torch.Tensor]]:
    """The same random rows for every arm: warm-up plus measured steps, batch 1."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (1, args.seq), generator=gen)
        rows.append({"input_ids": ids, "labels": ids})
    return rows


class Interleaved(pl.Callback):
    """Drives ``profiler`` in alternate windows of ``window`` steps after ``warmup``; records every step's interval.

    Off windows detach it completely: its hooks are not called and the streamer gets a no-op
    observer, so they cost what a run without the profiler costs.
    """

    def __init__(self, profiler: BlockwiseProfiler, window: int, warmup: int, profiled_first: bool) -> None:
        self.profiler, self.window, self.warmup, self.profiled_first = profiler, window, warmup, profiled_first
        self.starts: list[float] = []
        self.profiled: list[bool] = []

    def _profiled(self, idx: int) -> bool:
        return idx >= self.warmup and (((idx - self.warmup) // self.window) % 2 == 0) == self.profiled_first

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.on_train_start(trainer, pl_module)
        self.observer = trainer.strategy.observer  # the profiler's, set once; off windows swap it out

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.starts.append(time.perf_counter())
        self.profiled.append(self._profiled(idx))
        trainer.strategy.set_observer(self.observer if self.profiled[-1] else None)
        if self.profiled[-1]:
            self.profiler.on_train_batch_start(trainer, pl_module, batch, idx)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.profiled[-1]:
            self.profiler.on_train_batch_end(trainer, pl_module, *args)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.starts.append(time.perf_counter())  # closes the last step's interval
        self.profiler.on_train_end(trainer, pl_module)

    def intervals(self, profiled: bool) -> list[float]:
        """Intervals of the measured steps of one kind of window, the first step of each window left out."""
        steps = range(self.warmup, len(self.profiled))
        return [
            self.starts[i + 1] - self.starts[i]
            for i in steps
            if self.profiled[i] == profiled and (i - self.warmup) % self.window != 0
        ]


def run_interleaved(model: nn.Module, args: argparse.Namespace, vocab: int, root: str, first: bool) -> dict[str, Any]:
    batches = _batches(args, vocab)
    driver = Interleaved(BlockwiseProfiler(dirpath=root), args.interleave, args.warmup, profiled_first=first)
    strategy = BlockwiseStrategy(
        vram_budget=None, block_size=args.block_size, prefetch_depth=args.prefetch_depth, budget_tokens=args.seq
    )
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=args.warmup + args.steps,
        logger=CSVLogger(root, name="interleaved"), log_every_n_steps=args.log_every, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[driver],
    )  # fmt: skip
    trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
    torch.cuda.empty_cache()
    on, off = driver.intervals(True), driver.intervals(False)
    return {
        "profiled_first": first,
        "window": args.interleave,
        "steps_on": len(on),
        "steps_off": len(off),
        "mean_on_s": statistics.fmean(on),
        "mean_off_s": statistics.fmean(off),
        "median_on_s": statistics.median(on),
        "median_off_s": statistics.median(off),
        "mean_overhead_pct": (statistics.fmean(on) / statistics.fmean(off) - 1) * 100,
        "median_overhead_pct": (statistics.median(on) / statistics.median(off) - 1) * 100,
        "logged_steps_profiled": driver.profiler.summary.get("batches"),
    }


def run_arm(model: nn.Module, profiled: bool, args: argparse.Namespace, vocab: int, root: str) -> dict[str, Any]:
    batches = _batches(args, vocab)
    throughput = Throughput(args.warmup)
    callbacks: list[pl.Callback] = [throughput]
    # The timeline is drawn after the fit, outside the timed window.
    profiler = BlockwiseProfiler(timeline=True, dirpath=args.profile_dir or root) if profiled else None
    if profiler is not None:
        callbacks.append(profiler)
    strategy = BlockwiseStrategy(
        vram_budget=None, block_size=args.block_size, prefetch_depth=args.prefetch_depth, budget_tokens=args.seq
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=args.warmup + args.steps,
        logger=CSVLogger(root, name="profiler" if profiled else "plain"), log_every_n_steps=args.log_every,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
    torch.cuda.empty_cache()
    row: dict[str, Any] = {
        "arm": "on" if profiled else "off",
        "s_per_step": throughput.s_per_step,
        "median_interval_s": throughput.median_interval,
    }
    if profiler is not None:
        row["profiler_summary"] = profiler.summary
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=100, help="measured steps per arm")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--log-every", type=int, default=50, help="the Trainer's log_every_n_steps")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternating")
    parser.add_argument("--profiled-first", action="store_true", help="alternate on, off, ... instead of off, on")
    parser.add_argument(
        "--only", choices=["on", "off"], default=None, help="run one arm (one per process avoids order effects)"
    )
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=1)
    parser.add_argument("--prefetch-depth", type=int, default=2)
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="compare inside one fit: profiled in alternate windows of this many steps",
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--profile-dir", default=None, help="where the profiled arm writes its JSON summary and PNG")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = SHAPES[args.shape]()
    model = get_peft_model(random_nf4_model(config, device), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    rows = []
    if args.interleave:
        with tempfile.TemporaryDirectory() as root:
            for repeat in range(args.repeats):
                model.to(device)
                row = run_interleaved(model, args, config.vocab_size, root, first=repeat % 2 == 1)
                rows.append({"shape": args.shape, "repeat": repeat, **row})
                print(json.dumps(rows[-1]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.shape}, seq {args.seq}, block_size"
              f" {args.block_size}, prefetch_depth {args.prefetch_depth}, log_every_n_steps {args.log_every},"
              f" windows of {args.interleave} steps")  # fmt: skip
        print(
            "| fit | profiled first | steps on / off | mean on / off, s | median on / off, s | overhead mean | median |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['repeat']} | {r['profiled_first']} | {r['steps_on']} / {r['steps_off']} |"
                  f" {r['mean_on_s']:.4f} / {r['mean_off_s']:.4f} | {r['median_on_s']:.4f} / {r['median_off_s']:.4f} |"
                  f" {r['mean_overhead_pct']:+.2f}% | {r['median_overhead_pct']:+.2f}% |")  # fmt: skip
        return
    with tempfile.TemporaryDirectory() as root:
        for repeat in range(args.repeats):
            order = (True, False) if args.profiled_first else (False, True)
            for profiled in order if args.only is None else (args.only == "on",):
                model.to(device)  # a blockwise run leaves the base in host memory, as its teardown moves the module
                row = {"shape": args.shape, "repeat": repeat, **run_arm(model, profiled, args, config.vocab_size, root)}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "profiler_summary"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    if args.only is not None:
        return  # one arm: compare the JSON rows of two processes
    off = statistics.median(r["s_per_step"] for r in rows if r["arm"] == "off")
    on = statistics.median(r["s_per_step"] for r in rows if r["arm"] == "on")
    off_median = statistics.median(r["median_interval_s"] for r in rows if r["arm"] == "off")
    on_median = statistics.median(r["median_interval_s"] for r in rows if r["arm"] == "on")
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.shape}, seq {args.seq}, block_size"
          f" {args.block_size}, prefetch_depth {args.prefetch_depth}, log_every_n_steps {args.log_every}")  # fmt: skip
    print("| arm | mean s/step | median step interval, s |")
    print("| --- | --- | --- |")
    print(f"| without profiler | {off:.4f} | {off_median:.4f} |")
    print(f"| with profiler | {on:.4f} | {on_median:.4f} |")
    mean_pct, median_pct = (on / off - 1) * 100, (on_median / off_median - 1) * 100
    print(f"overhead: {mean_pct:+.2f}% mean, {median_pct:+.2f}% median (target < 2%)")


if __name__ == "__main__":
    main()
