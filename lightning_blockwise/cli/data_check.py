"""A config checked against its data before any weight is read: an int ``val_check_interval`` within one epoch.

Lightning compares ``val_check_interval`` with the epoch's training batches only when the fit loop builds
its loader, after ``configure_model`` has loaded the base: with a 72B checkpoint that is many minutes
spent before "``val_check_interval`` (800) must be less than or equal to the number of the training
batches (378)". The CLI adds :class:`DataCheck`, whose ``setup`` hook runs right after the data module's
``setup`` and before ``configure_model``, and asks the same question there.

Example::

    trainer = Trainer(val_check_interval=800, callbacks=[DataCheck()])
    trainer.fit(module, datamodule)  # refused at setup, naming 800, the epoch's batches and the fix
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override


class DataCheck(pl.Callback):
    """Refuse, at the start of ``fit``, an int ``val_check_interval`` longer than an epoch of the data module."""

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # `setup` of callbacks runs after the data module's and before `configure_model` (Lightning's
        # `_call_setup_hook`), so the data is ready and the base not yet read.
        if stage == "fit" and trainer.datamodule is not None:
            check_val_check_interval(trainer, trainer.datamodule)


def training_batches(trainer: pl.Trainer, datamodule: Any) -> int | None:
    """The training batches of one epoch on each device, as Lightning's fit loop will count them.

    Args:
        trainer: The Trainer: its world size and ``limit_train_batches``.
        datamodule: A data module that is set up (its ``train_dataloader`` can be built).

    Returns:
        The count, or ``None`` where the loader has no length (an iterable dataset).
    """
    loader = datamodule.train_dataloader()
    try:
        batches = len(loader)
    except TypeError:
        return None
    world = trainer.world_size
    batch_size = getattr(loader, "batch_size", None)
    if world > 1 and batch_size:
        # Lightning hands each rank a DistributedSampler share: ceil(rows / ranks) rows, in batches of batch_size.
        rows = math.ceil(len(loader.sampler) / world)
        batches = rows // batch_size if loader.drop_last else math.ceil(rows / batch_size)
    limit = trainer.limit_train_batches
    if isinstance(limit, int):
        return min(batches, limit)
    return int(batches * limit)


def check_val_check_interval(trainer: pl.Trainer, datamodule: Any) -> None:
    """Refuse an int ``val_check_interval`` above the epoch's training batches, as Lightning will after loading.

    Args:
        trainer: The Trainer whose ``val_check_interval`` is checked.
        datamodule: Its data module, set up.

    Raises:
        MisconfigurationException: If ``val_check_interval`` is an int larger than the batches of an epoch while
            ``check_val_every_n_epoch`` counts epochs (Lightning's own refusal, which comes after the base loads).
    """
    interval = trainer.val_check_interval
    # A float is a fraction of whatever the epoch holds; with `check_val_every_n_epoch=None` an int counts
    # batches across epochs. Both fit any data. (`bool` is an int subclass but not a valid interval.)
    if not isinstance(interval, int) or isinstance(interval, bool) or trainer.check_val_every_n_epoch is None:
        return
    batches = training_batches(trainer, datamodule)
    if batches is None or interval <= batches:
        return
    devices = f" on each of {trainer.world_size} devices" if trainer.world_size > 1 else ""
    raise MisconfigurationException(
        f"`--trainer.val_check_interval={interval}` is more than the {batches} training batches of an epoch{devices}"
        " of this data: Lightning would refuse it after loading the base. Give an int of at most"
        f" {batches}, a fraction of an epoch (`--trainer.val_check_interval=1.0` validates at each epoch's end),"
        " or `--trainer.check_val_every_n_epoch=null` to count batches across epochs. Nothing was loaded."
    )


__all__ = ["DataCheck", "check_val_check_interval", "training_batches"]
