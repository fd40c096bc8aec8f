"""Cost of exact rematerialization alone (no weight streaming yet), against resident training.

Builds a random-init NF4 model of a real shape directly on the GPU, layer by layer (the bf16
model never exists whole), adds LoRA r=16 on q,k,v,o,gate,up,down, and times in one process:
resident without checkpointing, resident with Hugging Face gradient checkpointing, and the
blockwise rematerializing layers (installed directly, weights resident). Seq 512, batch 1,
bf16 autocast, AdamW; median step time of the measured steps after warm-up, and
`torch.cuda.max_memory_allocated` over the measured steps (reset after warm-up).

    python benchmarks/remat_overhead.py --shapes 7b 32b [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import bitsandbytes as bnb
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from lightning_blockwise import remat
from lightning_blockwise.architectures import adapter_parameters
from lightning_blockwise.residency import AlwaysResident

SHAPES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "7b": lambda: transformers.Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    ),
    "32b": lambda: transformers.Qwen2Config(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False,
    ),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_nf4(config: transformers.PretrainedConfig, device: torch.device) -> nn.Module:
    """A random-init NF4 (double quant) model, quantized one linear at a time on ``device``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for layer in model.model.layers:
        for name, linear in list(layer.named_modules()):
            if not isinstance(linear, nn.Linear):
                continue
            quantized = bnb.nn.Linear4bit(
                linear.in_features, linear.out_features, bias=linear.bias is not None,
                compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4", device="meta",
            )  # fmt: skip
            weight = torch.randn(linear.out_features, linear.in_features, device=device, dtype=torch.bfloat16) * 0.02
            quantized.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, compress_statistics=True, quant_type="nf4", module=quantized
            ).to(device)
            if linear.bias is not None:
                quantized.bias = nn.Parameter(torch.zeros_like(weight[:, 0]), requires_grad=False)
            layer.set_submodule(name, quantized)
            del weight
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_meta:
                fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
                fresh.fill_(1.0) if param.dim() == 1 else fresh.normal_(0, 0.02)
                setattr(module, name, nn.Parameter(fresh, requires_grad=False))
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)
    model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
    return model.train()


def run_arm(model: nn.Module, arm: str, steps: int, warmup: int, vocab: int) -> dict[str, float]:
    layers = model.get_decoder().layers
    if arm == "resident_ckpt":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    if arm == "blockwise_remat":
        params = [[p for p in adapter_parameters(layer).values() if p.requires_grad] for layer in layers]
        remat.install(list(layers), params, AlwaysResident())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ids = torch.randint(0, vocab, (1, 512), generator=gen).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1e9
    if arm == "blockwise_remat":
        remat.uninstall(list(layers))
    if arm == "resident_ckpt":
        model.gradient_checkpointing_disable()
    del optimizer
    torch.cuda.empty_cache()
    return {"s_per_step": statistics.median(times), "peak_gb": peak, "tokens_per_s": 512 / statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["7b"], choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    mode = "deterministic" if args.deterministic else "default"
    rows = []
    for shape in args.shapes:
        torch.manual_seed(0)
        config = SHAPES[shape]()
        model = get_peft_model(build_nf4(config, device), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
        for arm in ("resident", "resident_ckpt", "blockwise_remat"):
            result = run_arm(model, arm, args.steps, args.warmup, config.vocab_size)
            rows.append({"shape": shape, "mode": mode, "arm": arm, **result})
            print(json.dumps(rows[-1]), flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | mode {mode}")
    print("| shape | arm | s/step | tokens/s | peak GB | vs resident_ckpt |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        ref = next(r for r in rows if r["shape"] == row["shape"] and r["arm"] == "resident_ckpt")
        print(
            f"| {row['shape']} | {row['arm']} | {row['s_per_step']:.3f} | {row['tokens_per_s']:.0f} |"
            f" {row['peak_gb']:.2f} | {row['s_per_step'] / ref['s_per_step']:.2f}x |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
