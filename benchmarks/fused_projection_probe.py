"""What fusing q/k/v (and gate/up) into one NF4 dequantization and one GEMM would buy, before building it (lever 3).

For one decoder layer of a real shape (random NF4 weights, bitsandbytes' double quantization, as the strategy's bases
are), on ``tokens`` rows of bf16 input, per projection group:

- ``dequant_equal``: whether one ``dequantize_4bit`` of the group's packed bytes, concatenated, with each
  projection's absmax dequantized on its own (double quantization keeps a per-tensor offset, so the nested
  statistics cannot be concatenated), gives the bits of the projections' own dequantizations, concatenated: the
  premise of a fused group that is exact against resident training of the same module;
- ``gemm_equal``: whether the group's one GEMM gives the bits of its separate GEMMs (where not, a fused group is its
  own module choice, as the fused LoRA update is);
- ms (CUDA events, median of ``--repeats``) of the base's forward (dequantize and GEMM) and of its input gradient
  (dequantize again and the ``dY @ W`` GEMM, the separate arm adding the projections' input gradients as autograd
  does), separate against fused; the fused arm's time includes concatenating the packed bytes.

    python -m benchmarks.fused_projection_probe --shape 7b --tokens 4096 16384 [--device cuda]

``--shape tiny --device cpu`` runs in a second (tests/benchmarks/test_fused_projection_probe.py).

The LoRA adapters stay per projection in such a design (their update added to each projection's slice of the
output), so they are not timed here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bitsandbytes.functional import QuantState, dequantize_4bit, dequantize_blockwise, quantize_4bit
from torch import Tensor

from benchmarks.peer_arms.lightning_arm import EXTRA_SHAPES
from benchmarks.step_benchmark import SHAPES

BLOCKSIZE = 64


def quantized(out_features: int, in_features: int, device: torch.device) -> tuple[Tensor, QuantState]:
    """A random bf16 weight in NF4 with double quantization, as a 4-bit base's layers hold it."""
    weight = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16) * 0.02
    return quantize_4bit(weight, blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4")


def fused_dequantize(group: list[tuple[Tensor, QuantState]]) -> Tensor:
    """One ``dequantize_4bit`` of the group's packed bytes; each absmax dequantized with its own nested statistics."""
    absmax = torch.cat([dequantize_blockwise(s.absmax, s.state2) + s.offset for _, s in group])
    packed = torch.cat([p.reshape(-1) for p, _ in group]).reshape(-1, 1)
    first = group[0][1]
    shape = torch.Size([sum(s.shape[0] for _, s in group), first.shape[1]])
    state = QuantState(absmax=absmax, shape=shape, code=first.code, blocksize=first.blocksize, quant_type="nf4",
                       dtype=first.dtype)  # fmt: skip
    return dequantize_4bit(packed, state)


def timed(call: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median ms of ``call`` after one warm-up (synchronized)."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def probe_group(name: str, sizes: list[int], hidden: int, tokens: int, device: torch.device, repeats: int) -> dict:
    """One projection group (``sizes``: its projections' output features) at ``tokens`` rows."""
    torch.manual_seed(0)
    group = [quantized(size, hidden, device) for size in sizes]
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    grad = torch.randn(tokens, sum(sizes), device=device, dtype=torch.bfloat16)
    grads = grad.split(sizes, dim=1)
    separate_weights = [dequantize_4bit(p, s) for p, s in group]
    fused_weight = fused_dequantize(group)

    def forward_separate() -> list[Tensor]:
        return [x @ dequantize_4bit(p, s).t() for p, s in group]

    def forward_fused() -> Tensor:
        return x @ fused_dequantize(group).t()

    def input_grad_separate() -> Tensor:
        total = None
        for (p, s), g in zip(group, grads, strict=True):
            part = g @ dequantize_4bit(p, s)
            total = part if total is None else total + part
        assert total is not None
        return total

    def input_grad_fused() -> Tensor:
        return grad @ fused_dequantize(group)

    return {
        "group": name, "tokens": tokens, "sizes": sizes, "hidden": hidden,
        "dequant_equal": torch.equal(fused_weight, torch.cat(separate_weights)),
        "gemm_equal": torch.equal(forward_fused(), torch.cat(forward_separate(), dim=1)),
        "input_grad_equal": torch.equal(input_grad_fused(), input_grad_separate()),
        "forward_ms": {"separate": timed(forward_separate, device, repeats), "fused": timed(forward_fused, device,
                                                                                            repeats)},
        "input_grad_ms": {"separate": timed(input_grad_separate, device, repeats),
                          "fused": timed(input_grad_fused, device, repeats)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted({*SHAPES, *EXTRA_SHAPES}))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    config = {**SHAPES, **EXTRA_SHAPES}[args.shape]()
    head_dim = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    groups = {"qkv": [config.hidden_size, kv, kv], "gate_up": [config.intermediate_size] * 2}
    for tokens in args.tokens:
        for name, sizes in groups.items():
            print(json.dumps(probe_group(name, sizes, config.hidden_size, tokens, device, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
