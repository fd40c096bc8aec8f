"""What keeping part of a layer's graph would buy: each half's forward time against the bytes its graph saves.

A streamed layer that keeps no graph runs its forward twice per step (NOTE [ Kept activations ] in
planning/memory.py); keeping the whole graph saves the second forward at the cost of every tensor autograd saves.
Keeping only the attention half's graph and recomputing the MLP half would save the attention half's forward at
the cost of the attention half's saved tensors. Which pays more per byte decides whether that lever is worth
building. This script builds a ``--layers``-layer decoder stack of a real shape as ``layer_levers.py`` does (its
variants: ``peft``, ``liger``, ``fused``) and reports per layer:

- ``attention_ms`` / ``mlp_ms`` / ``layer_ms``: the no-grad forward of ``self_attn``, of ``mlp`` and of the whole
  layer (CUDA events around each module's call, median over ``--reps``), what a recompute runs again;
- ``attention_saved_gb`` / ``mlp_saved_gb`` / ``other_saved_gb``: the bytes autograd saves in each part in a forward
  with grad (``saved_tensors_hooks``; a storage saved twice counted once, the frozen and trainable parameters not at
  all: they are on the card anyway);
- ``ms_per_gb``: forward time saved per GB kept, for keeping the attention half and for keeping the whole layer.

    python -m benchmarks.layer_halves --shape 7b --seq 16384 32768 --variants peft+liger+fused --out /tmp/h.jsonl
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.layer_levers import OPTIONS, build
from benchmarks.peer_arms.measure import emit


class _Parts:
    """CUDA events around each ``self_attn`` and ``mlp`` call, and the bytes saved while each runs."""

    def __init__(self, decoder: nn.Module) -> None:
        self.current = "other"
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {"attention": [], "mlp": []}
        self.saved: dict[str, int] = {"attention": 0, "mlp": 0, "other": 0}
        self.seen: set[int] = set()
        self.parameters = {p.data_ptr() for p in decoder.parameters()}
        for layer in decoder.layers:
            for part, module in (("attention", layer.self_attn), ("mlp", layer.mlp)):
                module.register_forward_pre_hook(self._enter(part))
                module.register_forward_hook(self._leave(part))

    def _enter(self, part: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self.current = part
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self.events[part].append((start, torch.cuda.Event(enable_timing=True)))

        return hook

    def _leave(self, part: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.events[part][-1][1].record()
            self.current = "other"

        return hook

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.seen and key not in self.parameters and tensor.device.type == "cuda":
            self.seen.add(key)
            self.saved[self.current] += storage.nbytes()
        return tensor

    def reset(self) -> None:
        for events in self.events.values():
            events.clear()
        self.saved = dict.fromkeys(self.saved, 0)
        self.seen.clear()

    def milliseconds(self, part: str) -> float:
        return sum(start.elapsed_time(end) for start, end in self.events[part])


def measure(shape: str, layers: int, seq: int, variant: str, reps: int) -> dict[str, Any]:
    options = set(variant.split("+"))
    if options - set(OPTIONS):
        raise SystemExit(f"variant {variant!r}: unknown options {sorted(options - set(OPTIONS))}")
    decoder, config = build(shape, layers, options)
    parts = _Parts(decoder)
    gen = torch.Generator(device="cuda").manual_seed(2)
    embeds = torch.randn(1, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    times: dict[str, list[float]] = {"attention": [], "mlp": [], "layer": []}
    for rep in range(reps + 2):  # two warm-up calls
        parts.reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            start.record()
            decoder(inputs_embeds=embeds)
            end.record()
        torch.cuda.synchronize()
        if rep >= 2:
            times["attention"].append(parts.milliseconds("attention") / layers)
            times["mlp"].append(parts.milliseconds("mlp") / layers)
            times["layer"].append(start.elapsed_time(end) / layers)
    parts.reset()
    x = embeds.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(parts.pack, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = decoder(inputs_embeds=x).last_hidden_state
    saved_gb = {part: parts.saved[part] / 1e9 / layers for part in parts.saved}
    del out
    ms = {part: statistics.median(values) for part, values in times.items()}
    total_gb = sum(saved_gb.values())
    return {
        "shape": shape, "seq": seq, "layers": layers, "variant": variant, "status": "ok",
        "attention_ms": ms["attention"], "mlp_ms": ms["mlp"], "layer_ms": ms["layer"],
        **{f"{part}_saved_gb": gb for part, gb in saved_gb.items()},
        "ms_per_gb": {
            "keep_attention": ms["attention"] / saved_gb["attention"] if saved_gb["attention"] else None,
            "keep_layer": ms["layer"] / total_gb if total_gb else None,
        },
        "device": torch.cuda.get_device_name(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers in the timed stack")
    parser.add_argument("--seq", type=int, nargs="+", default=[16384])
    parser.add_argument("--variants", nargs="+", default=["peft+liger+fused"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per row here")
    args = parser.parse_args()
    for seq in args.seq:
        for variant in args.variants:
            row = measure(args.shape, args.layers, seq, variant, args.reps)
            print(row, flush=True)
            if args.out is not None:
                emit(row, args.out)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
