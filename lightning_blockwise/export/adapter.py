"""Writing a trained adapter to disk so that a crash or a second run never destroys a good one."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from peft import PeftModel

from lightning_blockwise.export.leftovers import clean_leftovers, scratch_directory
from lightning_blockwise.export.model_card import CONFIG_KEY, COPIED_FILES
from lightning_blockwise.export.shards import INDEX_FILE, SINGLE_FILE
from lightning_blockwise.export.trained_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from lightning_blockwise.export.training_record import TRAINING_RECORD, TrainingRecord, write_training_record

# The files of a PEFT adapter directory an export or a fine-tuning run writes (PEFT adds a model card, we the
# training record: NOTE [ The training record of an adapter ] in export/training_record.py).
_ADAPTER_FILES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS, "adapter_model.bin", "README.md", TRAINING_RECORD})
# The files of a merged model an export writes, besides its shards.
_MODEL_FILES = frozenset({"config.json", "README.md", SINGLE_FILE, INDEX_FILE, *COPIED_FILES})
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# What the staging and retired directories of a target are called (NOTE [ Cleaning what is ours ] in leftovers.py).
_STAGING, _RETIRED = ".partial", ".old"

# NOTE [ Atomic adapter export ]
# The adapter is the product of a run. It is written into a temporary directory beside the
# target and renamed into place only once complete, so a crash mid-write leaves the previous
# adapter (or nothing) at the target, never a half-written one. A target that already holds
# files is refused unless the caller asks to overwrite, and that refusal is checked when the
# run starts (`check_export_target`), not when it ends: no run may die at its end with its
# work unsaved. If the target fills up during the run anyway, the adapter goes to a fresh
# sibling directory with a warning instead of being lost. `lightning-blockwise export` writes a
# merged model the same way (`staged_directory`).
#
# Replacing is for exports only: `overwrite` replaces a directory that holds a previous export (the
# files an adapter or a merged model is made of, and for a model the record in its `config.json`:
# `previous_export`), never another one (a base checkpoint, a run directory), and no target may be,
# contain or lie inside an input of the export. A kill leaves the staging directory behind; the next
# export beside it removes it (NOTE [ Cleaning what is ours ] in leftovers.py).


def check_export_target(
    target: str | Path,
    overwrite: bool,
    owner: str,
    overwrite_hint: str = "`overwrite_adapter=True`",
    inputs: Sequence[str | Path] = (),
) -> None:
    """Refuse, before training, a target directory that would be overwritten without being asked to.

    Also removes what killed exports to ``target`` left beside it (NOTE [ Cleaning what is ours ] in
    leftovers.py).

    Args:
        target: Where the adapter will be written.
        overwrite: Whether replacing a previous export there is wanted.
        owner: Who exports, for the message (e.g. ``"CausalLMFineTune(adapter_dir=...)"``).
        overwrite_hint: How ``owner``'s caller allows replacing, for the message (e.g. ``"`--overwrite`"``).
        inputs: What the export reads (adapter, base), which ``target`` must not be, contain or lie inside.

    Raises:
        MisconfigurationException: If ``target`` overlaps an input, is a file, or is a non-empty directory
            and ``overwrite`` is off, or holds anything but a previous export.
    """
    path = Path(target)
    for source in inputs:
        overlap = _overlap(path, Path(source))
        if overlap is not None:
            raise MisconfigurationException(
                f"{owner}: the output {path} {overlap} the input {source}, which the export would destroy."
                " Write the export to a directory of its own."
            )
    if path.exists() and not path.is_dir():
        raise MisconfigurationException(f"{owner}: {path} is a file, not a directory to write the adapter into.")
    clean_export_leftovers(path)
    if not _holds_files(path):
        return
    if not overwrite:
        raise MisconfigurationException(
            f"{owner}: {path} already holds files, which the export would replace. Choose another"
            f" directory, empty it, or allow replacing it ({overwrite_hint})."
        )
    if previous_export(path) is None:
        raise MisconfigurationException(f"{owner}: {_not_an_export(path)} Choose another directory.")


# NOTE [ A resume cleans its run's export ]
# A run killed while it exported leaves its staging directory beside its adapter directory
# (`version_0/.adapter.<host>-<pid>.<random>.partial`), for the next export there to remove (NOTE [ Cleaning what is
# ours ] in leftovers.py). But a resumed run without `adapter_dir` exports into its own log directory, and
# Lightning's logger gives it a new version (`version_1`): nothing would export to `version_0` again, and the
# leftover, as large as the adapter, stayed forever. So a `CausalLMFineTune` checkpoint records where its run
# exports, and a resume from it cleans there as well (:func:`clean_export_leftovers`).


def clean_export_leftovers(target: str | Path) -> list[Path]:
    """Remove what killed exports to ``target`` left beside it, and return it.

    Only the staging and retired directories of this user's processes of this host that are gone (NOTE [ Cleaning
    what is ours ] in leftovers.py).
    """
    path = Path(target)
    return [entry for kind in (_STAGING, _RETIRED) for entry in clean_leftovers(path.parent, f".{path.name}", kind)]


def previous_export(path: str | Path) -> str | None:
    """What export ``path`` holds: ``"adapter"``, ``"model"`` (merged), or ``None`` (anything else, or nothing).

    A directory is an export only if every entry in it is a file an export writes: a PEFT adapter's, or a
    merged model's whose ``config.json`` records the merge (a base checkpoint's does not).
    """
    path = Path(path)
    try:
        entries = list(path.iterdir())
    except OSError:
        return None
    if not entries or any(entry.is_symlink() or not entry.is_file() for entry in entries):
        return None
    names = {entry.name for entry in entries}
    if ADAPTER_CONFIG in names and names <= _ADAPTER_FILES:
        return "adapter"
    if "config.json" in names and all(name in _MODEL_FILES or _SHARD.fullmatch(name) for name in names):
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return "model" if isinstance(config, dict) and CONFIG_KEY in config else None
    return None


def export_adapter(
    model: PeftModel,
    target: str | Path,
    overwrite: bool = False,
    *,
    compute_dtype: str | torch.dtype | None = None,
    record: TrainingRecord | None = None,
) -> Path:
    """Save ``model``'s PEFT adapter to ``target`` atomically (NOTE [ Atomic adapter export ]).

    Args:
        model: The PEFT model whose adapter to save.
        target: The directory to create (or, with ``overwrite``, replace).
        overwrite: Replace an adapter already at ``target``.
        compute_dtype: The dtype the base was loaded in for training, recorded beside the adapter so that
            ``export --merge`` quantizes the base as training did (NOTE [ The training record of an adapter ] in
            export/training_record.py); ``None`` writes no record, and a merge then warns.
        record: The whole training record (compute dtype, NF4 or dense, the base's identity), written instead of
            ``compute_dtype`` alone.

    Returns:
        Where the adapter was written: ``target``, or a fresh sibling if ``target`` gained files
        during the run and ``overwrite`` is off, or holds anything but a previous export.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if _holds_files(target) and not (overwrite and previous_export(target) is not None):
        fallback = target.with_name(f"{target.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        why = "holds files that are not a previous export" if overwrite else "gained files during the run"
        rank_zero_warn(f"{target} {why}; the adapter goes to {fallback} instead of replacing them.")
        target = fallback
    with staged_directory(target) as staging:
        # The embeddings are frozen; saying so also skips PEFT's look-up of the base's config on the Hub.
        model.save_pretrained(staging, save_embedding_layers=False)
        if record is not None or compute_dtype is not None:
            write_training_record(staging, record if record is not None else compute_dtype)
    return target


@contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """A temporary directory beside ``target`` that replaces it when the block ends without an error.

    NOTE [ Atomic adapter export ]: whatever the block writes appears at ``target`` all at once,
    replacing what was there; if the block raises, the staging directory is removed and ``target``
    is left as it was. Refusing to replace files is the caller's decision (:func:`check_export_target`), but
    a ``target`` that holds anything other than a previous export is never replaced.

    Args:
        target: The directory to create or replace; its parent is created if needed.

    Yields:
        The staging directory to write into (on the same file system as ``target``, so the final rename
        is atomic).

    Raises:
        MisconfigurationException: If ``target`` holds files of anything but a previous export when the block ends.
    """
    target = Path(target)
    staging = scratch_directory(target.parent, f".{target.name}", _STAGING)
    try:
        yield staging
        if _holds_files(target) and previous_export(target) is None:
            # The last line of defence: whatever was checked before the work, only an export is replaced.
            raise MisconfigurationException(f"staged_directory: {_not_an_export(target)}")
        if target.exists():
            retired = scratch_directory(target.parent, f".{target.name}", _RETIRED)
            os.replace(target, retired / target.name)
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _holds_files(path: Path) -> bool:
    return path.is_dir() and any(path.iterdir())


def _not_an_export(path: Path) -> str:
    shown = sorted(entry.name for entry in path.iterdir())
    listed = ", ".join(shown[:5]) + (", ..." if len(shown) > 5 else "")
    return (
        f"{path} holds files that are not a previous export ({listed});"
        " replacing is only for a directory that holds what an export wrote (an adapter, or a merged model)."
    )


def _overlap(target: Path, source: Path) -> str | None:
    """How ``target`` overlaps ``source`` (``"is"``, ``"contains"``, ``"lies inside"``), or ``None``."""
    target, source = target.resolve(), source.resolve()
    if target == source:
        return "is"
    if target in source.parents:
        return "contains"
    if source in target.parents:
        return "lies inside"
    return None


__all__ = ["check_export_target", "clean_export_leftovers", "export_adapter", "previous_export", "staged_directory"]
