"""What is alive at a training step's peak: the live allocations, grouped by where they were made.

Records the caching allocator's history (`torch.cuda.memory._record_memory_history`) over one
step after a warm-up step of a `benchmarks.long_context` arm, replays the allocations and frees to
find the step's peak, and prints the live bytes at that moment by block size, named after the
tensor shapes of that size (tokens x intermediate, chunk x vocab, ...); memory allocated before
the step (the head, adapters, optimizer state) is one line.

    python -m benchmarks.memory_peak --shape 7b --seq 16384 --arm blockwise+offload+chunked
    python -m benchmarks.memory_peak --shape 7b --seq 65536 --arm blockwise+offload+chunked+tiled+liger+fused
    python -m benchmarks.memory_peak --shape 7b --seq 65536 --arm blockwise+offload+chunked+tiled+tiledattn+liger

Arm parts as `benchmarks.long_context`'s: `offload`, `chunked`, `tiled`, `tiledattn`, `+liger` (Liger's RMSNorm and
RoPE, and its SwiGLU when the MLPs are untiled) and `+fused` (`use_fused_lora`). The largest blocks alive at the peak
are listed too (``--largest``), with the label of their size.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader

from benchmarks.long_context import ATTENTION_TILE, CHUNK, TILE, LongModule, _random_model
from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.kernels.fused_lora import use_fused_lora
from lightning_blockwise.kernels.liger import use_liger_kernels


class Recorder(pl.Callback):
    """Records the allocator's history over the training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.snapshot: dict[str, Any] | None = None
        self.before = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        print(f"step {idx}: allocated {torch.cuda.memory_allocated() / 1e9:.3f} GB at its start", flush=True)
        torch.cuda.reset_peak_memory_stats()
        if idx == self.step:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            # No stack frames: capturing Python stacks fails inside checkpoint recomputes (torch 2.11,
            # "cross_entropy_loss returned NULL"), so live blocks are told apart by their sizes.
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        torch.cuda.synchronize()
        print(f"step {args[-1]}: peak allocated {torch.cuda.max_memory_allocated() / 1e9:.3f} GB", flush=True)
        if args[-1] == self.step:
            torch.cuda.synchronize()
            self.snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)


def _place(size: int, shapes: dict[int, str]) -> str:
    # The allocator rounds up to 512 B (and large blocks to 2 MiB): match within that.
    for nbytes, name in shapes.items():
        if nbytes <= size < nbytes + 2 * 2**20:
            return name
    return "other sizes"


def peak_breakdown(
    snapshot: dict[str, Any], before: int, shapes: dict[int, str]
) -> tuple[int, Counter[str], list[int]]:
    """The peak bytes of the recorded span, the live bytes at it by place and the live blocks' sizes, largest first."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = before
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action, addr, size = event["action"], event["addr"], event["size"]
        if action == "alloc":
            live[addr] = (size, _place(size, shapes))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    places: Counter[str] = Counter({"allocated before the step": before})
    for size, place in at_peak.values():
        places[place] += size
    return peak, places, sorted((size for size, _ in at_peak.values()), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--arm", default="blockwise+offload+chunked")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--step", type=int, default=1, help="the step recorded (after `step` others)")
    parser.add_argument("--largest", type=int, default=15, help="list this many of the largest live blocks")
    args = parser.parse_args()
    parts = args.arm.split("+")
    torch.manual_seed(0)
    config = SHAPES[args.shape]()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
    model = get_peft_model(_random_model(config, torch.device("cuda")), lora)
    tokens = torch.randint(0, config.vocab_size, (args.step + 1, 1, args.seq))
    recorder = Recorder(step=args.step)
    trainer = pl.Trainer(
        accelerator="gpu", devices=1,
        strategy=BlockwiseStrategy(vram_budget=None, offload_activations="offload" in parts),
        precision="bf16-mixed", max_steps=args.step + 1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
    )  # fmt: skip
    tile = TILE if "tiled" in parts else None
    attention_tile = ATTENTION_TILE if "tiledattn" in parts else None
    module = LongModule(model, CHUNK if "chunked" in parts else None, tile, attention_tile)
    if "liger" in parts:
        # After the module tiles the MLPs: a tiled MLP keeps its forward (Liger refuses to replace it).
        use_liger_kernels(model, swiglu=tile is None)
    if "fused" in parts:
        use_fused_lora(model)
    trainer.fit(module, DataLoader([{"input_ids": t, "labels": t} for t in tokens], batch_size=None))
    assert recorder.snapshot is not None
    n, h, i, v = args.seq, config.hidden_size, config.intermediate_size, config.vocab_size
    shapes = {
        n * i * 4: "tokens x intermediate, fp32", n * i * 2: "tokens x intermediate, bf16",
        n * h * 4: "tokens x hidden, fp32", n * h * 2: "tokens x hidden, bf16",
        CHUNK * v * 4: "chunk x vocab, fp32", CHUNK * v * 2: "chunk x vocab, bf16",
        h * i * 2: "hidden x intermediate, bf16 (a dequantized weight)", h * h * 2: "hidden x hidden, bf16",
        n * 16 * 4: "tokens x rank, fp32", n * 16 * 2: "tokens x rank, bf16",
    }  # fmt: skip
    kv = config.num_key_value_heads * (getattr(config, "head_dim", None) or h // config.num_attention_heads)
    shapes.update({n * kv * 2: "tokens x kv (keys or values), bf16", n * kv * 4: "tokens x kv, fp32"})
    if attention_tile is not None and attention_tile < n:
        t = attention_tile
        shapes.update({t * h * 4: "attention tile x hidden, fp32", t * h * 2: "attention tile x hidden, bf16"})
    peak, places, largest = peak_breakdown(recorder.snapshot, recorder.before, shapes)
    # A block of the same size as another shape is labelled with the first match, in the order above.
    print(json.dumps({"shape": args.shape, "seq": args.seq, "arm": args.arm, "replayed_peak_gb": peak / 1e9,
                      "max_memory_allocated_gb": torch.cuda.max_memory_allocated() / 1e9}))  # fmt: skip
    for place, size in places.most_common(args.top):
        print(f"{size / 1e9:8.3f} GB  {place}")
    print(f"largest live blocks at the peak ({args.largest}):")
    for size in largest[: args.largest]:
        print(f"{size / 1e9:8.3f} GB  {_place(size, shapes)}")


if __name__ == "__main__":
    main()
