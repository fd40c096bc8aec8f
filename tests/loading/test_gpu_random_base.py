"""GPU: `random_blockwise` draws and quantizes on the card one linear at a time, the bytes of `random_nf4_model`.

`python -m pytest tests/loading/test_gpu_random_base.py -s` (the training test also needs
`CUBLAS_WORKSPACE_CONFIG=:4096:8` in the environment). Prints the build's seconds, device peak and host GB.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import PreTrainedModel

from lightning_blockwise import BlockwiseStrategy, random_blockwise
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import GPU_SHAPES, assert_equal_runs, fit_on_gpu, runs_differ
from tests.loading.test_random_base import _assert_same_bytes

pytestmark = pytest.mark.gpu

#: Qwen2.5-7B's shape: 28 layers, a 1.09 GB bf16 embedding and head, the largest linear 136 MB in bf16.
_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28)
_7B |= dict(num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False)


def _on_host(model: PreTrainedModel) -> PreTrainedModel:
    """A device-built model moved to the host in place (4-bit weights with their quant states, ties kept)."""
    return model.to("cpu")


def test_gpu_bytes_equal_random_nf4_model() -> None:
    config = GPU_SHAPES["qwen2"]()
    built = random_blockwise(config, seed=0, progress=False, share=False)
    assert host_copy_of(built).arena.pinned
    for seed, same in ((0, True), (1, False)):
        torch.manual_seed(seed)
        reference = _on_host(random_nf4_model(config, "cuda"))
        if same:
            _assert_same_bytes(reference, built)
        else:  # control: another seed
            with pytest.raises(AssertionError):
                _assert_same_bytes(reference, built)
        del reference
        torch.cuda.empty_cache()
    print("\n[random_blockwise] qwen2 1.5B shape: bytes equal random_nf4_model on the GPU (control: seed 1 differs)")


def test_gpu_build_peak_is_one_tensor_not_the_model() -> None:
    """The device holds one drawn tensor at a time: the peak is a few of the largest, never a layer or the model."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    config = transformers.Qwen2Config(**_7B)
    start = time.perf_counter()
    model = random_blockwise(config, seed=0, progress=False, share=False)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - before
    largest = config.vocab_size * config.hidden_size * 2  # the embedding (and head), drawn on the device in bf16
    copy = host_copy_of(model)
    print(
        f"\n[random_blockwise] 7B shape: built in {seconds:.1f} s, device peak {peak / 1e9:.3f} GB (largest drawn"
        f" tensor {largest / 1e9:.3f} GB), host arena {copy.arena.nbytes / 1e9:.2f} GB pinned={copy.arena.pinned}"
    )
    assert copy.arena.pinned and copy.is_bound()
    assert peak <= 2 * largest, f"device peak {peak / 1e9:.3f} GB: more than one drawn tensor at a time"
    assert torch.cuda.memory_allocated() - before < 64 * 2**20  # nothing of the model stays on the device


def _builder(seed: int, from_arena: bool) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        if from_arena:
            base = random_blockwise(GPU_SHAPES["llama"](), seed=seed, progress=False, share=False)
        else:
            torch.manual_seed(seed)
            base = random_nf4_model(GPU_SHAPES["llama"](), "cuda")
        torch.manual_seed(1)
        lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
        return get_peft_model(base, lora)

    return build


def test_gpu_training_equals_random_nf4_model() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    reference = fit_on_gpu(_builder(0, from_arena=False), BlockwiseStrategy(block_size=1), 3, 2, 256)
    built = fit_on_gpu(_builder(0, from_arena=True), BlockwiseStrategy(block_size=1), 3, 2, 256)
    assert_equal_runs(reference, built)
    other = fit_on_gpu(_builder(1, from_arena=True), BlockwiseStrategy(block_size=1), 3, 2, 256)
    assert runs_differ(reference, other)  # control: another seed's base
    print(f"\n[random_blockwise] llama 1B shape: {len(built.losses)} micro-batches torch.equal (control: seed 1)")
