"""What each lever does to one decoder layer's time: the no-grad forward, and the forward and backward with grad.

A streamed layer costs a step its no-grad forward (the forward pass, nothing saved), then its recompute (the same
forward with grad) and its backward; a layer that keeps its activations costs the forward with grad and the backward
only. So at lengths where most layers recompute, a lever pays by what it takes off both. This script builds a
model of ``--layers`` decoder layers of a real shape (random-init NF4, LoRA r16 on the seven projections, a small
vocabulary), and for each variant times, with CUDA events, the decoder stack's

- ``nograd``: forward under ``torch.no_grad`` (what the streamed forward pass runs);
- ``train``: forward with grad and backward from a fixed gradient, into the input (``inputs_embeds`` requires grad, as
  a streamed layer's input does in its recompute) and the adapters;

and reports per layer, and ``recompute = nograd + train`` (a streamed layer) against ``train`` (a kept one).

Variants (``--variants``, options joined by ``+``): ``peft`` (transformers + PEFT + bitsandbytes), ``liger``
(``use_liger_kernels``), ``fused`` (``use_fused_lora``), ``compile`` (each decoder layer compiled on its own,
``layer.compile()``, regional as transformers and torchtune do), and one scaled-dot-product attention backend forced
for every call (``cudnn``, ``flash``, ``efficient``, ``math``; none: PyTorch's own choice).

Each row says whether the no-grad forward's output is bit-equal to the grad forward's (``nograd_equals_train``):
blockwise's replay needs the streamed forward pass to compute the very bits resident training does, and a compiled
no-grad graph may fuse differently from the training graph, an attention backend may run another kernel without grad.
A compiled variant also gives the largest difference of its output from the eager variant's, every eager one from the
first variant's.

``--profile`` adds, per variant, where one ``nograd`` and one ``train`` call spend their GPU time (``torch.profiler``):
attention kernels, GEMMs, bitsandbytes' dequantization, the loss, Triton kernels (Liger's), the rest, and the copies,
in ms per layer, and the 8 largest kernels (``benchmarks/peer_arms/measure.py``'s ``KERNEL_KINDS``, shared with
``benchmarks/peers.py --profile``).

    python -m benchmarks.layer_levers --shape 7b --seq 4096 16384 --variants peft+liger+fused \
        peft+liger+fused+compile peft+compile --out /tmp/levers.jsonl

Every variant builds its own model from the same seed (the same weights and inputs). A variant that fails (a compile
error) prints its error as a row and the next one runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.peer_arms.measure import emit, failure, kernel_split_of
from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.kernels.fused_lora import use_fused_lora
from lightning_blockwise.kernels.liger import use_liger_kernels
from lightning_blockwise.recipes.random_init import random_nf4_model

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
OPTIONS = ("peft", "liger", "fused", "compile", *BACKENDS)


def build(shape: str, layers: int, options: set[str]) -> tuple[torch.nn.Module, Any]:
    """The decoder stack of ``layers`` layers of ``shape`` with the variant's options on, and its config."""
    torch.manual_seed(0)
    config = SHAPES[shape]()
    config.num_hidden_layers, config.vocab_size = layers, 1024
    model = random_nf4_model(config, torch.device("cuda"))
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero; a trained adapter's update is not zero
            torch.nn.init.normal_(param, std=0.02)
    if "liger" in options:
        use_liger_kernels(model)
    if "fused" in options:
        use_fused_lora(model)
    if "compile" in options:
        # A fresh dynamo for each variant: the layers share one forward code object, and its cache entries (per
        # layer, grad mode and variant) would pass the recompile limit, after which dynamo runs the layer eagerly.
        torch._dynamo.reset()
        counters.clear()
        torch._dynamo.config.recompile_limit = 64
        for layer in find_decoder_stack(model, allow_unvalidated=True).layers:
            layer.compile(dynamic=False)
    return model.base_model.model.model, config


