"""Sample packing: training tokens/s with and without packing, through the data module and the blockwise strategy.

A random-init NF4 model of the Qwen2.5-7B shape (`step_benchmark.SHAPES`), LoRA r=16 on all seven
projections, bf16-mixed, AdamW, `BlockwiseStrategy(vram_budget=None)` (every block streamed), trained through
`Trainer.fit` on `InstructionDataModule` (byte-level tokenizer: one token per character). The data:
`--examples` instruction records whose lengths in tokens are drawn from a lognormal distribution
(median `--median`, shape `--sigma`), clipped to [`--min-len`, `--max-len`], with a fixed seed; a
third of each is the instruction (not trained on), the rest the output. Arms:

- `padded:B`: B examples per batch, right-padded to the longest (an attention mask);
- `packed:B`: B rows per batch, each packed with examples up to `--max-length` tokens (position ids).

Each arm prints a JSON line: median s/step, real (non-padding) tokens/s and trained tokens/s over the
measured steps (after `--warmup`), the padding fraction, peak allocated GB, and each measured step's
time and token slots (batch x length, padding included).

    python -m benchmarks.packing_throughput --arms padded:1 padded:4 packed:1
    python -m benchmarks.packing_throughput --tiny   # a tiny model on the CPU: checks the script, measures nothing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn

from benchmarks.step_benchmark import SHAPES, TARGETS, BenchModule
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.data import IGNORE_INDEX, InstructionDataModule
from lightning_blockwise.recipes.random_init import random_nf4_model

#: Characters of the random texts: one byte-level token each, never the padding id.
_ALPHABET = "abcdefghijklmnopqrstuvwxyz      .,"


def example_lengths(count: int, median: float, sigma: float, low: int, high: int, seed: int) -> list[int]:
    """``count`` lengths from a lognormal of median ``median`` and shape ``sigma``, clipped to ``[low, high]``."""
    rng = random.Random(seed)
    return [min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(count)]


def write_records(path: Path, lengths: list[int], seed: int) -> Path:
    """Instruction records of random text, a third of each length the instruction, the rest the output (JSONL)."""
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for length in lengths:
            text = "".join(rng.choices(_ALPHABET, k=length))
            cut = max(1, length // 3)
            f.write(json.dumps({"instruction": text[:cut], "output": text[cut:]}) + "\n")
    return path


class TokenMeter(pl.Callback):
    """Per-step wall time and token counts after the warm-up; peak memory over the measured steps."""

    def __init__(self, warmup: int, pad_id: int) -> None:
        self.warmup = warmup
        self.pad_id = pad_id
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.trained: list[int] = []
        self.slots: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        _synchronize()
        if idx == self.warmup and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, out: Any, batch: Any, idx: int):
        _synchronize()
        if idx < self.warmup:
            return
        self.times.append(time.perf_counter() - self._start)
        ids = batch["input_ids"]
        # The byte-level tokenizer's padding id never occurs in text, so it counts the padding in either arm.
        self.tokens.append(int((ids != self.pad_id).sum()))
        self.trained.append(int((batch["labels"] != IGNORE_INDEX).sum()))
        self.slots.append(ids.numel())


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_arm(model: nn.Module, arm: str, records: Path, args: argparse.Namespace) -> dict[str, Any]:
    kind, batch_size = arm.split(":")
    if kind not in ("padded", "packed"):
        raise SystemExit(f"arm {arm!r}: use padded:B or packed:B")
    data = InstructionDataModule(
        str(records), max_length=args.max_length, batch_size=int(batch_size), val_fraction=0.0,
        seed=args.seed, packing=kind == "packed",
    )  # fmt: skip
    meter = TokenMeter(args.warmup, data.tokenizer.pad_token_id)
    trainer = pl.Trainer(
        accelerator="cpu" if args.tiny else "gpu", devices=1, strategy=BlockwiseStrategy(vram_budget=None),
        precision="32-true" if args.tiny else "bf16-mixed", max_steps=args.warmup + args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[meter],
        deterministic=args.deterministic, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(BenchModule(model), datamodule=data)
    total = sum(meter.times)
    row = {
        "arm": arm, "max_length": args.max_length, "s_per_step": statistics.median(meter.times),
        "tokens_per_s": sum(meter.tokens) / total, "trained_tokens_per_s": sum(meter.trained) / total,
        "tokens_per_step": sum(meter.tokens) / len(meter.tokens),
        "padding_fraction": 1 - sum(meter.tokens) / sum(meter.slots), "steps": len(meter.times),
        "step_s": [round(t, 4) for t in meter.times], "step_slots": meter.slots,
    }  # fmt: skip
    if torch.cuda.is_available():
        row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.empty_cache()
    return row


def _model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)
    if args.tiny:
        config = transformers.Qwen2Config(
            vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
        )  # fmt: skip
        base = random_nf4_model(config, "cpu", compute_dtype=torch.float32)
    else:
        base = random_nf4_model(SHAPES[args.shape](), torch.device("cuda"))
    return get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--arms", nargs="+", default=["padded:1", "padded:4", "packed:1"], help="padded:B, packed:B")
    parser.add_argument("--max-length", type=int, default=4096, help="longest example, and packed row, in tokens")
    parser.add_argument("--examples", type=int, default=4000)
    parser.add_argument("--median", type=float, default=512.0, help="median example length in tokens")
    parser.add_argument("--sigma", type=float, default=0.9, help="shape of the lognormal lengths")
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=4000, help="longest drawn length (the prompt adds ~40)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU and short examples")
    parser.add_argument("--workdir", default="/tmp/packing_throughput", help="where the generated JSONL goes")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.max_length, args.median, args.min_len, args.max_len = 256, 40.0, 4, 200
        args.examples = min(args.examples, 200)
    if args.deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        parser.error("--deterministic needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lengths = example_lengths(args.examples, args.median, args.sigma, args.min_len, args.max_len, args.seed)
    records = write_records(workdir / "records.jsonl", lengths, args.seed)
    model = _model(args)
    device = "cpu" if args.tiny else torch.cuda.get_device_name()
    mode = "deterministic" if args.deterministic else "default"
    shape = "tiny" if args.tiny else args.shape
    rows = []
    for arm in args.arms:
        if not args.tiny:
            model.to("cuda")  # a blockwise run leaves the base in host memory
        row = {"shape": shape, "mode": mode, **run_arm(model, arm, records, args), "device": device}
        row["length_median"], row["length_mean"] = statistics.median(lengths), statistics.fmean(lengths)
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
