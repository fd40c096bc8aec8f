from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from transformers import AutoModelForCausalLM

from tests.helpers.models import CONFIGS, save_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one GPU gate: tests marked ``gpu`` are skipped without a CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_global_state() -> Iterator[None]:
    """Each test starts from the same seed and leaves the global torch state as it found it."""
    rng = torch.get_rng_state()
    dtype = torch.get_default_dtype()
    deterministic = torch.are_deterministic_algorithms_enabled()
    # Lightning sets the process's rank-zero rank when a strategy sets up (one function object shared by both Lightning
    # namespaces); a test that builds a strategy as rank 3 (launcher variables) left every later `rank_zero_warn` mute.
    rank = getattr(rank_zero_only, "rank", None)
    torch.manual_seed(0)
    yield
    torch.set_rng_state(rng)
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic)
    if rank is None:
        if hasattr(rank_zero_only, "rank"):
            del rank_zero_only.rank
    else:
        rank_zero_only.rank = rank


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A saved random-init checkpoint per architecture, for the `from_pretrained` (and NF4) path."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {model_type: save_checkpoint(model_type, root / model_type) for model_type in CONFIGS}


@pytest.fixture(scope="session")
def small_llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 8-layer Llama checkpoint, big enough for real copies and kernels on a GPU, small enough for seconds."""
    path = tmp_path_factory.mktemp("llama_small")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_no_attention_dropout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny Llama without attention dropout (which tiled attention refuses), saved."""
    path = tmp_path_factory.mktemp("llama_no_attention_dropout")
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.0
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama8_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny Llama (``CONFIGS["llama"]``) with eight layers, saved: room for every kind of block."""
    path = tmp_path_factory.mktemp("llama8")
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.num_hidden_layers = 8
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path
