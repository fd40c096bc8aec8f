"""Training-step time and peak VRAM: resident against blockwise, side by side in one process.

Builds a random-init NF4 model of a real shape directly on the GPU, layer by layer (the bf16
model never exists whole), adds LoRA r=16 on q,k,v,o,gate,up,down, and trains it through
`Trainer.fit` (bf16-mixed, seq 512, batch 1, AdamW) in each arm: resident without
checkpointing, resident with Hugging Face gradient checkpointing, and blockwise streaming.
Reports the median step time after warm-up, `torch.cuda.max_memory_allocated` over the
measured steps (reset after warm-up), and host-to-device bytes per step.

    python benchmarks/step_benchmark.py --shapes 7b 32b [--deterministic] [--arms ...] [--seq 512]
        [--bases nf4 dense] [--accumulate G]

Bases: `nf4` (default) as above; `dense`, the same shape random-init in bf16 on the GPU with its own
init (nothing quantized; ~2 bytes per parameter: a 32B base is 65 GB on the GPU while it is built,
then the blockwise arms move its layers into a 62 GB pinned host arena), what
`load_blockwise(quantize=False)` gives. With `--accumulate G` each optimizer step takes G
micro-batches (`Trainer(accumulate_grad_batches=G)`): `s_per_step` is then the median optimizer step's
time divided by G, and `h2d_gb_per_step` the bytes of the median optimizer step (whole steps timed).

Arms: `resident` (no checkpointing, the ratio's denominator), `resident_ckpt`, `forward_nograd` (the
resident model's forward under `torch.no_grad`, timed alone: the recompute floor of a fully
rematerialized step is (forward_nograd + resident) / resident), and `blockwise:B:D[:BUDGET[:nokeep]]`
(block size, prefetch depth, `vram_budget`; `nokeep` sets `keep_activations=False`). A `+liger` suffix
(`resident+liger`, `blockwise:1:2+liger`) runs the arm with `use_liger_kernels(model)` on, taken off after it.
Arms named `...:timed` in
older results ran the removed `timed_plan=True`; arms named `...:fixed` are the plan every run makes now.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.architectures import LLAMA_STYLE_PROJECTIONS
from lightning_blockwise.kernels.liger import unuse_liger_kernels, use_liger_kernels
from lightning_blockwise.recipes.random_init import random_nf4_model

#: The frozen bases a shape can be built as: NF4 with double quantization, or dense bf16.
BASES = ("nf4", "dense")

SHAPES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "7b": lambda: transformers.Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "32b": lambda: transformers.Qwen2Config(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    "72b": lambda: transformers.Qwen2Config(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    # Mistral-Large-2 (123B): its NF4 base is ~68 GB; build it with `random_blockwise` (host arena), not on a GPU.
    "123b": lambda: transformers.MistralConfig(
        vocab_size=32768, hidden_size=12288, intermediate_size=28672, num_hidden_layers=88,
        num_attention_heads=96, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
    ),
}  # fmt: skip
#: Arms run by default; `blockwise:B:D[:BUDGET]` is BlockwiseStrategy(block_size=B, prefetch_depth=D,
#: vram_budget=BUDGET), e.g. `blockwise:1:2:6GB`.
DEFAULT_ARMS = ["resident", "resident_ckpt", "blockwise:1:2", "blockwise:2:2"]
TARGETS = list(LLAMA_STYLE_PROJECTIONS)


class BenchModule(pl.LightningModule):
    """Trains ``model`` on random tokens; the model is built once and shared by the arms."""

    def __init__(self, model: nn.Module, lr: float = 1e-5) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class StepTimer(pl.Callback):
    """Wall time (synchronized) and host-to-device bytes of each group of ``group`` batches, and the peak after warm-up.

    ``group=1`` times every batch; ``group=accumulate_grad_batches`` times whole optimizer steps (a window of
    micro-batches, from its first batch's start to its last batch's end, the copies issued for any of them counted).

    Args:
        warmup: Batches of warm-up, a multiple of ``group``.
        group: Batches timed together.
    """

    def __init__(self, warmup: int, group: int = 1) -> None:
        self.warmup, self.group = warmup, group
        self.times: list[float] = []
        self.h2d_bytes: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx % self.group:
            return
        torch.cuda.synchronize()
        if idx == self.warmup:
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.reset_accumulated_memory_stats()
        streamer = getattr(trainer.strategy, "streamer", None)
        if streamer is not None:
            streamer.reset_stats()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        idx = args[-1]
        if (idx + 1) % self.group or idx < self.warmup:
            return
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)
        streamer = getattr(trainer.strategy, "streamer", None)
        self.h2d_bytes.append(streamer.stats.bytes if streamer is not None else 0)


def build_model(shape: str, device: torch.device, base: str = "nf4") -> tuple[nn.Module, transformers.PretrainedConfig]:
    """The benchmark's model: random-init ``base`` of ``shape`` (seed 0) with LoRA r=16 on the seven projections."""
    torch.manual_seed(0)
    config = SHAPES[shape]()
    if base == "dense":
        # The model's own init, on the device: what a bf16 checkpoint loads as, without a checkpoint on disk.
        with torch.device(device):
            frozen = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    else:
        frozen = random_nf4_model(config, device)
    model = get_peft_model(frozen, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    return model, config


def forward_nograd(model: nn.Module, steps: int, warmup: int, vocab: int, seq: int) -> dict[str, float]:
    """The resident decoder's forward under ``torch.no_grad`` (bf16 autocast), median seconds over ``steps``."""
    decoder = model.get_base_model().get_decoder()
    gen = torch.Generator().manual_seed(0)
    times = []
    model.train()
    for index in range(warmup + steps):
        ids = torch.randint(0, vocab, (1, seq), generator=gen).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            # The decoder alone: what a rematerialized step runs a second time (the head and loss are not recomputed).
            decoder(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"s_per_step": median, "peak_gb": 0.0, "tokens_per_s": seq / median, "h2d_gb_per_step": 0.0,
            "h2d_gb_per_s": 0.0}  # fmt: skip


def run_arm(
    model: nn.Module,
    arm: str,
    steps: int,
    warmup: int,
    vocab: int,
    deterministic: bool,
    seq: int = 512,
    accumulate: int = 1,
) -> dict[str, float]:
    base_arm, *options = arm.split("+")
    if options == ["liger"]:
        # Liger-Kernel's layers for this arm only (the model is shared by the arms), resident and blockwise alike.
        use_liger_kernels(model)
        try:
            return run_arm(model, base_arm, steps, warmup, vocab, deterministic, seq, accumulate)
        finally:
            unuse_liger_kernels(model)
    if options:
        raise SystemExit(f"arm {arm!r}: the one option an arm takes is +liger")
    if arm == "forward_nograd":
        return forward_nograd(model, steps, warmup, vocab, seq)
    if arm == "resident_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range((warmup + steps) * accumulate):
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    timer = StepTimer(warmup * accumulate, group=accumulate)
    strategy: Any = "auto"
    if arm.startswith("blockwise"):
        _, block_size, prefetch_depth, *budget = arm.split(":")
        strategy = BlockwiseStrategy(
            block_size=int(block_size), prefetch_depth=int(prefetch_depth), vram_budget=budget[0] if budget else None,
            budget_tokens=seq, keep_activations="nokeep" not in budget,
        )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], deterministic=deterministic, accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
    if isinstance(strategy, BlockwiseStrategy):
        copy = strategy.host_copy
        assert copy is not None
        plan = strategy.residency_plan
        assert plan is not None
        print(f"host arena: {copy.arena.nbytes} B allocated, {copy.arena.bytes_needed} B needed, pinned:"
              f" {copy.arena.storage.is_pinned()}; resident blocks {len(plan.resident)}, kept {len(plan.kept)};"
              " predicted peak"
              f" {plan.predicted_peak / 1e9:.2f} GB", flush=True)  # fmt: skip
    peak = torch.cuda.max_memory_allocated() / 1e9
    # The allocator's frees-and-retries at its cap (a budget's cap): each one releases cached memory and maps again.
    stats = torch.cuda.memory_stats()
    reserved, retries = torch.cuda.max_memory_reserved() / 1e9, stats.get("num_alloc_retries", 0)
    if arm == "resident_ckpt":
        model.gradient_checkpointing_disable()
    torch.cuda.empty_cache()
    # Whole optimizer steps are timed (micro-batches of one differ: the last steps the optimizer); per micro-batch.
    median = statistics.median(timer.times) / accumulate
    h2d = statistics.median(timer.h2d_bytes) / 1e9
    row = {
        "s_per_step": median, "peak_gb": peak, "tokens_per_s": seq / median,
        "h2d_gb_per_step": h2d, "h2d_gb_per_s": h2d / (median * accumulate),
        "peak_reserved_gb": reserved, "alloc_retries": retries,
    }  # fmt: skip
    if isinstance(strategy, BlockwiseStrategy) and strategy.residency_plan is not None:
        plan = strategy.residency_plan
        row.update(
            resident_blocks=len(plan.resident), kept_blocks=len(plan.kept),
            streamed_kept_blocks=len(set(plan.kept) - set(plan.resident)),
        )  # fmt: skip
    return row


