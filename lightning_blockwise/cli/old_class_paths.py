"""Checkpoints whose hyperparameters name a module path removed before 0.1.0: refused with the class path to use."""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

#: Module paths of the flat layout, removed before 0.1.0, and the modules that hold their names now.
REMOVED_MODULES: dict[str, tuple[str, ...]] = {
    "lightning_blockwise.demo": (
        "lightning_blockwise.demos.tiny",
        "lightning_blockwise.demos.progressions",
        "lightning_blockwise.recipes.schedules",
    ),
    "lightning_blockwise.finetune": ("lightning_blockwise.recipes.finetune",),
    "lightning_blockwise.data": ("lightning_blockwise.recipes.data",),
    "lightning_blockwise.random_init": ("lightning_blockwise.recipes.random_init",),
}


def current_class_path(class_path: str) -> str | None:
    """The class path that replaced ``class_path`` of the flat layout; ``None`` where ``class_path`` was not removed."""
    module, _, name = class_path.rpartition(".")
    for candidate in REMOVED_MODULES.get(module, ()):
        if hasattr(importlib.import_module(candidate), name):
            return f"{candidate}.{name}"
    return None


def refuse_removed_class_path(ckpt_path: str | Path) -> None:
    """Refuse a checkpoint whose ``hyper_parameters['_class_path']`` names a removed module, before it is parsed.

    Args:
        ckpt_path: A local checkpoint file.

    Raises:
        MisconfigurationException: If the checkpoint's class path names a module of the flat layout; the message
            names the class path to write in its place.
    """
    try:
        saved = torch.load(ckpt_path, weights_only=True, map_location="cpu", mmap=True)
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError):
        return  # not a checkpoint this check can read: loading it says what is wrong
    hparams = saved.get("hyper_parameters") if isinstance(saved, dict) else None
    class_path = hparams.get("_class_path") if isinstance(hparams, dict) else None
    new = current_class_path(class_path) if isinstance(class_path, str) else None
    if new is None:
        return
    raise MisconfigurationException(
        f"`--ckpt_path={ckpt_path}` was saved by `{class_path}`, a module path removed before 0.1.0; the class is"
        f" `{new}` now. Convert the checkpoint once: `c = torch.load(path, weights_only=True);"
        f' c["hyper_parameters"]["_class_path"] = "{new}"; torch.save(c, path)`, then resume from it.'
    )
