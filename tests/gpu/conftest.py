"""Fixtures of the GPU tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.models import GPU_SHAPES


@pytest.fixture(scope="module", autouse=True)
def release_device_memory() -> Iterator[None]:
    """After each module, free what its runs left on the device (results, cycles), so the next one starts clean.

    Budget tests cap the allocator at a planned peak plus what the process already holds; memory an earlier module
    left allocated, or cached in segments it still partly uses, counted into that cap and made the order of the
    modules matter.
    """
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Qwen2.5-1.5B-shaped bf16 checkpoint, built on the GPU and saved once per test module."""
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(GPU_SHAPES["qwen2"](), dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path
