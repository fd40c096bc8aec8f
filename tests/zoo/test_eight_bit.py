"""Zoo: a script that loads its base in 8-bit (``BitsAndBytesConfig(load_in_8bit=True)``, issue 42, item 5).

bitsandbytes' ``Linear8bitLt`` reads its int8 weight and scales from where it was loaded, out of a host arena's reach
(NOTE [ 8-bit bases do not stream ] in compat/bitsandbytes/linears.py), so ``strategy="blockwise"`` refuses it at
setup, before any weight moves or any step runs, and names the fix; the same module trains under ``strategy="auto"``.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from bitsandbytes.nn import Int8Params, Linear8bitLt
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.zoo.harness import zoo_data, zoo_fit, zoo_trainer


class EightBitLoRA(pl.LightningModule):
    """LoRA on a base loaded with ``BitsAndBytesConfig(load_in_8bit=True)``: LLM.int8() linears."""

    def __init__(self, base: str) -> None:
        super().__init__()
        model = AutoModelForCausalLM.from_pretrained(
            base, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
        )
        model.train()
        self.model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_8bit_base_is_refused_before_any_weight_moves(zoo_base: Path, tmp_path: Path) -> None:
    module = EightBitLoRA(str(zoo_base))
    linears = [m for m in module.modules() if isinstance(m, Linear8bitLt)]
    assert linears and all(isinstance(m.weight, Int8Params) and m.weight.dtype == torch.int8 for m in linears)
    where = [m.weight.data_ptr() for m in linears]
    trainer = zoo_trainer(module, "blockwise", tmp_path / "blockwise")
    with pytest.raises(MisconfigurationException) as refused:
        trainer.fit(module, zoo_data())
    message = str(refused.value)
    assert "cannot stream a base loaded in 8-bit" in message and "`layers.0.self_attn.q_proj.base_layer`" in message
    assert 'BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")' in message
    assert 'strategy="auto"' in message
    # Refused at setup: no step ran, and every int8 weight is where `from_pretrained` put it (nothing packed).
    assert trainer.global_step == 0 and not trainer.callbacks[0].losses
    assert [m.weight.data_ptr() for m in linears] == where
    # Control: the same client trains under `strategy="auto"`, so the refusal is the strategy's, not the client's.
    auto = zoo_fit(lambda: EightBitLoRA(str(zoo_base)), "auto", tmp_path / "auto")
    assert len(auto.losses) == 3 and all(torch.isfinite(loss) for loss in auto.losses)
