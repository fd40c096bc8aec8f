"""What a merge takes from the adapter's training record, what from the flags, and what it warns or refuses about.

NOTE [ The training record of an adapter ] in export/training_record.py: the base is loaded for the merge as
training loaded it (NF4 or dense, in its compute dtype), and only the base training used is merged into.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.export.trained_adapter import TrainedAdapter
from lightning_blockwise.export.training_record import dtype_name
from lightning_blockwise.loading.base_identity import base_identity

_OWNER = "lightning-blockwise export"
# How far up the stack the warnings point: past this module and `plan_merge`'s context manager, at `export`'s caller.
_STACKLEVEL = 5


@dataclass(frozen=True)
class MergeSettings:
    """How a merge loads the base, and where each setting comes from, in words.

    Attributes:
        compute_dtype: The dtype to load (and quantize) the base in.
        compute_dtype_origin: Where it comes from (``"recorded with the adapter"``, ...).
        quantize: Whether the trained function's base is NF4 (``False``: the dense weights, cast to the dtype).
        quantize_origin: Where that comes from.
    """

    compute_dtype: torch.dtype
    compute_dtype_origin: str
    quantize: bool
    quantize_origin: str


def merge_settings(adapter: TrainedAdapter, compute_dtype: str | None, quantize: bool | None) -> MergeSettings:
    """The settings the flags and the adapter's record decide together: a flag wins, the record fills in.

    Args:
        adapter: The adapter.
        compute_dtype: ``--compute-dtype``, ``None`` if not given.
        quantize: ``--nf4-base`` (``True``) or ``--dense-base`` (``False``), ``None`` if neither was given.
    """
    recorded = adapter.compute_dtype
    if compute_dtype is None:
        dtype, origin = (
            (recorded, "recorded with the adapter")
            if recorded is not None
            else (torch.bfloat16, "the default: the adapter records none")
        )
    else:
        dtype = getattr(torch, compute_dtype)
        origin = "--compute-dtype"
        if recorded is not None and recorded != dtype:
            origin = f"--compute-dtype, not the {dtype_name(recorded)} recorded with the adapter"
    if quantize is None:
        if adapter.quantize is None:
            return MergeSettings(dtype, origin, True, "NF4: the adapter does not record its base's format")
        return MergeSettings(dtype, origin, adapter.quantize, "recorded with the adapter")
    flag = "--nf4-base" if quantize else "--dense-base"
    if adapter.quantize is not None and adapter.quantize != quantize:
        return MergeSettings(dtype, origin, quantize, f"{flag}, not the base format recorded with the adapter")
    return MergeSettings(dtype, origin, quantize, flag)


def warn_settings(
    adapter: TrainedAdapter,
    compute_dtype: str | None,
    quantize: bool | None,
    settings: MergeSettings,
    pre_quantized: bool,
    base: Path,
) -> None:
    """Warn where the merge loads the base otherwise than the adapter says training did; refuse what cannot be.

    Args:
        adapter: The adapter.
        compute_dtype: ``--compute-dtype`` as given.
        quantize: The base-format flag as given.
        settings: :func:`merge_settings`'s result.
        pre_quantized: Whether the base checkpoint is saved in NF4.
        base: The base, for the messages.

    Warns:
        UserWarning: When the base is quantized in a compute dtype the adapter does not record, or loaded in
            another format or dtype than the record's because a flag asked for it.

    Raises:
        MisconfigurationException: If a dense-trained adapter is to be merged into a base saved in NF4 without
            ``--nf4-base``: its dense weights are not there.
    """
    if not settings.quantize and pre_quantized:
        raise MisconfigurationException(
            f"{_OWNER}: {adapter.source} was trained over a dense base, but {base} is saved in NF4, whose weights are"
            " not the dense ones. Give the unquantized checkpoint it was trained on, or --nf4-base to merge into the"
            " NF4 weights anyway (not the model that was trained)."
        )
    if quantize is not None and adapter.quantize is not None and quantize != adapter.quantize:
        trained = "dense" if not adapter.quantize else "NF4"
        warnings.warn(
            f"{_OWNER}: {adapter.source} was trained over the {trained} base, and"
            f" {'--nf4-base' if quantize else '--dense-base'} merges it into the {'NF4' if quantize else 'dense'} one,"
            f" as asked: the merged model is not the one trained. Leave the flag out to merge what was trained.",
            UserWarning,
            stacklevel=_STACKLEVEL,
        )
    if pre_quantized:
        return  # a base saved in NF4 is merged from its own bytes, which no compute dtype changes
    recorded = adapter.compute_dtype
    if recorded is None and compute_dtype is None:
        warnings.warn(
            f"{_OWNER}: {adapter.source} does not record the compute dtype it was trained with (an adapter saved by"
            f" PEFT alone, or by an older lightning-blockwise), so the base is loaded in"
            f" {dtype_name(settings.compute_dtype)}. The {'NF4 bytes' if settings.quantize else 'weights'}, and so the"
            " merged model, depend on it: if training used another (`CausalLMFineTune(compute_dtype=...)`), give it"
            " as --compute-dtype; if it trained over a dense base (`quantize=False`), give --dense-base.",
            UserWarning,
            stacklevel=_STACKLEVEL,
        )
    elif recorded is not None and recorded != settings.compute_dtype:
        warnings.warn(
            f"{_OWNER}: --compute-dtype {compute_dtype} differs from the {dtype_name(recorded)} that {adapter.source}"
            " was trained with; the base is loaded in other"
            f" {'NF4 bytes' if settings.quantize else 'weights'} than training's, so the merged model is not the one"
            " trained. Leave --compute-dtype out to merge what was trained.",
            UserWarning,
            stacklevel=_STACKLEVEL,
        )


def check_base(adapter: TrainedAdapter, base: Path, allow_other_base: bool) -> None:
    """Refuse a base other than the one the adapter records (NOTE [ The identity of a base ]).

    An adapter that records no identity is only compared by path, with a warning (what it always did).

    Args:
        adapter: The adapter.
        base: The base checkpoint directory given.
        allow_other_base: Merge into another base anyway (``--allow-other-base``), with a warning.

    Raises:
        MisconfigurationException: If the recorded identity's config or weights differ from ``base``'s and
            ``allow_other_base`` is off.
    """
    recorded = adapter.base_identity
    if recorded is None:
        _warn_other_path(adapter.trained_on, base)
        return
    try:
        given = base_identity(base)
    except ValueError:
        return  # the plan's checks of the base say what is wrong with it
    differing = recorded.differences(given)
    if not differing:
        return
    what = (
        f"{adapter.source} was trained over {recorded.describe()}, and BASE {given.describe()} differs in its"
        f" {' and '.join(differing)}"
    )
    if not allow_other_base:
        raise MisconfigurationException(
            f"{_OWNER}: {what}: the export would not be the model that was trained. Give the base it was trained on,"
            " or --allow-other-base to merge into this one anyway."
        )
    warnings.warn(f"{_OWNER}: {what}; merging into it as --allow-other-base asks.", UserWarning, stacklevel=3)


def _warn_other_path(trained_on: str | None, base: Path) -> None:
    """Warn when the adapter names another base than ``base``: shapes and names match, but the weights may not."""
    if trained_on is None or Path(trained_on).expanduser().resolve() == base.expanduser().resolve():
        return
    warnings.warn(
        f"{_OWNER}: the adapter was trained on `{trained_on}`, and BASE is `{base}`. Their shapes and names match;"
        " if BASE is another checkpoint (an instruct and a base model, say), the export is not the model that was"
        " trained. The model card records both paths.",
        UserWarning,
        stacklevel=4,
    )


__all__ = ["MergeSettings", "check_base", "merge_settings", "warn_settings"]
