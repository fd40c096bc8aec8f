"""Zoo: QLoRA scripts as public ones are written, each run auto vs blockwise (issue 42, items 5 and 7).

Each client below is the LightningModule of a script that never heard of lightning-blockwise: its own imports of
Lightning, its own loading of the 4-bit base and its own PEFT calls. Each test fits it under ``strategy="auto"`` and
under ``strategy="blockwise"`` from the same seed and compares, with ``torch.equal``, every loss, gradient, trained
tensor, optimizer state and logged metric, and the checkpoint files' names (tests/zoo/harness.py); each test also
checks that its comparison sees a change in any of those. Control runs that must differ: tests/zoo/test_controls.py.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.profilers import SimpleProfiler
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor
from torchmetrics.text import Perplexity
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.zoo.harness import ZooRun, assert_same, assert_sees_each_field, collect, zoo_data, zoo_fit, zoo_trainer

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def _nf4() -> BitsAndBytesConfig:
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,  # the CPU's; bf16 on a GPU
    )


class PlQLoRA(pl.LightningModule):
    """``import pytorch_lightning as pl``; the base loaded in ``__init__``, ``prepare_model_for_kbit_training``
    (which turns on reentrant gradient checkpointing and input gradients), a loss logged with ``sync_dist=True,
    on_epoch=True``; resumed with ``Trainer.fit(ckpt_path="last")``."""

    def __init__(self, model_name: str, lr: float = 2e-4) -> None:
        super().__init__()
        self.save_hyperparameters()
        # attention_dropout=0.0 as real Llama checkpoints have it: `strategy="auto"` restores no RNG state on a resume
        # (blockwise does), so with dropout the two resumed runs would draw differently by design.
        model = AutoModelForCausalLM.from_pretrained(
            model_name, quantization_config=_nf4(), device_map={"": "cpu"}, attention_dropout=0.0
        )
        model = prepare_model_for_kbit_training(model)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=ALL_LINEAR, task_type="CAUSAL_LM")
        self.model = get_peft_model(model, lora)
        self.model.train()
        # Lightning's full checkpoint of a 4-bit model does not load back strictly (its quant-state entries are not
        # parameters), so scripts that resume under `strategy="auto"` turn strict loading off.
        self.strict_loading = False

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr)


def _resumed_run(base: Path, strategy: str, root: Path) -> ZooRun:
    """Two steps, a `last.ckpt`, then a new Trainer resuming from "last" to four steps."""
    first = zoo_fit(
        lambda: PlQLoRA(str(base)),
        strategy,
        root,
        [ModelCheckpoint(dirpath=root / "ckpt", save_last=True)],
        max_steps=2,
    )
    pl.seed_everything(0, verbose=False)
    module = PlQLoRA(str(base))
    trainer = zoo_trainer(module, strategy, root, [ModelCheckpoint(dirpath=root / "ckpt", save_last=True)], max_steps=4)
    trainer.fit(module, zoo_data(), ckpt_path="last")
    return collect(trainer, root, into=first)


def test_pytorch_lightning_qlora_resumed_from_last(zoo_base: Path, tmp_path: Path) -> None:
    auto = _resumed_run(zoo_base, "auto", tmp_path / "auto")
    blockwise = _resumed_run(zoo_base, "blockwise", tmp_path / "blockwise")
    assert "ckpt/last.ckpt" in auto.files and len(auto.losses) == 4
    assert_same(auto, blockwise)
    assert_sees_each_field(auto)


class LitConfigureModel(L.LightningModule):
    """``import lightning as L``; the model built in ``configure_model``, non-reentrant gradient checkpointing,
    ``enable_input_require_grads``, the loss computed from the logits, a torchmetrics ``Perplexity`` logged."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.base = base
        self.model: torch.nn.Module | None = None
        self.perplexity = Perplexity(ignore_index=-100)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        model = AutoModelForCausalLM.from_pretrained(self.base, quantization_config=_nf4(), device_map="cpu")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=ATTENTION)
        self.model = get_peft_model(model, config)
        self.model.train()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        shift_logits, shift_labels = logits[:, :-1], batch["labels"][:, 1:]
        loss = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1))
        self.perplexity(shift_logits.detach(), shift_labels)
        self.log("train/loss", loss)
        self.log("train/ppl", self.perplexity, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_lightning_configure_model_checkpointing_metric_profiler(zoo_base: Path, tmp_path: Path) -> None:
    runs = [
        zoo_fit(
            lambda: LitConfigureModel(str(zoo_base)),
            s,
            tmp_path / s,
            profiler=SimpleProfiler(dirpath=tmp_path, filename=s),
        )
        for s in ("auto", "blockwise")
    ]
    assert_same(*runs)
    assert "train/ppl_epoch" in runs[0].logged[-1]
    assert (tmp_path / "fit-blockwise.txt").read_text().count("run_training_batch") > 0  # the profiler reported
    assert_sees_each_field(runs[0])


class ClippedLoRA(LightningModule):
    """``from lightning.pytorch import LightningModule``; the model passed in from outside, gradient checkpointing
    with transformers' default arguments, its own ``configure_gradient_clipping``, a per-step warmup schedule."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch)
        self.log("loss", out.loss, prog_bar=True)
        return out.loss

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        # Clip the adapters hard from the second step on, the way warmup-aware scripts do.
        self.clip_gradients(
            optimizer, gradient_clip_val=0.01 if self.global_step else 1.0, gradient_clip_algorithm="norm"
        )

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def _outside_model(base: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=_nf4(), device_map="cpu")
    model.gradient_checkpointing_enable()
    model.train()
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=ALL_LINEAR))


def test_outside_model_clipping_and_schedule(zoo_base: Path, tmp_path: Path) -> None:
    runs = [zoo_fit(lambda: ClippedLoRA(_outside_model(zoo_base)), s, tmp_path / s) for s in ("auto", "blockwise")]
    assert_same(*runs)
    assert_sees_each_field(runs[0])
