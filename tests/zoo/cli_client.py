"""A user's own LightningModule and data module, as a script run through ``LightningCLI`` writes them (issue 42,
item 5): nothing in them knows about lightning-blockwise. ``tests/zoo/test_cli.py`` names them by class path.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from tests.zoo.harness import zoo_data


class UserLoRA(pl.LightningModule):
    """A QLoRA module whose constructor arguments the CLI fills: the base's path, the adapter's rank, the rate."""

    def __init__(self, base: str, rank: int = 4, learning_rate: float = 1e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        quantization = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
        )
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=quantization, device_map="cpu")
        model.train()
        config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        self.model = get_peft_model(model, config)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.hparams.learning_rate)


class UserData(pl.LightningDataModule):
    """The zoo's 6 padded micro-batches, in order."""

    def train_dataloader(self) -> DataLoader:
        return zoo_data()