def report_out_of_memory(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """At an out-of-memory, before anything is freed: the request and the allocator's segments (an OOM observer)."""
    report = {"request_gb": alloc / 1e9, "device_free_gb": device_free / 1e9, **segment_report()}
    print(f"out of memory: {json.dumps(report)}", flush=True)


def segment_report() -> dict[str, Any]:
    """The caching allocator's segments by stream and kind, GB reserved and allocated."""
    groups: dict[str, dict[str, float]] = {}
    for segment in torch.cuda.memory_snapshot():
        expandable = " expandable" * bool(segment.get("is_expandable"))
        key = f"stream {segment['stream']} {segment['segment_type']}{expandable}"
        group = groups.setdefault(key, {"segments": 0, "reserved_gb": 0.0, "allocated_gb": 0.0})
        group["segments"] += 1
        group["reserved_gb"] += segment["total_size"] / 1e9
        group["allocated_gb"] += segment["allocated_size"] / 1e9
    stats = torch.cuda.memory_stats()
    return {
        "allocated_gb": stats.get("allocated_bytes.all.current", 0) / 1e9,
        "reserved_gb": stats.get("reserved_bytes.all.current", 0) / 1e9,
        "segments": {key: {k: round(v, 3) for k, v in group.items()} for key, group in groups.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["7b"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, help="resident, blockwise:B:D, ...[+liger]")
    parser.add_argument("--bases", nargs="+", default=["nf4"], choices=BASES, help="frozen bases to build (nf4)")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (1)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.accumulate < 1:
        parser.error(f"--accumulate {args.accumulate} must be at least 1")
    if args.deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        parser.error("--deterministic needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (cuBLAS reads it once)")
    device = torch.device("cuda")
    torch._C._cuda_attach_out_of_memory_observer(report_out_of_memory)
    mode = "deterministic" if args.deterministic else "default"
    rows = []
    for shape in args.shapes:
        for base in args.bases:
            model, config = build_model(shape, device, base)
            for arm in args.arms:
                model.to(device)  # a blockwise run leaves the base in host memory, as its teardown moves the module
                result = run_arm(
                    model, arm, args.steps, args.warmup, config.vocab_size, args.deterministic, args.seq,
                    args.accumulate,
                )  # fmt: skip
                rows.append({"shape": shape, "base": base, "seq": args.seq, "accumulate": args.accumulate,
                             "mode": mode, "arm": arm, **result})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del model
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | mode {mode}")
    per = "micro-batch" if args.accumulate > 1 else "step"
    print(f"| shape | base | arm | s/{per} | tokens/s | peak GB | H2D GB/step | H2D GB/s | vs resident (no ckpt) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        same = [r for r in rows if r["shape"] == row["shape"] and r["base"] == row["base"]]
        ref = next((r for r in same if r["arm"] == "resident"), row)
        print(
            f"| {row['shape']} | {row['base']} | {row['arm']} | {row['s_per_step']:.3f} | {row['tokens_per_s']:.0f} |"
            f" {row['peak_gb']:.2f} | {row['h2d_gb_per_step']:.2f} | {row['h2d_gb_per_s']:.1f} |"
            f" {row['s_per_step'] / ref['s_per_step']:.2f}x |"
        )
        if row["arm"] == "forward_nograd" and ref is not row:
            floor = (row["s_per_step"] + ref["s_per_step"]) / ref["s_per_step"]
            print(f"| {row['shape']} | {row['base']} | recompute floor | | | | | | {floor:.2f}x |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
