"""What ``CausalLMFineTune`` records about its base, and how it honours an adapter's or a checkpoint's record.

NOTE [ The training record of an adapter ] in export/training_record.py: an adapter directory records the compute
dtype, NF4 or dense, and the base's identity; a ``.ckpt`` of the recipe holds the same record. The module takes
what it is not told from an ``adapter_path``'s record, warns where it is told otherwise, and refuses another base
(an adapter's, or a checkpoint's on resume, whatever the strategy) unless ``allow_other_base``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_blockwise.export.training_record import (
    CHECKPOINT_RECORD_KEY,
    TrainingRecord,
    dtype_name,
    read_training_record,
)
from lightning_blockwise.loading.base_identity import BaseIdentity, base_identity

_OWNER = "CausalLMFineTune"
#: What the module loads when neither its arguments nor an adapter's record say.
DEFAULT_COMPUTE_DTYPE, DEFAULT_QUANTIZE = "bfloat16", True


def adapter_settings(adapter_path: str | None, compute_dtype: str | None, quantize: bool | None) -> tuple[str, bool]:
    """``compute_dtype`` and ``quantize`` as the module loads the base: given ones win, an adapter's record fills in.

    Args:
        adapter_path: ``CausalLMFineTune(adapter_path=...)``; its ``lightning_blockwise.json`` is read if it has one.
        compute_dtype: The argument as given (``None``: not given).
        quantize: The argument as given (``None``: not given).

    Returns:
        The compute dtype and whether to quantize: the record's where not given, else bfloat16 and NF4.

    Warns:
        UserWarning: If a given one differs from the adapter's record (the base then computes another function).

    Raises:
        MisconfigurationException: If the adapter's record is not one this package writes.
    """
    record = None if adapter_path is None else read_training_record(adapter_path)
    if record is None:
        return compute_dtype or DEFAULT_COMPUTE_DTYPE, DEFAULT_QUANTIZE if quantize is None else quantize
    recorded_dtype = dtype_name(record.compute_dtype)
    if compute_dtype is not None and compute_dtype != recorded_dtype:
        rank_zero_warn(
            f"{_OWNER}(compute_dtype={compute_dtype!r}): the adapter {adapter_path} was trained with compute dtype"
            f" {recorded_dtype!r} (its lightning_blockwise.json); the base loaded in {compute_dtype!r}, as asked,"
            " computes another function than the one trained. Leave compute_dtype out to use the record."
        )
    if quantize is not None and record.quantize is not None and quantize != record.quantize:
        rank_zero_warn(
            f"{_OWNER}(quantize={quantize}): the adapter {adapter_path} was trained over the {record.base_format} base"
            f" (its lightning_blockwise.json); the {'NF4' if quantize else 'dense'} base, as asked, computes another"
            " function than the one trained. Leave quantize out to use the record."
        )
    if quantize is None:
        quantize = DEFAULT_QUANTIZE if record.quantize is None else record.quantize
    return compute_dtype or recorded_dtype, quantize


def module_record(checkpoint: str, compute_dtype: str, quantize: bool, random_init: bool) -> TrainingRecord:
    """The record of a module over the base ``checkpoint``: what its adapters and checkpoints carry.

    A ``random_init`` base is identified by its config alone (its weights are not the files'); a base whose files
    cannot be read has no identity here (loading it says what is wrong).
    """
    try:
        identity: BaseIdentity | None = base_identity(checkpoint, with_weights=not random_init)
    except ValueError:
        identity = None
    return TrainingRecord(getattr(torch, compute_dtype), quantize, identity)


def check_adapter_base(adapter_path: str, current: TrainingRecord, allow_other_base: bool) -> None:
    """Refuse, before the base loads, an adapter recorded over another base than the module's.

    Raises:
        MisconfigurationException: Naming both bases and the fix, unless ``allow_other_base`` (then a warning).
    """
    record = read_training_record(adapter_path)
    if record is None or record.base is None or current.base is None:
        return  # an adapter without an identity: what it always did
    _check_same_base(record.base, current.base, f"the adapter {adapter_path}", "train or evaluate it", allow_other_base)


def check_resumed_base(
    checkpoint: Mapping[str, Any], current: TrainingRecord | None, frozen_keys: set[str], allow_other_base: bool
) -> TrainingRecord | None:
    """Refuse a checkpoint recorded over another base than the module's, whatever the strategy.

    A checkpoint that carries the frozen base (``BlockwiseStrategy(save_frozen_base=True)``) brings its own base,
    so it is not refused; the module is then over the checkpoint's base, and records that from now on. The compute
    dtype and NF4 or dense are the module's arguments: a difference is warned about.

    Args:
        checkpoint: The checkpoint dict (``on_load_checkpoint``'s).
        current: The module's record (``None`` before its model is built: nothing to compare).
        frozen_keys: The state-dict keys of the module's frozen parameters.
        allow_other_base: Resume over another base anyway, with a warning.

    Returns:
        The module's record from now on.

    Raises:
        MisconfigurationException: Naming both bases and the fix, if the base differs and ``allow_other_base`` is off.
    """
    saved = checkpoint.get(CHECKPOINT_RECORD_KEY)
    if saved is None or current is None:
        return current  # a checkpoint of an older version: the blockwise fingerprint is all there is
    try:
        record = TrainingRecord.from_dict(saved)
    except ValueError as error:
        raise MisconfigurationException(
            f"{_OWNER}: the checkpoint's `{CHECKPOINT_RECORD_KEY}` is not a training record ({error}). Resume from a"
            " checkpoint a CausalLMFineTune run saved."
        ) from None
    if frozen_keys & set(checkpoint.get("state_dict", {})):
        return TrainingRecord(current.compute_dtype, current.quantize, record.base)
    if record.base is not None and current.base is not None:
        _check_same_base(record.base, current.base, "the checkpoint", "resume it", allow_other_base)
    if (record.compute_dtype, record.quantize) != (current.compute_dtype, current.quantize):
        rank_zero_warn(
            f"{_OWNER}: the checkpoint was trained over the {record.base_format} base in"
            f" {dtype_name(record.compute_dtype)}, and this module loads the {current.base_format} base in"
            f" {dtype_name(current.compute_dtype)} (`quantize`, `compute_dtype`): the resumed run trains another"
            " function. Pass the checkpoint's to continue the same one."
        )
    return current


def _check_same_base(
    recorded: BaseIdentity, current: BaseIdentity, what: str, action: str, allow_other_base: bool
) -> None:
    differing = recorded.differences(current)
    if not differing:
        return
    message = (
        f"{_OWNER}(checkpoint={current.path!r}): {what} was trained over {recorded.describe()}, and this base"
        f" {current.describe()} differs in its {' and '.join(differing)}"
    )
    if allow_other_base:
        rank_zero_warn(f"{message}; going on over this base, as `allow_other_base=True` asks.")
        return
    raise MisconfigurationException(
        f"{message}: the model would not be the one trained. Give `checkpoint={recorded.path!r}` (the base it was"
        f" trained on), or `allow_other_base=True` to {action} over this base anyway."
    )


__all__ = ["adapter_settings", "check_adapter_base", "check_resumed_base", "module_record"]
