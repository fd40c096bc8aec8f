"""``--trainer.enable_progress_bar=false`` over a config whose callbacks name a progress bar: the flag wins.

The configs list :class:`~lightning_blockwise.callbacks.EpochProgressBar` among the Trainer's
callbacks, and Lightning refuses a progress-bar callback beside ``enable_progress_bar=False``
("Trainer was configured with `enable_progress_bar=False` but found ..."). A bar is a display
choice and the flag says there is no display, so the CLI leaves the bar out instead.
"""

from __future__ import annotations

import importlib
from typing import Any

from jsonargparse import Namespace
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info


def drop_progress_bars(trainer_config: Namespace) -> None:
    """Remove progress-bar callbacks from a parsed Trainer config whose ``enable_progress_bar`` is ``False``.

    An unset ``enable_progress_bar`` (``None``, the Trainer's default, meaning "on") keeps them.

    Args:
        trainer_config: The ``trainer`` section of a parsed LightningCLI config (changed in place).
    """
    callbacks = trainer_config.get("callbacks")
    # Only an explicit false: a config or command line that leaves the key unset parses it as None, which the
    # Trainer reads as "show the bar" (its default), and the config's bar must then stay.
    if trainer_config.get("enable_progress_bar") is not False or not callbacks:
        return
    # One callback given alone (`--trainer.callbacks=pkg.Callback`) parses as that callback, not a list of one.
    given = callbacks if isinstance(callbacks, list) else [callbacks]
    kept = [callback for callback in given if not _is_progress_bar(callback)]
    if len(kept) < len(given):
        rank_zero_info("`--trainer.enable_progress_bar=false`: the config's progress bar callback is left out.")
        trainer_config.callbacks = kept


def _is_progress_bar(callback: Any) -> bool:
    """Whether a parsed callback (a ``class_path`` namespace, or an instance) is a Lightning progress bar."""
    if isinstance(callback, Namespace):
        module, _, name = callback.class_path.rpartition(".")
        return issubclass(getattr(importlib.import_module(module), name), ProgressBar)
    return isinstance(callback, ProgressBar)


__all__ = ["drop_progress_bars"]
