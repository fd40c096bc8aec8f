"""Load-time memory and speed: ``load_blockwise`` against the standard ``from_pretrained`` path.

Write a random-init checkpoint of a Qwen2.5 shape (one shard per decoder layer, never the
whole model in memory), then measure each arm in a fresh process::

    python benchmarks/load_benchmark.py make --shape 14b --out /tmp/ckpt-14b                 # bf16
    python benchmarks/load_benchmark.py make --shape 72b --out /tmp/ckpt-72b --prequantized  # NF4, as *-bnb-4bit
    python benchmarks/load_benchmark.py run --path /tmp/ckpt-14b --arms blockwise standard

Each arm prints one JSON line with:

- ``load_s``: wall time of the load call (config, shards, quantization, packing), synchronized.
- ``peak_vram_gb``: ``torch.cuda.max_memory_allocated()`` over the load (stats reset before it).
- ``peak_anon_gb``: the peak of ``RssAnon`` from ``/proc/self/status``, sampled every 5 ms in a
  thread during the load: resident anonymous memory (heap, pinned and registered host memory,
  the arena), which excludes the checkpoint's memory-mapped file pages (``RssFile``) and
  shared memory (``RssShmem``). ``base_anon_gb`` is ``RssAnon`` before the load (torch, CUDA
  context), so ``peak_anon_gb - base_anon_gb`` is what the load itself added.
- ``peak_file_gb``: the peak of ``RssFile`` (page cache mapped from the shards), for reference.
- ``host_arena_gb``: the blockwise arena's size (the NF4 decoder base plus alignment).

The standard arm is ``AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4,
dtype=bfloat16, device_map="cuda:0")``; the blockwise arm is
``load_blockwise(path, compute_dtype=torch.bfloat16)`` on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

#: Qwen2.5 shapes: hidden size, intermediate size, layers, attention heads, key-value heads.
SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "0.5b": (896, 4864, 24, 14, 2),
    "7b": (3584, 18944, 28, 28, 4),
    "14b": (5120, 13824, 48, 40, 8),
    "32b": (5120, 27648, 64, 40, 8),
    "72b": (8192, 29568, 80, 64, 8),
}
VOCAB = 152064


def qwen2_config(shape: str) -> dict[str, object]:
    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def make_checkpoint(shape: str, out: Path, prequantized: bool) -> None:
    """Write config.json, one safetensors shard per decoder layer plus one for the rest, and the index."""
    from safetensors.torch import save_file

    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    head_dim = hidden // heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device).manual_seed(0)
    out.mkdir(parents=True, exist_ok=True)
    config = qwen2_config(shape)
    if prequantized:
        config["quantization_config"] = {
            "quant_method": "bitsandbytes",
            "load_in_4bit": True,
            "load_in_8bit": False,
            "bnb_4bit_quant_type": "nf4",
            "bnb_4bit_use_double_quant": True,
            "bnb_4bit_compute_dtype": "bfloat16",
            "bnb_4bit_quant_storage": "uint8",
        }
    (out / "config.json").write_text(json.dumps(config, indent=2))

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16) * 0.02).contiguous()

    def linear(prefix: str, out_features: int, in_features: int, tensors: dict[str, torch.Tensor]) -> None:
        weight = randn(out_features, in_features)
        if not prequantized:
            tensors[f"{prefix}.weight"] = weight.cpu()
            return
        import bitsandbytes.functional as bnbf

        # What `save_pretrained` writes for a 4-bit linear: the packed weight and its packed quant state.
        packed, state = bnbf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
        tensors[f"{prefix}.weight"] = packed.cpu()
        for key, value in state.as_dict(packed=True).items():
            tensors[f"{prefix}.weight.{key}"] = value.cpu()

    shards = layers + 1
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(layers):
        p = f"model.layers.{index}"
        tensors: dict[str, torch.Tensor] = {}
        linear(f"{p}.self_attn.q_proj", hidden, hidden, tensors)
        linear(f"{p}.self_attn.k_proj", kv_heads * head_dim, hidden, tensors)
        linear(f"{p}.self_attn.v_proj", kv_heads * head_dim, hidden, tensors)
        linear(f"{p}.self_attn.o_proj", hidden, hidden, tensors)
        for name, size in (("q_proj", hidden), ("k_proj", kv_heads * head_dim), ("v_proj", kv_heads * head_dim)):
            tensors[f"{p}.self_attn.{name}.bias"] = torch.zeros(size, dtype=torch.bfloat16)
        linear(f"{p}.mlp.gate_proj", intermediate, hidden, tensors)
        linear(f"{p}.mlp.up_proj", intermediate, hidden, tensors)
        linear(f"{p}.mlp.down_proj", hidden, intermediate, tensors)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        total += _save_shard(tensors, out, index, shards, weight_map, save_file)
        print(f"layer {index + 1}/{layers} written", flush=True)
    rest = {
        "model.embed_tokens.weight": randn(VOCAB, hidden).cpu(),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": randn(VOCAB, hidden).cpu(),
    }
    total += _save_shard(rest, out, layers, shards, weight_map, save_file)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    print(f"wrote {total / 1e9:.2f} GB to {out}", flush=True)


def _save_shard(tensors: dict, out: Path, index: int, shards: int, weight_map: dict, save_file: object) -> int:
    name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
    save_file(tensors, str(out / name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, name))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class _Sampler(threading.Thread):
    """Peak ``RssAnon`` and ``RssFile`` of this process, sampled every 5 ms."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_anon = self.peak_file = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak_anon = max(self.peak_anon, _status_kb("RssAnon") * 1024)
            self.peak_file = max(self.peak_file, _status_kb("RssFile") * 1024)
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def measure(path: Path, arm: str) -> dict[str, object]:
    """Load ``path`` with ``arm`` in this process and return the figures (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    from lightning_blockwise import load_blockwise
    from lightning_blockwise.compat.bitsandbytes import nf4_config
    from lightning_blockwise.residency.placement import host_copy_of

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context belongs to the baseline, not the load
    torch.cuda.reset_peak_memory_stats()
    base_anon = _status_kb("RssAnon") * 1024
    sampler = _Sampler()
    sampler.start()
    start = time.perf_counter()
    if arm == "standard":
        model = AutoModelForCausalLM.from_pretrained(
            path,
            quantization_config=nf4_config(torch.bfloat16),
            dtype=torch.bfloat16,
            device_map="cuda:0",
            local_files_only=True,
        )
    else:
        model = load_blockwise(path, compute_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    sampler.stop()
    copy = host_copy_of(model)
    return {
        "arm": arm,
        "path": str(path),
        "load_s": round(load_s, 2),
        "peak_vram_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
        "base_anon_gb": round(base_anon / 1e9, 3),
        "peak_anon_gb": round(sampler.peak_anon / 1e9, 3),
        "peak_file_gb": round(sampler.peak_file / 1e9, 3),
        "host_arena_gb": round(copy.arena.nbytes / 1e9, 3) if copy is not None else None,
        "device": torch.cuda.get_device_name(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make", help="write a random-init checkpoint")
    make.add_argument("--shape", choices=sorted(SHAPES), required=True)
    make.add_argument("--out", type=Path, required=True)
    make.add_argument("--prequantized", action="store_true", help="write NF4 as a *-bnb-4bit checkpoint")
    one = sub.add_parser("measure", help="measure one arm in this process")
    one.add_argument("--path", type=Path, required=True)
    one.add_argument("--arm", choices=["standard", "blockwise"], required=True)
    run = sub.add_parser("run", help="measure each arm in its own process")
    run.add_argument("--path", type=Path, required=True)
    run.add_argument("--arms", nargs="+", choices=["standard", "blockwise"], default=["blockwise", "standard"])
    run.add_argument("--out", type=Path, help="append the JSON lines to this file")
    args = parser.parse_args()

    if args.command == "make":
        make_checkpoint(args.shape, args.out, args.prequantized)
    elif args.command == "measure":
        print(json.dumps(measure(args.path, args.arm)), flush=True)
    else:
        for arm in args.arms:
            # A fresh process per arm: peaks, caches and the allocator start from nothing.
            command = [sys.executable, __file__, "measure", "--path", str(args.path), "--arm", arm]
            result = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
            line = next((x for x in reversed(result.stdout.splitlines()) if x.startswith("{")), None)
            if result.returncode != 0 or line is None:
                line = json.dumps({"arm": arm, "error": result.stderr.strip().splitlines()[-3:]})
            print(line, flush=True)
            if args.out is not None:
                with args.out.open("a") as out:
                    out.write(line + "\n")


if __name__ == "__main__":
    main()
