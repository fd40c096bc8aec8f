"""Where a DoRA projection's time goes: one NF4 linear with LoRA, PEFT's DoRA and the factored norm (issue 32).

`benchmarks/dora.py` times whole training steps; this times one adapted bitsandbytes 4-bit projection of a real
width, forward and backward of ``--tokens`` tokens under bf16 autocast (CUDA events, the median of ``--repeats``
after a warm-up), for each arm and rank, and lists the CUDA kernels of the factored arm's forward and backward
(``torch.profiler``, summed by name), so the part of the step the factoring leaves can be named.

    python -m benchmarks.dora_module --in-features 5120 --out-features 27648 --ranks 64 256

Arms as `benchmarks.dora`'s: ``lora``, ``dora_dense`` (PEFT's forward), ``dora_factored``
(:func:`~lightning_blockwise.adapters.dora_norm.factor_dora_norms`). The base is random NF4, the adapters PEFT's
initialisation with a random ``lora_B`` (so the DoRA terms are not zero), no dropout (PEFT then reuses the base
output), one JSON line per point.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

import bitsandbytes as bnb
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lightning_blockwise.adapters.dora_norm import factor_dora_norms

ARMS = ("lora", "dora_dense", "dora_factored")


class _One(nn.Module):
    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = bnb.nn.Linear4bit(
            in_features, out_features, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def _model(args: argparse.Namespace, arm: str, rank: int) -> nn.Module:
    torch.manual_seed(0)
    base = _One(args.in_features, args.out_features)
    with torch.no_grad():
        base.proj.weight.data.normal_(0, 0.02)  # before the move to CUDA quantizes it
    base = base.cuda()
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["proj"], use_dora=arm != "lora")
    model = get_peft_model(base, config)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.01)
    if arm == "dora_factored":
        factor_dora_norms(model)
    return model


def _step(model: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x)
    out.backward(grad)


def time_arm(args: argparse.Namespace, arm: str, rank: int) -> dict[str, object]:
    """Median milliseconds of one forward and backward of ``arm`` at ``rank``, and its peak memory above the start."""
    model = _model(args, arm, rank)
    x = torch.randn(args.tokens, args.in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(args.tokens, args.out_features, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        _step(model, x, grad)
    torch.cuda.synchronize()
    start_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        _step(model, x, grad)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    row: dict[str, object] = {
        "arm": arm, "rank": rank, "in": args.in_features, "out": args.out_features, "tokens": args.tokens,
        "ms": statistics.median(times), "peak_above_start_gb": (torch.cuda.max_memory_allocated() - start_bytes) / 1e9,
    }  # fmt: skip
    if args.profile and arm != "lora":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            _step(model, x, grad)
            torch.cuda.synchronize()
        kernels: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:90]] += event.device_time_total / 1e3
        row["kernels_ms"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[: args.profile])
    del model, x, grad
    torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=5120)
    parser.add_argument("--out-features", type=int, default=27648)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--ranks", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile", type=int, default=8, help="list this many kernels per DoRA arm (0: none)")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    args = parser.parse_args()
    for rank in args.ranks:
        for arm in args.arms:
            row = time_arm(args, arm, rank) | {"device": torch.cuda.get_device_name()}
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
