"""A LightningModule that logs three kinds of torchmetrics metric, and a callback that records what it logged.

Shared by the one-process tests (tests/strategy/test_metrics.py) and the rank worker of the two-rank ones
(tests/helpers/metrics_worker.py), so both arms of every comparison run the same module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from torch import Tensor, nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

from tests.helpers.models import VOCAB, CausalLMModule


class MeteredModule(CausalLMModule):
    """Logs a perplexity, a mean loss and a top-8 token accuracy, each on every step and every epoch.

    ``mean_loss`` is persistent, so its state is part of ``state_dict`` and of every checkpoint. With
    ``sync=False`` no metric syncs across ranks when it computes (the two-rank control).
    """

    def __init__(self, build: Callable[[], nn.Module], sync: bool = True) -> None:
        super().__init__(build)
        self.perplexity = Perplexity(ignore_index=-100, sync_on_compute=sync)
        self.mean_loss = MeanMetric(sync_on_compute=sync)
        self.accuracy = MulticlassAccuracy(
            num_classes=VOCAB, top_k=8, average="micro", ignore_index=-100, sync_on_compute=sync
        )
        self.mean_loss.persistent(True)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch)
        self.losses.append(out.loss.detach().clone())
        # Next-token targets, as the model's own loss shifts them.
        logits, labels = out.logits[:, :-1].detach(), batch["labels"][:, 1:]
        self.perplexity(logits, labels)
        self.accuracy(logits.transpose(1, 2), labels)
        self.mean_loss(out.loss.detach())
        metrics = {"perplexity": self.perplexity, "accuracy": self.accuracy, "mean_loss": self.mean_loss}
        self.log_dict(metrics, on_step=True, on_epoch=True)
        return out.loss


class RecordLogged(Callback):
    """Copies of ``trainer.callback_metrics`` after every training batch and at every epoch's end, in order."""

    def __init__(self) -> None:
        self.records: list[dict[str, Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._record(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer)

    def _record(self, trainer: pl.Trainer) -> None:
        self.records.append({k: v.detach().clone().cpu() for k, v in sorted(trainer.callback_metrics.items())})


def records_differ(a: list[dict[str, Tensor]], b: list[dict[str, Tensor]]) -> bool:
    """Whether two runs' records differ in a key or a value (``torch.equal``)."""
    if len(a) != len(b) or any(x.keys() != y.keys() for x, y in zip(a, b, strict=True)):
        return True
    return any(not torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def metric_states(module: MeteredModule) -> dict[str, Tensor]:
    """Every metric's current state tensors, by ``<metric>.<state>``."""
    states = {}
    for name in ("perplexity", "mean_loss", "accuracy"):
        metric = getattr(module, name)
        for state in metric._defaults:
            states[f"{name}.{state}"] = getattr(metric, state).detach().clone()
    return states
