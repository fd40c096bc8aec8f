"""Long context: step time and memory with the long-context options off and on, side by side in one process.

Random-init NF4 models of the Qwen2.5 shapes (`step_benchmark.SHAPES`), LoRA r=16 on all seven
projections, bf16-mixed, batch 1, AdamW, trained through `Trainer.fit`. Arms (names joined by `+`):

- `resident`: `strategy="auto"`, no gradient checkpointing (the compute floor a user with the memory would run);
- `resident_ckpt`: `strategy="auto"` with Hugging Face gradient checkpointing;
- `blockwise`: `BlockwiseStrategy(offload_activations=False)`, default options otherwise;
- `+offload`: `offload_activations=True` (layer inputs in pinned host memory);
- `+chunked`: the module's loss is `chunked_causal_lm_loss(chunk_tokens=1024)` instead of Hugging Face's;
- `+tiled`: the module tiles its MLPs (`tile_mlps(model, 4096)`);
- `+tiledattn`: the module tiles its attention (`tile_attention(model, 16384)`: 16384 queries at a time);
- `+k2`: `input_checkpoint_every=2` (one layer input kept in two, the other layer replayed from it in the backward:
  half the layer inputs' memory, a third forward of every other layer);
- `+liger`: Liger-Kernel's RMSNorm, RoPE and SwiGLU (`use_liger_kernels(model)`, taken off after the arm); with
  `+tiled` the MLPs keep the tiled forward and Liger's RMSNorm and RoPE go on (`swiglu=False`).

Each arm prints a JSON line: median s/step over the measured steps (after `--warmup`), tokens/s, peak
allocated and reserved GB over the measured steps, host-to-device and device-to-host GB per step
(weights and layer inputs), host GB pinned (arena + offload slabs), the plan's predicted peak.

    python -m benchmarks.long_context grid --points 7b:16384 --arms blockwise blockwise+offload+chunked
    python -m benchmarks.long_context card --path /tmp/ckpt-72b --seq 32768 --cap-gib 22
    python -m benchmarks.long_context card --random-init 123b --seq 8192 --cap-gib 22
    python -m benchmarks.long_context card --random-init 7b --seq 262144 --cap-gib 22 \
        --arm blockwise+offload+chunked+tiled+tiledattn+liger

`--vram-budget` gives the blockwise arms a budget (the allocator's cap during their run).
`card` caps the caching allocator from the process start (`set_per_process_memory_fraction`),
loads the checkpoint with `load_blockwise` (or, with `--random-init SHAPE`, builds a random base of that shape
with `random_blockwise`, printing the build's seconds, host GB pinned and device peak first) and trains with
`--arm` (default: every long-context option on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.kernels.liger import unuse_liger_kernels, use_liger_kernels
from lightning_blockwise.longcontext.attention import tile_attention, untile_attention
from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from lightning_blockwise.longcontext.tiling import tile_mlps, untile

CHUNK = 1024
TILE = 4096
ATTENTION_TILE = 16384


class LongModule(pl.LightningModule):
    """Trains ``model`` on random tokens with Hugging Face's loss or the chunked one, its tilings declared."""

    def __init__(
        self,
        model: nn.Module,
        loss_chunk_tokens: int | None,
        mlp_tile_tokens: int | None,
        attention_tile_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.loss_chunk_tokens = loss_chunk_tokens
        self.mlp_tile_tokens = mlp_tile_tokens
        self.attention_tile_tokens = attention_tile_tokens
        if mlp_tile_tokens is not None:
            tile_mlps(model, mlp_tile_tokens)
        else:
            for layer in find_decoder_stack(model, allow_unvalidated=True).layers:
                untile(layer.mlp)
        # The model is shared by the arms: each sets or takes off its own attention tiling.
        if attention_tile_tokens is not None:
            tile_attention(model, attention_tile_tokens)
        else:
            untile_attention(model)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.loss_chunk_tokens is None:
            return self.model(**batch).loss
        return chunked_causal_lm_loss(self.model, chunk_tokens=self.loss_chunk_tokens, **batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-5)


class Meter(pl.Callback):
    """Per-step wall time, traffic, and the peaks over the steps after the warm-up."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.h2d: list[int] = []
        self.d2h: list[int] = []
        self.offload_host_bytes = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        if idx == self.warmup:
            torch.cuda.reset_peak_memory_stats()
        for source in _traffic_sources(trainer):
            source.reset_stats()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        torch.cuda.synchronize()
        if args[-1] < self.warmup:
            return
        self.times.append(time.perf_counter() - self._start)
        strategy = trainer.strategy
        streamer = getattr(strategy, "streamer", None)
        offload = getattr(strategy, "activation_offload", None)
        h2d = streamer.stats.bytes if streamer is not None else 0
        self.h2d.append(h2d + (offload.stats.host_to_device_bytes if offload is not None else 0))
        self.d2h.append(offload.stats.device_to_host_bytes if offload is not None else 0)
        # Read during the run: teardown frees the slabs.
        self.offload_host_bytes = max(self.offload_host_bytes, offload.host_bytes if offload is not None else 0)


def _traffic_sources(trainer: pl.Trainer) -> list[Any]:
    strategy = trainer.strategy
    return [s for s in (getattr(strategy, "streamer", None), getattr(strategy, "activation_offload", None)) if s]


def run_arm(
    model: nn.Module, arm: str, seq: int, steps: int, warmup: int, vocab: int, det: bool, budget: str | None = None
) -> dict[str, Any]:
    parts = arm.split("+")
    chunk = CHUNK if "chunked" in parts else None
    tile = TILE if "tiled" in parts else None
    attention_tile = ATTENTION_TILE if "tiledattn" in parts else None
    if parts[0] == "resident_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        strategy: Any = "auto"
    elif parts[0] == "resident":
        strategy = "auto"
    else:
        every = 2 if "k2" in parts else None
        strategy = BlockwiseStrategy(
            offload_activations="offload" in parts, vram_budget=budget, input_checkpoint_every=every
        )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (warmup + steps, 1, seq), generator=gen)
    batches = [{"input_ids": ids, "labels": ids} for ids in tokens]
    meter = Meter(warmup)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[meter], deterministic=det,
    )  # fmt: skip
    row: dict[str, Any] = {"oom": False}
    module = LongModule(model, chunk, tile, attention_tile)
    if "liger" in parts:
        # After the module tiles or untiles the MLPs: a tiled MLP keeps its forward (Liger refuses to replace it).
        use_liger_kernels(model, swiglu=tile is None)
    try:
        trainer.fit(module, DataLoader(batches, batch_size=None))
    except torch.OutOfMemoryError as error:
        row.update(oom=True, error=str(error).splitlines()[0], segments=_segments())
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    if meter.times:
        median = statistics.median(meter.times)
        row.update(
            s_per_step=median, tokens_per_s=seq / median, h2d_gb_per_step=statistics.median(meter.h2d) / 1e9,
            d2h_gb_per_step=statistics.median(meter.d2h) / 1e9,
        )  # fmt: skip
    if isinstance(strategy, BlockwiseStrategy) and strategy.step_plan is not None:
        copy = strategy.host_copy
        row["host_pinned_gb"] = ((copy.arena.nbytes if copy else 0) + meter.offload_host_bytes) / 1e9
        row["predicted_peak_gb"] = strategy.step_plan.residency.predicted_peak / 1e9
        row["offload"] = strategy.step_plan.offload
        row["input_checkpoint_every"] = strategy.step_plan.shape.checkpoint_every
        row["over_card"] = strategy.step_plan.over_card
        row["resident_blocks"] = len(strategy.step_plan.residency.resident)
        row["predicted_reserved_gb"] = strategy.step_plan.residency.predicted_reserved / 1e9
    if parts[0] == "resident_ckpt":
        model.gradient_checkpointing_disable()
    unuse_liger_kernels(model)  # the model is shared by the arms
    torch.cuda.empty_cache()
    return row


def _segments() -> dict[str, dict[str, float]]:
    """The allocator's segments by kind (expandable or not): count, GB mapped, GB allocated."""
    kinds: dict[str, dict[str, float]] = {}
    for segment in torch.cuda.memory_snapshot():
        kind = kinds.setdefault(
            "expandable" if segment.get("is_expandable") else "fixed", {"count": 0, "gb": 0.0, "allocated_gb": 0.0}
        )
        kind["count"] += 1
        kind["gb"] += segment["total_size"] / 1e9
        kind["allocated_gb"] += segment["allocated_size"] / 1e9
    return kinds


def grid(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    mode = "deterministic" if args.deterministic else "default"
    for point in args.points:
        shape, seq = point.split(":")
        torch.manual_seed(0)
        config = SHAPES[shape]()
        model = get_peft_model(_random_model(config, device), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
        for arm in args.arms:
            model.to(device)  # a blockwise run leaves the base in host memory
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row = run_arm(
                model, arm, int(seq), args.steps, args.warmup, config.vocab_size, args.deterministic, args.vram_budget
            )
            row["vram_budget"] = args.vram_budget
            _emit({"shape": shape, "seq": int(seq), "arm": arm, "mode": mode, **row}, args.out)
        del model
        torch.cuda.empty_cache()


def card(args: argparse.Namespace) -> None:
    from lightning_blockwise.loading.load import load_blockwise
    from lightning_blockwise.loading.random_base import random_blockwise
    from lightning_blockwise.residency.placement import host_copy_of

    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    cap = args.cap_gib * 2**30
    torch.cuda.set_per_process_memory_fraction(cap / total, device)  # before anything is allocated
    start = time.perf_counter()
    if args.random_init is None:
        model = load_blockwise(args.path, compute_dtype=torch.bfloat16, progress=False)
        built = {"load_s": time.perf_counter() - start}
    else:
        # Layer by layer into the host arena under the cap: the whole base never is on the card.
        model = random_blockwise(SHAPES[args.random_init](), seed=0, compute_dtype=torch.bfloat16, progress=False)
        copy = host_copy_of(model)
        built = {"shape": args.random_init, "build_s": time.perf_counter() - start}
        built |= {"build_pinned_gb": copy.arena.nbytes / 1e9 if copy.arena.pinned else 0.0}
        built |= {"build_peak_gb": torch.cuda.max_memory_allocated(device) / 1e9}
        print(json.dumps(built), flush=True)  # before training, which may not fit
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    row = run_arm(model, args.arm, args.seq, args.steps, args.warmup, model.config.vocab_size, False)
    _emit({"card_gib": args.cap_gib, "seq": args.seq, **built, "cap_gb": cap / 1e9, **row}, args.out)


def _random_model(config: Any, device: torch.device) -> nn.Module:
    from lightning_blockwise.recipes.random_init import random_nf4_model

    return random_nf4_model(config, device)


def _emit(row: dict[str, Any], out: str | None) -> None:
    row["device"] = torch.cuda.get_device_name()
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    g = commands.add_parser("grid")
    g.add_argument("--points", nargs="+", default=["7b:16384"], help="SHAPE:SEQ, e.g. 72b:16384")
    g.add_argument("--arms", nargs="+", default=["blockwise", "blockwise+offload+chunked"])
    g.add_argument("--deterministic", action="store_true")
    g.add_argument("--vram-budget", default=None, help="the blockwise arms' vram_budget, e.g. 8.5GiB")
    c = commands.add_parser("card")
    base = c.add_mutually_exclusive_group(required=True)
    base.add_argument("--path", help="a checkpoint directory, loaded with load_blockwise")
    base.add_argument(
        "--random-init",
        choices=sorted(SHAPES),
        help="instead of --path: a random base of this shape (random_blockwise)",
    )
    c.add_argument("--seq", type=int, default=32768)
    c.add_argument("--cap-gib", type=float, default=22.0)
    c.add_argument("--arm", default="blockwise+offload+chunked+tiled")
    for sub in (g, c):
        sub.add_argument("--steps", type=int, default=3)
        sub.add_argument("--warmup", type=int, default=1)
        sub.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args()
    if getattr(args, "deterministic", False) and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        parser.error("--deterministic needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
    grid(args) if args.command == "grid" else card(args)


if __name__ == "__main__":
    main()
