"""Merged export's memory: peak VRAM and host anonymous memory of `export` at N and 2N layers (GPU).

Writes a random bf16 checkpoint of Qwen2.5-7B widths with N decoder layers (one shard per layer) and a
LoRA r=16 adapter on all seven projections with non-zero A and B, then merges it with `--device cuda`
in a fresh process per arm, sampling `RssAnon` of /proc/self/status every 5 ms. If the merge streams
tensor by tensor, both peaks are the same at N and 2N layers.

    python -m benchmarks.merge_benchmark make 4 && python -m benchmarks.merge_benchmark make 8
    python -m benchmarks.merge_benchmark merge 4 bf16   # and: 8 bf16, 4 nf4, 8 nf4 (one process each)
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch

from benchmarks.step_benchmark import TARGETS

ROOT = Path("/tmp/merge_benchmark")


def make(layers: int) -> None:
    """The base checkpoint and the adapter of ``layers`` decoder layers under ``ROOT``."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
        num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    base = ROOT / f"base{layers}"
    base.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in model.state_dict().items():
        groups.setdefault(key.split(".")[2] if key.startswith("model.layers.") else "rest", {})[key] = tensor
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight_map: dict[str, str] = {}
    lora: dict[str, torch.Tensor] = {}
    for index, tensors in enumerate(groups.values()):
        shard = {}
        for key, tensor in tensors.items():
            if tensor.dim() > 1:
                shard[key] = (torch.randn(tensor.shape, device="cuda", generator=generator) * 0.02).bfloat16().cpu()
            else:
                shard[key] = torch.ones(tensor.shape, dtype=torch.bfloat16)
            if key.endswith("_proj.weight"):
                module = key.removesuffix(".weight")
                lora[f"base_model.model.{module}.lora_A.weight"] = torch.randn(16, tensor.shape[1]) * 0.01
                lora[f"base_model.model.{module}.lora_B.weight"] = torch.randn(tensor.shape[0], 16) * 0.001
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(base / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    adapter = ROOT / f"adapter{layers}"
    adapter.mkdir(exist_ok=True)
    LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM").save_pretrained(str(adapter))
    save_file(lora, str(adapter / "adapter_model.safetensors"))
    print(json.dumps({"made": layers, "layer_bf16_bytes": sum(t.numel() * 2 for t in groups["0"].values())}))


def _rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def merge(layers: int, mode: str) -> None:
    """Merge the ``layers``-layer adapter into its base on the GPU; print time, peak VRAM and host memory."""
    from lightning_blockwise.export.merge import export

    start_rss = peak = _rss_anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon())
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    start_vram = torch.cuda.memory_allocated()
    began = time.perf_counter()
    out = ROOT / f"out{layers}{mode}"
    export(ROOT / f"adapter{layers}", ROOT / f"base{layers}", out, merge=mode, device="cuda",
           compute_dtype="bfloat16", overwrite=True, progress=False)  # fmt: skip
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    row = {
        "layers": layers, "merge": mode, "seconds": round(seconds, 1), "device": torch.cuda.get_device_name(),
        "vram_peak_bytes": torch.cuda.max_memory_allocated() - start_vram,
        "rss_anon_peak_above_start_bytes": peak - start_rss,
        "output_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
    }  # fmt: skip
    print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("make").add_argument("layers", type=int)
    run = commands.add_parser("merge")
    run.add_argument("layers", type=int)
    run.add_argument("mode", choices=["bf16", "nf4"])
    args = parser.parse_args()
    make(args.layers) if args.command == "make" else merge(args.layers, args.mode)


if __name__ == "__main__":
    main()
