"""The pre-quantized random checkpoint `benchmarks/concurrent_jobs.py` writes for its 32B arms (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM

from benchmarks import concurrent_jobs
from benchmarks.concurrent_jobs import make_checkpoint, write_nf4_checkpoint
from lightning_blockwise import load_blockwise
from lightning_blockwise.recipes.random_init import random_nf4_model
from tests.helpers.models import CONFIGS

#: Qwen2 (the benchmark's shapes are Qwen2.5's: biased q/k/v), small enough for seconds.
_CONFIG = CONFIGS["qwen2"]


def _differences(expected: nn.Module, actual: nn.Module) -> list[str]:
    """State-dict keys whose tensors differ: every 4-bit weight with its quant state, every other tensor."""
    a, b = expected.state_dict(), actual.state_dict()
    assert a.keys() == b.keys() and len(a) > 0
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("quantize_4bit called while loading a pre-quantized checkpoint")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cj") / "tiny-nf4"
    # Small shards, so the index and a block split over shards are exercised as at 32B (4 GB shards).
    write_nf4_checkpoint(_CONFIG(), path, "cpu", shard_size="40KB")
    return path


def test_checkpoint_is_nf4_as_bnb_4bit_ones_are(written: Path) -> None:
    config = json.loads((written / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config["load_in_4bit"]
    assert config["bnb_4bit_quant_type"] == "nf4" and config["bnb_4bit_use_double_quant"]
    index = json.loads((written / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    projection = "model.layers.0.mlp.down_proj.weight"
    with safe_open(str(written / index[projection]), "pt") as shard:
        # Packed 4-bit bytes (two per byte, one column), never the bf16 weight.
        assert shard.get_tensor(projection).dtype == torch.uint8
        assert shard.get_tensor(projection).numel() * 2 == _CONFIG().hidden_size * _CONFIG().intermediate_size
    assert f"{projection}.quant_state.bitsandbytes__nf4" in index


def test_load_blockwise_gives_the_model_written(written: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    expected = random_nf4_model(_CONFIG(), "cpu")
    with monkeypatch.context() as patch:
        # Deserialized, not quantized again: the checkpoint holds the NF4 bytes themselves.
        patch.setattr("bitsandbytes.functional.quantize_4bit", _refuse)
        loaded = load_blockwise(written, device="cpu", progress=False, share=False)
    assert _differences(expected, loaded) == []
    # The standard path reads the same checkpoint to the same model.
    standard = AutoModelForCausalLM.from_pretrained(written, device_map="cpu").train()
    assert _differences(standard, loaded) == []


def test_control_another_seed_is_seen(written: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    other = random_nf4_model(_CONFIG(), "cpu")
    loaded = load_blockwise(written, device="cpu", progress=False, share=False)
    different = _differences(other, loaded)
    assert any(k.endswith("proj.weight") for k in different)
    assert any(k.endswith("proj.weight.absmax") for k in different)


def test_written_once_into_a_partial_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_write(config: object, path: Path, device: str) -> None:
        calls.append(path)
        path.mkdir()
        (path / "config.json").write_text("{}")

    monkeypatch.setattr(concurrent_jobs, "write_nf4_checkpoint", fake_write)
    path = tmp_path / "7b-nf4"
    (tmp_path / "7b-nf4.partial").mkdir()
    (tmp_path / "7b-nf4.partial" / "stale").write_text("from a killed run")
    assert make_checkpoint("7b", path, prequantized=True) > 0
    assert calls == [tmp_path / "7b-nf4.partial"] and (path / "config.json").is_file()
    assert not (tmp_path / "7b-nf4.partial").exists() and not (path / "stale").exists()
    assert make_checkpoint("7b", path, prequantized=True) == 0.0 and len(calls) == 1


def test_checkpoint_too_big_for_the_disk_is_refused_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(concurrent_jobs.shutil, "disk_usage", lambda path: type("U", (), {"free": 64 * 10**9})())
    with pytest.raises(MisconfigurationException, match=r"bf16 32b checkpoint needs 6\d\.\d GB.*--prequantized"):
        make_checkpoint("32b", tmp_path / "32b-bf16", prequantized=False)
    assert list(tmp_path.iterdir()) == []
    # The NF4 one fits the same disk (~19 GB), so the refusal is about size, not any 32B checkpoint.
    assert concurrent_jobs.checkpoint_bytes(concurrent_jobs.SHAPES["32b"](), prequantized=True) < 20e9
