"""Scratch directories a killed process can leave behind: named for their process, removed at the next start."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from lightning_blockwise.compat.processes import host_name, process_exists, writer_tag

# NOTE [ Cleaning what is ours ]
# A SIGKILL runs no ``finally``: the staging directory of an export (NOTE [ Atomic adapter export ] in
# export.py) or the demo's temporary checkpoint stays on disk, as large as the adapter or the model. Each
# such directory is named ``<name>.<host>-<pid>.<random><suffix>``, and the next process that makes one
# beside it removes those whose process is gone: of this host (a pid means nothing on another one that
# shares the file system), no longer running (a reused pid keeps a leftover until that process ends: the
# safe direction), and owned by this user. A directory of a process still running is never touched, so
# two runs that write beside each other keep their own.


def scratch_directory(parent: str | Path, name: str, suffix: str) -> Path:
    """Make a new directory ``<name>.<host>-<pid>.<random><suffix>`` in ``parent`` (mode 0700), after cleaning.

    Leftovers of dead processes with the same ``name`` and ``suffix`` are removed first (NOTE [ Cleaning what
    is ours ]).

    Args:
        parent: The directory to make it in (created if need be).
        name: What the directory is for, e.g. ``".adapter"`` (a leading dot hides it).
        suffix: What kind of scratch it is, e.g. ``".partial"``.

    Returns:
        The new directory.
    """
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(parent, name, suffix)
    return Path(tempfile.mkdtemp(prefix=f"{name}.{writer_tag()}.", suffix=suffix, dir=parent))


def clean_leftovers(parent: str | Path, name: str, suffix: str) -> list[Path]:
    """Remove the directories :func:`scratch_directory` made in ``parent`` for processes that are gone.

    Returns:
        What was removed.
    """
    parent = Path(parent)
    pattern = re.compile(rf"{re.escape(name)}\.(?P<host>.+)-(?P<pid>\d+)\.[^.]+{re.escape(suffix)}")
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed  # nothing there yet, or not ours to read
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match["host"] != host_name() or process_exists(int(match["pid"])):
            continue
        try:
            info = entry.lstat()
        except OSError:
            continue  # another process cleaned it meanwhile
        if entry.is_symlink() or not entry.is_dir() or info.st_uid != os.getuid():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


__all__ = ["clean_leftovers", "scratch_directory"]
