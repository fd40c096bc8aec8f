"""Where one decoder layer's large allocations come from: sizes and the Python frames that made them.

`benchmarks/memory_peak.py` names the blocks alive at a step's peak by their sizes only (stack capture fails
inside checkpoint recomputes). This script takes a one-layer model of a real shape (the shape's widths, a small
vocabulary), trains one forward and backward of ``--seq`` tokens without checkpointing, so Python stacks can be
recorded, and prints every allocation of at least ``--min-hidden`` hidden-state-sized bf16 tensors with the frames
that made it (the innermost frames outside torch's own autograd machinery), and the peak with what is alive at it.

    python -m benchmarks.layer_allocations --shape 7b --seq 65536 --liger --fused --tiled
    python -m benchmarks.layer_allocations --shape 7b --seq 4096 --batch 2 --packed 512 --layers 2 --liger --fused

``--packed N`` gives the rows ``position_ids`` that restart every ``N`` tokens (packed examples, as
``recipes.packing`` builds them), so transformers builds a block-causal mask and SDPA runs with it: what a masked
attention saves per layer shows with ``--layers 2`` (each layer's share of what is alive at the peak).

A recompute runs the same layer code under no-grad and then with grad, so the backward's allocations here are the
recompute's and backward's of a streamed layer.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
from peft import LoraConfig, get_peft_model

from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise.kernels.fused_lora import use_fused_lora
from lightning_blockwise.kernels.liger import use_liger_kernels
from lightning_blockwise.longcontext.tiling import DEFAULT_TILE_TOKENS, tile_mlps
from lightning_blockwise.recipes.random_init import random_nf4_model

#: Frames from these files say how, not where: skipped when naming an allocation's maker.
_MACHINERY = ("torch/autograd", "torch/nn/modules/module.py", "torch/utils/checkpoint.py", "torch/_tensor.py")


def _frames(event: dict[str, Any], depth: int) -> list[str]:
    frames = [f for f in event.get("frames", []) if f["filename"].endswith(".py")]
    named = [f for f in frames if not any(m in f["filename"] for m in _MACHINERY)]
    return [f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in named[:depth]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, default=65536)
    parser.add_argument("--liger", action="store_true", help="use_liger_kernels (SwiGLU only when untiled)")
    parser.add_argument("--fused", action="store_true", help="use_fused_lora")
    parser.add_argument("--tiled", action="store_true", help=f"tile_mlps({DEFAULT_TILE_TOKENS})")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=1, help="rows of --seq tokens")
    parser.add_argument("--packed", type=int, default=None, help="position_ids restart every N tokens (a mask)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers")
    parser.add_argument("--min-hidden", type=float, default=0.9, help="list allocations at least this many hidden")
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = SHAPES[args.shape]()
    config.num_hidden_layers, config.vocab_size = args.layers, 1024
    model = random_nf4_model(config, torch.device("cuda"))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=args.dropout, target_modules=TARGETS))
    if args.tiled:
        tile_mlps(model, DEFAULT_TILE_TOKENS)
    if args.liger:
        use_liger_kernels(model, swiglu=not args.tiled)
    if args.fused:
        use_fused_lora(model)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    call: dict[str, Any] = {}
    if args.packed is not None:
        positions = torch.arange(args.seq, device="cuda") % args.packed
        call = {"position_ids": positions.expand(args.batch, -1), "use_cache": False}
    hidden_bytes = args.batch * args.seq * config.hidden_size * 2
    with torch.autocast("cuda", dtype=torch.bfloat16):  # a warm-up: kernels' workspaces, Liger's compiles
        warm = {k: v[:, :2048] if isinstance(v, torch.Tensor) else v for k, v in call.items()}
        model(input_ids=ids[:, :2048], **warm).logits.float().mean().backward()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.base_model.model.model(input_ids=ids, **call).last_hidden_state
        out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    print(f"allocations of >= {args.min_hidden} hidden-sized bf16 tensors ({hidden_bytes / 1e9:.3f} GB each):")
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if event["size"] >= args.min_hidden * hidden_bytes:
                print(f"  {event['size'] / hidden_bytes:5.2f} x  {' <- '.join(_frames(event, args.depth))}")
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    print(f"peak: {peak / 1e9:.3f} GB above the {before / 1e9:.3f} GB before ({peak / hidden_bytes:.2f} hidden)")
    for event in sorted(at_peak, key=lambda e: -e["size"])[:12]:
        print(f"  alive {event['size'] / hidden_bytes:5.2f} x  {' <- '.join(_frames(event, args.depth))}")
    row = {"shape": args.shape, "seq": args.seq, "batch": args.batch, "packed": args.packed, "layers": args.layers,
           "liger": args.liger, "fused": args.fused, "tiled": args.tiled,
           "peak_gb": peak / 1e9, "peak_hidden": peak / hidden_bytes,
           "device": torch.cuda.get_device_name()}  # fmt: skip
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
