"""How many tokens a micro-batch holds: declared ahead by the data module, or counted in a batch.

What the step budget plans for (NOTE [ A budget that sees the batches ] in step_budget.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

#: Tokens per micro-batch planned for when neither the strategy nor the data module says.
DEFAULT_TOKENS = 2048


def declared_tokens(datamodule: Any) -> int | None:
    """``max_length`` x ``batch_size`` of a data module that declares both (attributes or hparams), else ``None``."""
    if datamodule is None:
        return None
    hparams = getattr(datamodule, "hparams", {}) or {}
    values = []
    for name in ("max_length", "batch_size"):
        value = getattr(datamodule, name, None)
        value = hparams.get(name) if value is None and isinstance(hparams, Mapping) else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return None
        values.append(value)
    return values[0] * values[1]


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a micro-batch: its ``input_ids`` (a mapping), else its first integer tensor; ``None`` if none."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, Tensor):
            return ids.numel()
        batch = list(batch.values())
    if isinstance(batch, Tensor):
        return batch.numel() if not batch.is_floating_point() else None
    if isinstance(batch, (list, tuple)):
        for item in batch:
            if isinstance(item, Tensor) and not item.is_floating_point() and item.dim() >= 1:
                return item.numel()
    return None


def masked_row(batch: Any, config: Any) -> int | None:
    """Tokens per row where the batch's attention runs SDPA with a mask, else ``None`` (NOTE [ Masked attention ]).

    A mapping batch whose ``attention_mask`` has a zero (padding) or is a 4-D mask built by the caller, or whose
    ``position_ids`` restart within a row (packed rows), under a model whose attention is ``sdpa``. Reads the two
    tensors' values: the strategy reads them on the host, before the batch's copy to the device
    (:meth:`~.step_planner.StepPlanner.note_host_batch`), and only for a batch whose rows are longer than the longest
    masked one it has planned for.
    """
    config = getattr(config, "text_config", None) or config
    # Unset before a model is built from the config: transformers then picks sdpa where torch has it.
    if not isinstance(batch, Mapping) or (getattr(config, "_attn_implementation", None) or "sdpa") != "sdpa":
        return None
    ids = batch.get("input_ids")
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        return None
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if isinstance(mask, Tensor) and mask.dim() == 4:  # a mask built by the caller: SDPA runs with it as given
        return ids.shape[-1]
    if isinstance(mask, Tensor) and mask.dim() == 2 and bool((mask == 0).any()):
        return ids.shape[-1]
    if isinstance(positions, Tensor) and positions.shape[-1] > 1:
        steps = positions[..., 1:] - positions[..., :-1]
        if bool((steps != 1).any()):
            return ids.shape[-1]
    return None


__all__ = ["DEFAULT_TOKENS", "batch_tokens", "declared_tokens", "masked_row"]