def _time(fn: Any, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def measure(
    shape: str, layers: int, seq: int, variant: str, reps: int, warmup: int, profile: bool = False
) -> dict[str, Any]:
    options = set(variant.split("+"))
    unknown = options - set(OPTIONS)
    if unknown:
        raise SystemExit(f"variant {variant!r}: unknown options {sorted(unknown)}; known: {', '.join(OPTIONS)}")
    if len(options & set(BACKENDS)) > 1:
        raise SystemExit(f"variant {variant!r}: force one attention backend at most")
    start = time.perf_counter()
    decoder, config = build(shape, layers, options)
    gen = torch.Generator(device="cuda").manual_seed(2)
    embeds = torch.randn(1, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(1, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3

    forced = [BACKENDS[name] for name in BACKENDS if name in options]

    def attention() -> Any:
        return sdpa_kernel(forced) if forced else contextlib.nullcontext()

    def nograd() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), attention():
            return decoder(inputs_embeds=embeds).last_hidden_state

    def train() -> torch.Tensor:
        x = embeds.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16), attention():
            out = decoder(inputs_embeds=x).last_hidden_state
        out.backward(grad_out)
        decoder.zero_grad(set_to_none=True)
        return out.detach()

    first = time.perf_counter()
    out_nograd = nograd()
    out_train = train()
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - first  # the compiles, for a compiled variant
    t_nograd = _time(nograd, reps, warmup)
    t_train = _time(train, reps, warmup)
    nograd_s = statistics.median(t_nograd) / layers
    train_s = statistics.median(t_train) / layers
    row: dict[str, Any] = {
        "shape": shape, "seq": seq, "layers": layers, "variant": variant, "status": "ok",
        "nograd_ms_per_layer": nograd_s * 1e3, "train_ms_per_layer": train_s * 1e3,
        "recompute_ms_per_layer": (nograd_s + train_s) * 1e3,
        "nograd_equals_train": bool(torch.equal(out_nograd, out_train)),
        "dynamo_counters": {k: dict(v) for k, v in counters.items() if k in ("stats", "graph_break")},
        "first_call_s": first_call_s, "build_s": first - start,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9, "device": torch.cuda.get_device_name(),
    }  # fmt: skip
    if profile:
        row["nograd_kernels_ms_per_layer"] = kernel_split(nograd, layers)
        row["train_kernels_ms_per_layer"] = kernel_split(train, layers)
    row["_out"] = out_train
    return row


def kernel_split(fn: Any, layers: int) -> dict[str, Any]:
    """GPU time of one call of ``fn`` by kernel kind (``measure.kernel_split_of``), ms per layer."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return kernel_split_of(prof, layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=2, help="decoder layers in the timed stack")
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--variants", nargs="+", default=["peft", "peft+liger+fused", "peft+liger+fused+compile"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    parser.add_argument("--profile", action="store_true", help="GPU time by kernel kind, per variant")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("layer_levers times CUDA kernels: run it on a GPU.")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)
    for seq in args.seq:
        eager: dict[str, torch.Tensor] = {}
        for variant in args.variants:
            torch.cuda.reset_peak_memory_stats()
            try:
                row = measure(args.shape, args.layers, seq, variant, args.reps, args.warmup, args.profile)
            except Exception as error:  # a row says what failed; the next variant still runs
                row = {"shape": args.shape, "seq": seq, "variant": variant, **failure(error),
                       "trace_tail": traceback.format_exc().splitlines()[-6:]}  # fmt: skip
            out = row.pop("_out", None)
            base = variant.replace("+compile", "")
            if out is not None and "compile" not in variant:
                eager.setdefault(variant, out)
                reference = next(iter(eager.values()))  # the first variant's output: how far a backend moves it
                row["max_abs_diff_vs_first"] = (out.float() - reference.float()).abs().max().item()
            elif out is not None and base in eager:
                row["max_abs_diff_vs_eager"] = (out.float() - eager[base].float()).abs().max().item()
                row["equals_eager"] = bool(torch.equal(out, eager[base]))
            row["mode"] = "deterministic" if args.deterministic else "default"
            if args.out:
                emit(row, args.out)
            else:
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
