"""``EpochProgressBar``: Lightning's tqdm bar reading ``Epoch 2/3`` and the logged metrics, nothing else.

Example::

    trainer = Trainer(strategy="blockwise", max_steps=72, callbacks=[EpochProgressBar()])
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override


class EpochProgressBar(TQDMProgressBar):
    """A tqdm progress bar whose training description is ``Epoch N/M`` (counted from 1) and that hides ``v_num``.

    Lightning's bars print the epoch counted from 0 and, when ``max_steps`` bounds the run and
    ``max_epochs`` is left at -1, the rich bar prints ``Epoch 2/-2``; both show the logger's
    version number as ``v_num``, which says nothing about training. This bar counts epochs as a
    reader does and takes ``M`` from whichever limit ends the run first: ``max_epochs``, or the
    epochs that ``max_steps`` optimizer steps take (``num_training_batches`` and
    ``accumulate_grad_batches`` give the steps per epoch). With neither known (an unsized loader and
    no ``max_epochs``) it prints ``Epoch N``. It takes
    :class:`~lightning.pytorch.callbacks.TQDMProgressBar`'s arguments (``refresh_rate``, ...).
    """

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(epoch_description(trainer))

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


def planned_epochs(trainer: pl.Trainer) -> int | None:
    """How many epochs the run takes: the first of ``max_epochs`` and the epochs ``max_steps`` needs; ``None``: unknown.

    Args:
        trainer: A trainer whose training data is set up (``num_training_batches`` known).
    """
    limits = []
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        limits.append(trainer.max_epochs)
    batches = trainer.num_training_batches
    if trainer.max_steps >= 0 and batches not in (0, math.inf):
        # Lightning steps the optimizer after the last batch of an epoch even when an accumulation window
        # is incomplete, so an epoch is ceil(batches / accumulation) optimizer steps.
        steps_per_epoch = math.ceil(int(batches) / trainer.accumulate_grad_batches)
        limits.append(math.ceil(trainer.max_steps / steps_per_epoch))
    return min(limits) if limits else None


def epoch_description(trainer: pl.Trainer) -> str:
    """``Epoch N/M``, ``N`` counted from 1, ``M`` from :func:`planned_epochs`; ``Epoch N`` when ``M`` is unknown."""
    total = planned_epochs(trainer)
    current = trainer.current_epoch + 1
    return f"Epoch {current}/{total}" if total is not None else f"Epoch {current}"


__all__ = ["EpochProgressBar", "epoch_description", "planned_epochs"]
