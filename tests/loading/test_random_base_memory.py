"""`random_blockwise`'s host memory while it builds (issue 46 item 6): the arena and one linear's quantization, never
the model in bf16, measured as the process's peak RSS at a scaled-down Llama-3.1-405B layer pattern.

The pattern: seven linears per layer, q/o square, k/v a sixteenth of the width (128 heads over 8 KV heads), the
MLP 3.25 times the width, an untied head. The arms run in turn in a fresh process with ``MALLOC_MMAP_THRESHOLD_``
low, so that every tensor's buffer is its own mapping and RSS is what the process holds: glibc otherwise keeps
freed heap for reuse, and the high-water mark would be the allocator's, not the build's. The peak is ``VmHWM`` after
``clear_refs`` reset it to the RSS before each build (the previous arm's memory given back to the system), once
the libraries are loaded (a one-layer build first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HIDDEN, HEADS = 1024, 16
INTERMEDIATE = HIDDEN * 13 // 4  # 53248 / 16384
LINEARS = [(HIDDEN, HIDDEN), (HIDDEN // 16, HIDDEN), (HIDDEN // 16, HIDDEN), (HIDDEN, HIDDEN)]
LINEARS += [(INTERMEDIATE, HIDDEN)] * 2 + [(HIDDEN, INTERMEDIATE)]
#: One decoder layer's weights in bf16 (the norms' few KB left out).
LAYER_BF16 = 2 * sum(out * inp for out, inp in LINEARS)
#: bitsandbytes' CPU quantizer works on fp32 temporaries: measured 15.6 bytes per element of the linear it
#: quantizes (212 MB at 13.6M elements), whatever the layer count. On a GPU that transient is on the device.
QUANTIZE_TRANSIENT = 16 * max(out * inp for out, inp in LINEARS)

_SCRIPT = """
import gc, json, sys
import torch, transformers
from lightning_blockwise import random_blockwise
from lightning_blockwise.residency.placement import host_copy_of

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

def config(layers, hidden):
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 13 // 4, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=1, tie_word_embeddings=False,
    )

def peak(arm, layers, hidden):
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM back to VmRSS
    before = status("VmRSS")
    if arm == "blockwise":
        model = random_blockwise(config(layers, hidden), device="cpu", share=False, progress=False)
        arena = host_copy_of(model).arena.nbytes
    else:  # the control: the model whole in bf16 first, as quantizing a built model would need
        model = transformers.AutoModelForCausalLM.from_config(config(layers, hidden), dtype=torch.bfloat16)
        arena = 0
    return {"peak": status("VmHWM") - before, "arena": arena}

random_blockwise(config(1, 256), device="cpu", share=False, progress=False)  # every library loaded
hidden = int(sys.argv[1])
arms = [(arm, int(layers)) for arm, layers in (a.split(":") for a in sys.argv[2:])]
print(json.dumps([peak(arm, layers, hidden) for arm, layers in arms]))
"""


def _peaks(*arms: str) -> list[dict[str, int]]:
    """Each ``ARM:LAYERS`` in turn in one fresh process, the peak reset before each (the last one's memory freed)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", _SCRIPT, str(HIDDEN), *arms]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux's clear_refs")
def test_the_build_holds_the_arena_and_one_linear_never_the_model_in_bf16() -> None:
    few, many, whole_few, whole = _peaks("blockwise:2", "blockwise:8", "whole:2", "whole:8")
    for built in (few, many):
        assert built["arena"] < LAYER_BF16 * 8 / 3  # NF4: under a third of bf16 (a quarter, plus the statistics)
        assert built["peak"] <= built["arena"] + LAYER_BF16 + QUANTIZE_TRANSIENT, built
    # What the build holds beyond the arena does not grow with the layers: six layers more add their NF4 bytes only.
    assert abs((many["peak"] - many["arena"]) - (few["peak"] - few["arena"])) < LAYER_BF16 / 2, (few, many)
    # Control: built whole in bf16 first, the same model's peak passes the bound and grows by a bf16 layer a layer.
    assert whole["peak"] > many["arena"] + LAYER_BF16 + QUANTIZE_TRANSIENT, (whole, many)
    assert whole["peak"] - whole_few["peak"] > 5 * LAYER_BF16
    print(json.dumps({"blockwise": [few, many], "whole": [whole_few, whole], "layer_bf16": LAYER_BF16}))
