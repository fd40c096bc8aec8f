"""``ParityCheck`` on a CUDA device: it passes, leaves no trace, and checks a prefix when the reference does not fit.

`python -m pytest tests/callbacks/test_gpu_parity_check.py -s` on a CUDA machine (small shapes, deterministic mode).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import transformers
from lightning.pytorch import Callback
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.callbacks.parity import ParityCheck
from tests.helpers.models import CausalLMModule, assert_equal_runs, fit, padded_batches

pytestmark = pytest.mark.gpu

NUM_LAYERS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama_small")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=8,
        attention_dropout=0.1,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def _builder(path: Path) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization, device_map="cuda:0")
        model.train()
        lora = LoraConfig(r=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj", "down_proj"])
        return get_peft_model(model, lora)

    return build


def _fit(path: Path, callbacks: list[Callback], **kwargs: Any) -> Any:
    batches = padded_batches(8, batch_size=2, seq=128, vocab=1024)
    kwargs = {"accelerator": "gpu", "precision": "bf16-mixed", "deterministic": True, **kwargs}
    strategy = kwargs.pop("strategy", BlockwiseStrategy(vram_budget=None, block_size=1))
    return fit(CausalLMModule(_builder(path)), strategy, batches, callbacks=callbacks, **kwargs)


class _LimitToBlocks(Callback):
    """Sets the check's memory limit to exactly what the first ``num_blocks`` blocks need (runs before it)."""

    def __init__(self, check: ParityCheck, num_blocks: int) -> None:
        self.check = check
        self.num_blocks = num_blocks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(trainer.strategy, BlockwiseStrategy)
        self.check.max_reference_bytes = trainer.strategy.resident_prefix_bytes(self.num_blocks)


def test_check_passes_and_leaves_no_trace(checkpoint: Path) -> None:
    check = ParityCheck()
    checked = _fit(checkpoint, [check])
    result = check.result
    assert result is not None
    print(f"[parity check] {result.report()}")
    assert result.passed and result.full and result.checked_layers == NUM_LAYERS
    assert result.peak_vram_bytes is not None and result.peak_vram_bytes > 0
    assert_equal_runs(checked, _fit(checkpoint, []))


def test_prefix_mode_engages_when_the_reference_does_not_fit(checkpoint: Path) -> None:
    full = ParityCheck()
    _fit(checkpoint, [full], max_steps=1)
    prefix = ParityCheck()
    _fit(checkpoint, [_LimitToBlocks(prefix, 3), prefix], max_steps=1)
    assert full.result is not None and prefix.result is not None
    print(f"[parity check, full] {full.result.report()}")
    print(f"[parity check, prefix] {prefix.result.report()}")
    assert prefix.result.passed and not prefix.result.full
    assert (prefix.result.checked_blocks, prefix.result.checked_layers) == (3, 3)
    assert "layers 0..2 (3 of 8 blocks) resident" in prefix.result.scope()
    assert prefix.result.peak_vram_bytes is not None and full.result.peak_vram_bytes is not None
    assert prefix.result.peak_vram_bytes < full.result.peak_vram_bytes


def test_warns_when_deterministic_algorithms_are_off(checkpoint: Path) -> None:
    check = ParityCheck(on_mismatch="warn")
    with pytest.warns(UserWarning, match="deterministic algorithms are off"):
        _fit(checkpoint, [check], deterministic=False, max_steps=1)
    assert check.result is not None
    print(f"[parity check, default mode] {check.result.report()}")
