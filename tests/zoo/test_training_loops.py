"""Zoo: clients with their own training loop shapes: manual optimization with two optimizers, EMA and SWA callbacks,
``generate`` in ``validation_step``, and a module left in eval mode (issue 42, items 5 and 7).

Each exact client is fitted under ``strategy="auto"`` and ``strategy="blockwise"`` from one seed and compared in every
loss, gradient, trained tensor, optimizer state, logged metric and checkpoint name (tests/zoo/harness.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as lp
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.callbacks import StochasticWeightAveraging
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.zoo.harness import assert_same, assert_sees_each_field, zoo_data, zoo_fit, zoo_trainer

NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])


def _qlora(base: str, train: bool = True) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=NF4, device_map="cpu")
    if train:
        model.train()
    return get_peft_model(model, LoraConfig(**LORA))


class TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers (AdamW for the A matrices, SGD with momentum for the B matrices),
    ``manual_backward``, ``clip_gradients`` and ``toggle_optimizer``: a GAN-style loop on a LoRA model."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = _qlora(base)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        opt_a, opt_b = self.optimizers()
        for optimizer in (opt_a, opt_b):
            self.toggle_optimizer(optimizer)
            loss = self.model(**batch).loss
            self.manual_backward(loss)
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
            self.untoggle_optimizer(optimizer)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:
        a = [p for n, p in self.named_parameters() if "lora_A" in n]
        b = [p for n, p in self.named_parameters() if "lora_B" in n]
        return [torch.optim.AdamW(a, lr=1e-3), torch.optim.SGD(b, lr=1e-2, momentum=0.9)]


def test_manual_optimization_two_optimizers(zoo_base: Path, tmp_path: Path) -> None:
    runs = [zoo_fit(lambda: TwoOptimizers(str(zoo_base)), s, tmp_path / s) for s in ("auto", "blockwise")]
    assert_same(*runs)
    assert len(runs[0].optimizers) == 2 and all(runs[0].optimizers)
    assert_sees_each_field(runs[0])


class EMA(lp.Callback):
    """A hand-written exponential moving average of the trainable weights, kept in the callback and checkpointed."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: lp.Trainer, pl_module: lp.LightningModule, *args: Any) -> None:
        for name, p in pl_module.named_parameters():
            if p.requires_grad:
                old = self.shadow.get(name, p.detach())
                self.shadow[name] = old * self.decay + p.detach() * (1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"shadow": self.shadow}


class PlainLoRA(lp.LightningModule):
    """The plainest client: PEFT LoRA built in ``__init__``, ``outputs.loss``, AdamW, a logged loss."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.model = _qlora(base)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_ema_and_swa_callbacks(zoo_base: Path, tmp_path: Path) -> None:
    runs, emas = [], []
    for strategy in ("auto", "blockwise"):
        ema = EMA()
        swa = StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=1)
        settings = dict(max_steps=-1, max_epochs=2, limit_train_batches=3)
        runs.append(zoo_fit(lambda: PlainLoRA(str(zoo_base)), strategy, tmp_path / strategy, [ema, swa], **settings))
        emas.append(ema.shadow)
        assert swa.n_averaged is not None and swa.n_averaged.item() > 0  # SWA averaged, and wrote its average back
    assert_same(*runs)
    assert emas[0] and all(torch.equal(emas[0][n], emas[1][n]) for n in emas[0])
    assert_sees_each_field(runs[0])


class GeneratingModule(lp.LightningModule):
    """Calls ``self.model.generate`` in ``validation_step`` (greedy, a few tokens) and logs a validation loss."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.model = _qlora(base)
        self.generations: list[Tensor] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss, on_epoch=True)
        prompt = batch["input_ids"][:1, :4]
        out = self.model.generate(input_ids=prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
        self.generations.append(out)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_generate_in_validation_step(zoo_base: Path, tmp_path: Path) -> None:
    runs, modules = [], []
    for strategy in ("auto", "blockwise"):
        settings = dict(max_steps=4, val_check_interval=2, limit_val_batches=1)

        def make() -> GeneratingModule:
            modules.append(GeneratingModule(str(zoo_base)))
            return modules[-1]

        runs.append(zoo_fit(make, strategy, tmp_path / strategy, **settings))
    assert_same(*runs)
    assert "val_loss" in runs[0].logged[-1] and len(modules[0].generations) == 2  # training went on after validation
    assert all(torch.equal(a, b) for a, b in zip(modules[0].generations, modules[1].generations, strict=True))
    assert_sees_each_field(runs[0])


def test_module_left_in_eval_mode_is_refused_before_any_step(zoo_base: Path, tmp_path: Path) -> None:
    """`from_pretrained` returns eval mode and Lightning does not call `.train()`: on the CPU the strategy refuses
    eval-mode 4-bit layers (NOTE [ bitsandbytes CPU inference kernel ]) and says to call `model.train()`."""

    class Forgetful(PlainLoRA):
        def __init__(self, base: str) -> None:
            lp.LightningModule.__init__(self)
            self.model = _qlora(base, train=False)

    trainer = zoo_trainer(module := Forgetful(str(zoo_base)), "blockwise", tmp_path / "blockwise")
    with pytest.raises(MisconfigurationException, match=r"eval mode .* `model\.train\(\)` after loading"):
        trainer.fit(module, zoo_data())
    assert trainer.global_step == 0 and not trainer.callbacks[0].losses  # refused before any step
    run = zoo_fit(lambda: PlainLoRA(str(zoo_base)), "blockwise", tmp_path / "control")  # control: `.train()` runs
    assert run.losses
