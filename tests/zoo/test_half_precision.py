"""Zoo: a script with an fp16 base under ``precision="16-mixed"`` (issue 42, item 5), on the CPU.

Lightning has no fp16 autocast on the CPU: ``Trainer(accelerator="cpu", precision="16-mixed")`` warns "AMP with fp16
is not supported on CPU. Using `precision='bf16-mixed'` instead." and trains under bf16 autocast, without a
``GradScaler``. That run, auto vs blockwise, is here, with the 4-bit layers computing in fp16 and the rest of the base
in fp32: a base loaded whole in fp16 (``dtype=torch.float16``) fails on the CPU under every strategy, in torch's bf16
autocast. The fp16 base with its ``GradScaler`` is on the GPU (tests/zoo/test_gpu_fp16.py, this client).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.zoo.harness import assert_same, assert_sees_each_field, zoo_fit


class HalfLoRA(pl.LightningModule):
    """QLoRA with an fp16 compute dtype (``bnb_4bit_compute_dtype=torch.float16``), as T4/V100 scripts load it."""

    def __init__(self, base: str, device_map: str | dict = "cpu", dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        nf4 = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float16,
        )
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=nf4, dtype=dtype, device_map=device_map)
        model.train()
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"])
        self.model = get_peft_model(model, lora)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_fp16_compute_dtype_under_16_mixed_on_the_cpu(zoo_base: Path, tmp_path: Path) -> None:
    runs = []
    for strategy in ("auto", "blockwise"):
        with pytest.warns(UserWarning, match=r"AMP with fp16 is not supported on CPU\. Using `precision='bf16-mixed'`"):
            make = lambda: HalfLoRA(str(zoo_base), dtype=torch.float32)  # noqa: E731
            runs.append(zoo_fit(make, strategy, tmp_path / strategy, precision="16-mixed"))
    assert_same(*runs)
    assert_sees_each_field(runs[0])


@pytest.mark.filterwarnings("ignore:.*AMP with fp16 is not supported on CPU")
def test_whole_fp16_base_under_16_mixed_fails_on_the_cpu_under_every_strategy(zoo_base: Path, tmp_path: Path) -> None:
    """torch's CPU autocast (bf16) meets fp16 tensors in Llama's rotary embedding: the same error under both."""
    for strategy in ("auto", "blockwise"):
        with pytest.raises(RuntimeError, match=r"Unexpected floating ScalarType in at::autocast::prioritize"):
            zoo_fit(lambda: HalfLoRA(str(zoo_base)), strategy, tmp_path / strategy, precision="16-mixed")
