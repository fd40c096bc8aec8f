"""Callbacks that the resume tests name by `class_path` in CLI runs started as subprocesses."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback


class RecordLosses(Callback):
    """Save every training step's loss tensor to ``<directory>/<global_step>.pt`` as soon as the step ends."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        torch.save(outputs["loss"].detach().cpu(), self.directory / f"{trainer.global_step}.pt")


class KillAt(Callback):
    """SIGKILL this process at the end of optimizer step ``step``: no hook, no `finally`, no checkpoint runs after."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class ForwardCounts(Callback):
    """Counts each decoder layer's attention forwards during training (``counts[i]`` for layer ``i``).

    Counted in the module's forward, not by a hook: a forward hook fires once per step (replay/hooks.py), a forward
    once per run, so a recomputed layer counts two per micro-batch and a replayed one three.
    """

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = pl_module.model.get_decoder().layers
        self.counts = [0] * len(layers)
        for index, layer in enumerate(layers):
            attn, forward = layer.self_attn, layer.self_attn.forward
            attn.forward = lambda *a, index=index, forward=forward, **k: (self._count(index), forward(*a, **k))[1]

    def _count(self, index: int) -> None:
        self.counts[index] += 1
