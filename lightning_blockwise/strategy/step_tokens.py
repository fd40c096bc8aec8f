"""How many tokens a micro-batch holds: declared ahead, read from the first training batch, or counted in a batch.

What the step budget plans for (NOTE [ A budget that sees the batches ] in planning/step_budget.py).
"""

from __future__ import annotations

import copy
import random
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

#: Tokens per micro-batch planned for when neither the strategy nor the data module says, and the first training
#: batch cannot be read ahead (:func:`first_batch`).
DEFAULT_TOKENS = 2048

#: What a refusal at setup adds: how to plan for another count.
_SET_BUDGET_TOKENS = "set `BlockwiseStrategy(budget_tokens=N)` to plan for N tokens (batch size x sequence length)"


@dataclass(frozen=True)
class PlannedTokens:
    """The tokens per micro-batch the first plan is made for, and where the count came from.

    Attributes:
        count: Tokens per micro-batch.
        source: Where ``count`` came from and how to change it, a sentence for a refusal at setup.
    """

    count: int
    source: str
    #: The count is this rank's own (read from its first batch), not the run's: ranks agree on one before planning.
    per_rank: bool = False


def first_tokens(budget_tokens: int | None, trainer: Any, fitting: bool) -> PlannedTokens:
    """What the first plan is made for, and where that came from.

    ``budget_tokens``, else the data module's ``max_length`` x ``batch_size``, else the first training batch (read
    ahead: :func:`first_batch`), else :data:`DEFAULT_TOKENS`.

    Args:
        budget_tokens: The strategy's ``budget_tokens`` option.
        trainer: The Trainer being set up.
        fitting: The Trainer is fitting: only then is there a first training batch to read.
    """
    said = f"Planned for {{}} tokens per micro-batch, {{}}: {{}}, or {_SET_BUDGET_TOKENS}."
    if budget_tokens is not None:
        return PlannedTokens(budget_tokens, f"Planned for {budget_tokens} tokens per micro-batch, `budget_tokens`.")
    datamodule = getattr(trainer, "datamodule", None)
    declared = declared_tokens(datamodule)
    if declared is not None:
        shape = f"{_declared(datamodule, 'max_length')} x {_declared(datamodule, 'batch_size')}"
        why = f"the data module's `max_length` x `batch_size` ({shape})"
        return PlannedTokens(declared, said.format(declared, why, "lower them"))
    batch, unread = first_batch(trainer) if fitting else (None, "not fitting")
    tokens = batch_tokens(batch) if batch is not None else None
    if tokens is not None:
        shape = " x ".join(str(size) for size in _ids_shape(batch))
        why = f"the first training batch's ({shape}; a longer one plans again before its step)"
        return PlannedTokens(tokens, said.format(tokens, why, "shorten the batches"), per_rank=True)
    unread = unread or "it holds no integer tensor of token ids"
    why = (
        f"the default: neither `budget_tokens` nor the data module's `max_length` and `batch_size` say, and the first"
        f" training batch was not read ahead ({unread})"
    )
    return PlannedTokens(DEFAULT_TOKENS, said.format(DEFAULT_TOKENS, why, "declare them"))


# NOTE [ The first batch read ahead ]
# Without a declared count the first plan was made for DEFAULT_TOKENS, and a budget that holds the real micro-batches
# (a 1.5B model's rows of 512 tokens under 5 GB) was refused at setup for 2048 tokens it would never see. The
# training batches are there at setup: Lightning has attached the loader hook (or the loader), only not called it.
# So the strategy builds the first batch itself, in its own process, without iterating the loader: the batch sampler
# is deep-copied (its generator and any state with it; the dataset shared, not copied), its first indices drawn,
# the dataset's items at them collated by the loader's `collate_fn`. Around that, every global RNG the sampler, the
# dataset or the collate may draw from (torch's CPU generator, Python's, NumPy's) is saved and restored, so the run
# draws, shuffles and trains exactly as it would have without the read (tests/strategy/test_first_batch_plan.py,
# with the control that leaves the RNG unrestored). An iterable dataset is not read ahead: its items may be a
# stream that reading would consume.
def first_batch(trainer: Any) -> tuple[Any, str | None]:
    """The first training batch, built ahead without touching the run's data or RNG (NOTE above), or why not.

    Returns:
        ``(batch, None)``, or ``(None, why)`` where it cannot be read ahead.
    """
    # Lightning 2.x keeps the `fit(...)` loaders, or the hook that makes them, on the fit loop until it needs them.
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    if source is None or not source.is_defined():
        return None, "no training data attached"
    with kept_rng_states():
        loader = source.dataloader()
        if not isinstance(loader, DataLoader):
            return None, f"the training data is a {type(loader).__name__}, not one DataLoader"
        dataset = loader.dataset
        if isinstance(dataset, IterableDataset):
            return None, "an iterable dataset, which reading ahead could consume"
        sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        try:
            order = copy.deepcopy(sampler, memo={id(dataset): dataset})
        except (TypeError, AttributeError, RuntimeError, copy.Error) as error:  # e.g. a sampler holding a lock
            return None, f"its sampler ({type(sampler).__name__}) cannot be copied: {error}"
        indices = next(iter(order), None)
        if indices is None:
            return None, "the training data is empty"
        if loader.batch_sampler is None:  # `batch_size=None`: the dataset's items are the batches
            items = dataset[indices]
        elif getattr(dataset, "__getitems__", None):  # as torch's map-style fetcher reads a batch
            items = dataset.__getitems__(indices)
        else:
            items = [dataset[i] for i in indices]
        return loader.collate_fn(items), None


@contextmanager
def kept_rng_states() -> Iterator[None]:
    """Put torch's CPU generator, Python's and NumPy's global RNG back as they were.

    Reading the first batch ahead must not move them (NOTE [ The first batch read ahead ]).
    """
    states = torch.get_rng_state(), random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _declared(datamodule: Any, name: str) -> Any:
    value = getattr(datamodule, name, None)
    return value if value is not None else datamodule.hparams.get(name)


def _ids_shape(batch: Any) -> tuple[int, ...]:
    """The shape of the tensor :func:`batch_tokens` counts."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(ids, Tensor):
        return tuple(ids.shape)
    items = list(batch.values()) if isinstance(batch, Mapping) else batch
    items = [items] if isinstance(items, Tensor) else items
    for item in items:
        if isinstance(item, Tensor) and not item.is_floating_point() and item.dim() >= 1:
            return tuple(item.shape)
    return ()


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


__all__ = [
    "DEFAULT_TOKENS",
    "PlannedTokens",
    "batch_tokens",
    "declared_tokens",
    "first_batch",
    "first_tokens",
    "kept_rng_states",
    "masked_row",
]
