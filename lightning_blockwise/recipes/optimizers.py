"""The optimizers a recipe can train its adapters with, by name: torch's AdamW or bitsandbytes' 8-bit AdamW.

Example::

    optimizer = build_optimizer("adamw8bit", adapter_params, lr=2e-4, weight_decay=0.0)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lightning_blockwise.compat.bitsandbytes.optimizers import adamw_8bit

#: The names :func:`build_optimizer` takes: torch's AdamW (fp32 moments, 8 bytes a parameter), bitsandbytes'
#: ``AdamW8bit`` (~2 bytes a parameter) and ``PagedAdamW8bit`` (the same, in CUDA unified memory).
OPTIMIZERS = ("adamw", "adamw8bit", "paged_adamw8bit")


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


__all__ = ["OPTIMIZERS", "build_optimizer"]
