"""Is a fused LoRA path for q/k/v bit-identical to PEFT's three adapters? (issue 13, item 3: it ships only if so)

PEFT's LoRA on ``q_proj``, ``k_proj`` and ``v_proj`` runs three adapters on the same layer input:
``B_p(A_p(dropout_p(x))) * scale`` for each projection, each with its own dropout module. A fused path
computes the three down-projections as one matmul, ``x @ cat(A_q, A_k, A_v).T`` (one kernel instead of three,
one autograd node), or, with dropout, as one batched matmul over the three dropped-out inputs (their masks drawn
in PEFT's order). This probe runs both on the GPU at a real shape under bf16 autocast (fp32 adapter weights, as
PEFT keeps them) and compares every output and gradient with ``torch.equal``, then times a forward and backward
of each (CUDA events, median).

    python -m benchmarks.fused_lora_probe [--hidden 3584 --kv 512 --rank 16 --tokens 512 --dropout 0.0 0.1]
        [--deterministic]

Control: the unfused path run twice from the same seed is compared the same way and must be equal (else the
comparison says nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

Weights = dict[str, Tensor]


def make_weights(hidden: int, kv: int, rank: int, device: torch.device) -> Weights:
    """Random fp32 adapter weights (``A`` and ``B`` non-zero, so every gradient is)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = {"q": hidden, "k": kv, "v": kv}
    weights = {}
    for name, size in out.items():
        weights[f"A_{name}"] = (torch.randn(rank, hidden, generator=gen) / hidden**0.5).to(device).requires_grad_()
        weights[f"B_{name}"] = (torch.randn(size, rank, generator=gen) / rank**0.5).to(device).requires_grad_()
    return weights


def unfused(x: Tensor, w: Weights, p: float, scale: float) -> list[Tensor]:
    """PEFT's order: for q, k, v, dropout then ``lora_A`` then ``lora_B``, scaled."""
    outputs = []
    for name in "qkv":
        dropped = F.dropout(x, p=p, training=True) if p > 0 else x
        outputs.append(F.linear(F.linear(dropped, w[f"A_{name}"]), w[f"B_{name}"]) * scale)
    return outputs


def fused(x: Tensor, w: Weights, p: float, scale: float) -> list[Tensor]:
    """One down-projection for the three adapters: a matmul on ``cat(A)``, or a batched one over three masks."""
    a = [w[f"A_{name}"] for name in "qkv"]
    rank = a[0].shape[0]
    if p == 0:
        down = F.linear(x, torch.cat(a)).split(rank, dim=-1)
    else:
        dropped = torch.stack([F.dropout(x, p=p, training=True) for _ in "qkv"])  # masks in PEFT's order
        down = torch.matmul(dropped, torch.stack(a).transpose(1, 2)).unbind(0)
    return [F.linear(h, w[f"B_{name}"]) * scale for h, name in zip(down, "qkv", strict=True)]


def run(
    path: Callable[[Tensor, Weights, float, float], list[Tensor]], x0: Tensor, w: Weights, p: float, seed: int
) -> dict[str, Tensor]:
    """Outputs and gradients (of ``x`` and every weight) of ``path`` from ``seed``, against fixed output grads."""
    for tensor in w.values():
        tensor.grad = None
    x = x0.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        outputs = path(x, w, p, 2.0)
    gen = torch.Generator(device=x.device).manual_seed(1)
    grads = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outputs]
    torch.autograd.backward(outputs, grads)
    result = {f"out_{n}": o.detach() for n, o in zip("qkv", outputs, strict=True)}
    result["grad_x"] = x.grad
    result.update({f"grad_{k}": v.grad.clone() for k, v in w.items()})
    return result


def differing(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    return [name for name in a if not torch.equal(a[name], b[name])]


def time_path(path: Callable[..., list[Tensor]], x0: Tensor, w: Weights, p: float, repeats: int) -> float:
    """Median milliseconds of one forward and backward (CUDA events)."""
    times = []
    for index in range(repeats + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(path, x0, w, p, seed=index)
        end.record()
        end.synchronize()
        if index >= 5:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=3584)
    parser.add_argument("--kv", type=int, default=512)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dropout", type=float, nargs="+", default=[0.0, 0.1])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--deterministic", action="store_true", help="needs CUBLAS_WORKSPACE_CONFIG=:4096:8")
    args = parser.parse_args()
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    w = make_weights(args.hidden, args.kv, args.rank, device)
    x0 = torch.randn(1, args.tokens, args.hidden, device=device, dtype=torch.bfloat16)
    for p in args.dropout:
        reference = run(unfused, x0, w, p, seed=7)
        control = differing(reference, run(unfused, x0, w, p, seed=7))
        differ = differing(reference, run(fused, x0, w, p, seed=7))
        row = {
            "device": torch.cuda.get_device_name(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "shape": [args.tokens, args.hidden, args.kv, args.rank], "dropout": p,
            "control_unfused_twice_differs": control, "fused_differs": differ,
            "unfused_ms": time_path(unfused, x0, w, p, args.repeats),
            "fused_ms": time_path(fused, x0, w, p, args.repeats),
        }  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
