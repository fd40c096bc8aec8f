"""How much the caching allocator reserves beyond the allocated peak when it is capped.

A ``vram_budget`` is a cap on what the process takes from the card (the strategy sets it as the
allocator's per-process cap), so the planner must leave room between the predicted allocated peak
and the cap for what the allocator cannot hand out (partly used segments, rounding). This sweep
measures that room: for each point it runs the arm uncapped to find its allocated peak ``A``, then
again under caps of ``f x A`` for each ``--factors`` value, and records whether the step ran out of
memory, the peak reserved bytes and the step time (a tight cap makes the allocator free its cache
and retry, which costs time). Random-init NF4 Qwen2.5 shapes as in `benchmarks.long_context`.

    python -m benchmarks.allocator_cap --points 7b:16384:blockwise+offload+chunked --factors 1.10 1.05 1.02
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m benchmarks.allocator_cap ...
"""

from __future__ import annotations

import argparse
import os

import torch
from peft import LoraConfig, get_peft_model

from benchmarks.long_context import _emit, _random_model, run_arm
from benchmarks.step_benchmark import SHAPES, TARGETS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", nargs="+", default=["7b:16384:blockwise+offload+chunked"], help="SHAPE:SEQ:ARM")
    parser.add_argument("--factors", nargs="+", type=float, default=[1.10, 1.05, 1.02])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=None, help="append JSON lines here")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    models: dict[str, torch.nn.Module] = {}
    for point in args.points:
        shape, seq, arm = point.split(":")
        if shape not in models:
            models.clear()
            torch.cuda.empty_cache()
            torch.manual_seed(0)
            config = SHAPES[shape]()
            lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
            models[shape] = get_peft_model(_random_model(config, device), lora)
        model = models[shape]
        vocab = model.config.vocab_size
        allocated = None
        for factor in [None, *args.factors]:
            if factor is None:
                model.to(device)  # capped runs reuse the host copy the first run made (no device copy of the base)
            torch.cuda.empty_cache()
            fraction = 1.0 if factor is None else min(1.0, factor * allocated / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            torch.cuda.reset_peak_memory_stats()
            row = run_arm(model, arm, int(seq), args.steps, args.warmup, vocab, False)
            if factor is None:
                allocated = row["peak_allocated_gb"] * 1e9
            cap_gb = fraction * total / 1e9
            row.update(shape=shape, seq=int(seq), arm=arm, factor=factor, cap_gb=cap_gb, alloc_conf=conf)
            _emit(row, args.out)
        torch.cuda.set_per_process_memory_fraction(1.0, device)


if __name__ == "__main__":
    main()
