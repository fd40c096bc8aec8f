from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from transformers import AutoModelForCausalLM

from tests.helpers.gpu_gate import unresolved_fixtures
from tests.helpers.models import CONFIGS, GPU_SHAPES, save_checkpoint


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one GPU gate: tests marked ``gpu`` are skipped without a CUDA device, once they are known to set up.

    GPU tests live beside their subject (``tests/<folder>/test_gpu_*.py``, or a test marked ``gpu`` in a CPU file);
    ``tools/gpu-suite`` runs them on a GPU. A GPU test that asks for a fixture nothing defines stops the run here, on
    the CPU too (:func:`~tests.helpers.gpu_gate.unresolved_fixtures`).

    Raises:
        pytest.UsageError: Naming each GPU test and the fixtures it lacks.
    """
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    lacking = [f"{item.nodeid}: {', '.join(names)}" for item in gpu if (names := unresolved_fixtures(item))]
    if lacking:
        raise pytest.UsageError("GPU tests ask for fixtures that nothing defines:\n" + "\n".join(lacking))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked `gpu`)")
    for item in gpu:
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


@pytest.fixture(scope="module", autouse=True)
def _release_device_memory() -> Iterator[None]:
    """On a GPU, after each module, free what its runs left on the device (results, cycles), so the next starts clean.

    Budget tests cap the allocator at a planned peak plus what the process already holds; memory an earlier module
    left allocated, or cached in segments it still partly uses, counted into that cap and made the order of the
    modules matter. Nothing to free on the CPU.
    """
    yield
    if torch.cuda.is_available():
        gc.collect()
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
