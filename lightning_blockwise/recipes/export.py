"""Writing a trained adapter to disk so that a crash or a second run never destroys a good one."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from peft import PeftModel

# NOTE [ Atomic adapter export ]
# The adapter is the product of a run. It is written into a temporary directory beside the
# target and renamed into place only once complete, so a crash mid-write leaves the previous
# adapter (or nothing) at the target, never a half-written one. A target that already holds
# files is refused unless the caller asks to overwrite, and that refusal is checked when the
# run starts (`check_export_target`), not when it ends: no run may die at its end with its
# work unsaved. If the target fills up during the run anyway, the adapter goes to a fresh
# sibling directory with a warning instead of being lost. `lightning-blockwise export` writes a
# merged model the same way (`staged_directory`).


def check_export_target(
    target: str | Path, overwrite: bool, owner: str, overwrite_hint: str = "`overwrite_adapter=True`"
) -> None:
    """Refuse, before training, a target directory that would be overwritten without being asked to.

    Args:
        target: Where the adapter will be written.
        overwrite: Whether replacing an existing adapter there is wanted.
        owner: Who exports, for the message (e.g. ``"CausalLMFineTune(adapter_dir=...)"``).
        overwrite_hint: How ``owner``'s caller allows replacing, for the message (e.g. ``"`--overwrite`"``).

    Raises:
        MisconfigurationException: If ``target`` is a file, or a non-empty directory and ``overwrite`` is off.
    """
    path = Path(target)
    if path.exists() and not path.is_dir():
        raise MisconfigurationException(f"{owner}: {path} is a file, not a directory to write the adapter into.")
    if not overwrite and _holds_files(path):
        raise MisconfigurationException(
            f"{owner}: {path} already holds files, which the export would replace. Choose another"
            f" directory, empty it, or allow replacing it ({overwrite_hint})."
        )


def export_adapter(model: PeftModel, target: str | Path, overwrite: bool = False) -> Path:
    """Save ``model``'s PEFT adapter to ``target`` atomically (NOTE [ Atomic adapter export ]).

    Args:
        model: The PEFT model whose adapter to save.
        target: The directory to create (or, with ``overwrite``, replace).
        overwrite: Replace an adapter already at ``target``.

    Returns:
        Where the adapter was written: ``target``, or a fresh sibling if ``target`` gained files
        during the run and ``overwrite`` is off.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and _holds_files(target):
        fallback = target.with_name(f"{target.name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        rank_zero_warn(
            f"{target} gained files during the run; the adapter goes to {fallback} instead of replacing them."
        )
        target = fallback
    with staged_directory(target) as staging:
        # The embeddings are frozen; saying so also skips PEFT's look-up of the base's config on the Hub.
        model.save_pretrained(staging, save_embedding_layers=False)
    return target


@contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """A temporary directory beside ``target`` that replaces it when the block ends without an error.

    NOTE [ Atomic adapter export ]: whatever the block writes appears at ``target`` all at once,
    replacing what was there; if the block raises, the staging directory is removed and ``target``
    is left as it was. Refusing to replace files is the caller's decision (:func:`check_export_target`).

    Args:
        target: The directory to create or replace; its parent is created if needed.

    Yields:
        The staging directory to write into (on the same file system as ``target``, so the final rename
        is atomic).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        yield staging
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
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


__all__ = ["check_export_target", "export_adapter", "staged_directory"]
