"""One decoder layer's recompute working set: the device memory its forward-with-graph and backward add.

What a rematerialized layer needs on top of everything else while its backward runs (the
planner's ``StepShape.layer_graph`` plus the dequantized weight): one random-init NF4 layer of a
Qwen2.5 shape with LoRA r=16 on all seven projections, bf16 autocast, an input of ``seq`` tokens;
reports ``max_memory_allocated`` during forward + backward less what was allocated before,
per token, against the planner's prediction. ``--liger`` installs Liger's RMSNorm, RoPE and SwiGLU on the layer
(``use_liger_kernels``) and predicts with them (``StepKernels(fused_norm=True, fused_mlp=True)``); each row also
gives the planner's three working-set terms (MLP with its dequantized weight, norm, attention: NOTE [ A layer's
backward peak ] in planning/activation_constants.py) beside the measured peak.

    python -m benchmarks.layer_working_set --shapes 7b 72b --seqs 4096 16384 [--liger]
"""

from __future__ import annotations

import argparse
import json

import torch
from peft import LoraConfig, get_peft_model

from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise.kernels.liger import use_liger_kernels
from lightning_blockwise.planning import StepShape
from lightning_blockwise.planning.step_kernels import StepKernels
from lightning_blockwise.recipes.random_init import random_nf4_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["7b", "72b"])
    parser.add_argument("--seqs", nargs="+", type=int, default=[4096, 16384])
    parser.add_argument("--liger", action="store_true", help="Liger's RMSNorm, RoPE and SwiGLU on the layer")
    args = parser.parse_args()
    kernels = StepKernels(fused_norm=args.liger, fused_mlp=args.liger)
    device = torch.device("cuda")
    for shape in args.shapes:
        config = SHAPES[shape]()
        config.num_hidden_layers = 1
        config.vocab_size = 128
        torch.manual_seed(0)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS)
        model = get_peft_model(random_nf4_model(config, device), lora)
        if args.liger:
            use_liger_kernels(model)
        layer = model.base_model.model.model.layers[0]
        rotary = model.base_model.model.model.rotary_emb
        for seq in args.seqs:
            hidden = torch.randn(1, seq, config.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
            positions = torch.arange(seq, device=device)[None]
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                embeddings = rotary(hidden, positions)
                out = layer(hidden, position_embeddings=embeddings, attention_mask=None, position_ids=positions)
                out = out[0] if isinstance(out, tuple) else out
            out.backward(torch.ones_like(out))
            torch.cuda.synchronize()
            measured = torch.cuda.max_memory_allocated() - before
            planned = StepShape.for_config(config, seq, 1, kernels=kernels)
            dequantized = 2 * config.hidden_size * config.intermediate_size * 2
            predicted = planned.layer_graph() + dequantized
            row = {
                "shape": shape, "seq": seq, "liger": args.liger, "measured_gb": measured / 1e9,
                "predicted_gb": predicted / 1e9, "measured_bytes_per_token": measured / seq,
                "working_set_gb": planned.layer_working_set() / 1e9,
                "mlp_gb": (planned.mlp_working_set() + dequantized) / 1e9,
                "norm_gb": planned.norm_working_set() / 1e9, "attention_gb": planned.attention_working_set() / 1e9,
                "device": torch.cuda.get_device_name(),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            del hidden, out, embeddings
            layer.zero_grad(set_to_none=True)
        del model, layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
