"""A LightningModule as most public fine-tuning scripts write it, ``import pytorch_lightning as pl``, and its fit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn

from tests.helpers.models import RunResult, collect, loader, padded_batches


class PlCausalLMModule(pl.LightningModule):
    """:class:`tests.helpers.models.CausalLMModule` written against ``pytorch_lightning``: losses and grads kept."""

    def __init__(self, build: Callable[[], nn.Module], lr: float = 1e-2) -> None:
        super().__init__()
        self.model = build()
        self.lr = lr
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.grads.append({n: p.grad.detach().clone() for n, p in self.named_parameters() if p.grad is not None})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.01)


def pl_trainer(strategy: Any = "auto", **kwargs: Any) -> pl.Trainer:
    """A ``pytorch_lightning.Trainer`` with the settings of :func:`tests.helpers.models.trainer`."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


def pl_fit(module: PlCausalLMModule, strategy: Any = "auto", **trainer_kwargs: Any) -> RunResult:
    """Fit ``module`` from seed 0 with a ``pytorch_lightning.Trainer``; its losses, grads, weights, AdamW state."""
    pl.seed_everything(0, verbose=False)
    trainer = pl_trainer(strategy, **trainer_kwargs)
    trainer.fit(module, loader(padded_batches(8)))
    return collect(module, trainer.optimizers[0])  # type: ignore[arg-type]
