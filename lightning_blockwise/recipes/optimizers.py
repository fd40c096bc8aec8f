"""The optimizers a recipe can train its adapters with, by name: torch's AdamW or bitsandbytes' 8-bit AdamW.

Example::

    optimizer = build_optimizer("adamw8bit", adapter_params, lr=2e-4, weight_decay=0.0)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise.compat.bitsandbytes.optimizers import adamw_8bit

#: The names :func:`build_optimizer` takes: torch's AdamW (fp32 moments, 8 bytes a parameter), bitsandbytes'
#: ``AdamW8bit`` (~2 bytes a parameter) and ``PagedAdamW8bit`` (the same, in CUDA unified memory).
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")
#: The checkpoint key of the optimizer's name (:func:`check_resumed_optimizer`).
OPTIMIZER_KEY = "lightning_blockwise_optimizer"

# NOTE [ An optimizer's state resumes into its own kind only ]
# torch's AdamW keeps `exp_avg` and `exp_avg_sq` per parameter; bitsandbytes' 8-bit AdamW keeps uint8 codes and
# absmaxes under `__bnb_optimizer_quant_state__` (NOTE [ 8-bit AdamW ] in compat/bitsandbytes/optimizers.py). Each
# loads the other's state dict without a word and fails at the first step (`KeyError: 'exp_avg'`), after the base
# has loaded. So a checkpoint records the optimizer's name and a resume with another kind is refused before the
# load; a checkpoint older than the record is read by its state's keys. `AdamW8bit` and `PagedAdamW8bit` keep the
# same state (paging only places it), so switching between those two resumes the same numbers and is allowed.
_KINDS = {"adamw": "torch's fp32 AdamW moments", "adamw8bit": "bitsandbytes' 8-bit AdamW state"}
_KINDS["paged_adamw8bit"] = _KINDS["adamw8bit"]


def build_optimizer(name: str, params: Iterable[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer called ``name`` over ``params``.

    Args:
        name: One of :data:`OPTIMIZERS`.
        params: The parameters to train.
        lr: Learning rate.
        weight_decay: Decoupled weight decay.

    Returns:
        The optimizer.

    Raises:
        ValueError: If ``name`` is not one of :data:`OPTIMIZERS`.
    """
    if name == "adamw":
        return torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay)
    if name in ("adamw8bit", "paged_adamw8bit"):
        return adamw_8bit(params, lr=lr, weight_decay=weight_decay, paged=name == "paged_adamw8bit")
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(map(repr, OPTIMIZERS))}")


def saved_optimizer(checkpoint: Mapping[str, Any]) -> str | None:
    """The optimizer a Lightning checkpoint's state is of: its record, else read from the state's keys.

    Returns:
        One of :data:`OPTIMIZERS` (``"adamw8bit"`` for either 8-bit one when unrecorded), or ``None`` if the
        checkpoint has no record and no per-parameter state (nothing stepped yet, or no optimizer state at all).
    """
    if checkpoint.get(OPTIMIZER_KEY) in OPTIMIZERS:
        return checkpoint[OPTIMIZER_KEY]
    for optimizer_state in checkpoint.get("optimizer_states") or []:
        for state in optimizer_state.get("state", {}).values():
            if "exp_avg" in state:
                return "adamw"
            if "__bnb_optimizer_quant_state__" in state or "state1" in state:
                return "adamw8bit"
    return None


def check_resumed_optimizer(checkpoint: Mapping[str, Any], name: str, owner: str = "CausalLMFineTune") -> None:
    """Refuse to resume ``checkpoint``'s optimizer state into an optimizer of another kind, before the load.

    See NOTE [ An optimizer's state resumes into its own kind only ].

    Args:
        checkpoint: The Lightning checkpoint being resumed (its ``optimizer_states`` are loaded after this check).
        name: The optimizer this run builds, one of :data:`OPTIMIZERS`.
        owner: The class whose ``optimizer`` argument the message names.

    Raises:
        MisconfigurationException: Naming both optimizers and the ``optimizer`` that resumes the run.
    """
    saved = saved_optimizer(checkpoint)
    if saved is None or not checkpoint.get("optimizer_states") or _KINDS[saved] == _KINDS[name]:
        return
    recorded = OPTIMIZER_KEY in checkpoint
    was = f"optimizer={saved!r}" if recorded else "an 8-bit optimizer ('adamw8bit' or 'paged_adamw8bit')"
    raise MisconfigurationException(
        f"{owner}(optimizer={name!r}): the checkpoint was trained with {was}, and its {_KINDS[saved]} cannot resume"
        f" as {_KINDS[name]} (the first step would fail on a missing moment). Pass `optimizer={saved!r}` (YAML:"
        f" `optimizer: {saved}`) to resume the run, or start a new run from its adapter (`adapter_path`, no"
        f" `ckpt_path`) to train on with {name!r} from fresh moments."
    )


__all__ = ["OPTIMIZERS", "OPTIMIZER_KEY", "build_optimizer", "check_resumed_optimizer", "saved_optimizer"]
