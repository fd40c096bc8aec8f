"""A checkpoint file on disk: checked before a load, written atomically without a buffer in memory.

What a blockwise checkpoint holds is in checkpointing.py; this module only reads and writes the file.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import secrets
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.compat.processes import host_name, process_exists, writer_tag


def check_checkpoint_file(path: str | Path | None, weights_only: bool | None = None) -> None:
    """Refuse a ``ckpt_path`` that is not a Lightning checkpoint, naming the file and the problem.

    Run before any model work: torch and Lightning otherwise fail deep inside the load (``OSError: [Errno 22]``,
    ``EOFError``, ``KeyError: 101``) or only after the base is packed (a file without Lightning's keys). The file
    is opened memory-mapped, so a full-state checkpoint is not read into memory here, and read with
    ``weights_only=True`` (NOTE [ No code from checkpoint files ]).

    Args:
        path: The ``ckpt_path`` given to ``fit``/``validate``/...; ``None``: nothing to check (URLs: Lightning).
        weights_only: What the caller passed to ``fit``/``validate``/...: ``False`` says the user trusts the file,
            and one that a weights-only load refuses is then left to Lightning's own load; ``None`` or ``True``
            refuses it here.

    Raises:
        MisconfigurationException: If the file is missing, empty, truncated, not a ``torch.save`` file, holds objects
            a weights-only load refuses (unless ``weights_only=False``), or holds no Lightning checkpoint.
    """
    if path is None or "://" in str(path):
        return
    path = Path(path)
    fix = "Pass a checkpoint written by Lightning (e.g. by `ModelCheckpoint`), or drop `ckpt_path` to start afresh."
    if not path.is_file():
        raise MisconfigurationException(f"`ckpt_path` {str(path)!r} is not a file. {fix}")
    if path.stat().st_size == 0:
        raise MisconfigurationException(f"`ckpt_path` {str(path)!r} is empty (0 bytes): an interrupted write? {fix}")
    if not zipfile.is_zipfile(path):
        raise MisconfigurationException(
            f"`ckpt_path` {str(path)!r} ({path.stat().st_size} bytes) is not a complete `torch.save` file: it is"
            f" truncated (an interrupted copy or write) or of another format. {fix}"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        if weights_only is False:
            return  # the user vouched for the file; Lightning's own load reads it as asked
        raise MisconfigurationException(
            f"`ckpt_path` {str(path)!r} holds objects that a weights-only load refuses"
            f" ({_first_line(error)}): unpickling them could run code from the file, so it is not read. A checkpoint"
            " of this package or of plain Lightning loads weights-only; re-save this one with tensors, numbers and"
            " strings only, or, if you trust the file, pass `weights_only=False` to `fit`/`validate`/`test`/`predict`."
        ) from None
    except Exception as error:  # Any failure to read it is the file's problem: said with its name.
        raise MisconfigurationException(f"`ckpt_path` {str(path)!r} cannot be read: {error!r}. {fix}") from None
    missing = [key for key in _LIGHTNING_KEYS if not (isinstance(checkpoint, Mapping) and key in checkpoint)]
    if missing:
        found = list(checkpoint)[:5] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise MisconfigurationException(
            f"`ckpt_path` {str(path)!r} is not a Lightning checkpoint: it lacks {missing} (it holds {found}; a bare"
            f" `state_dict` or an adapter file?). {fix}"
        )


# NOTE [ No code from checkpoint files ]
# A `.ckpt` is a pickle, and unpickling runs whatever callables the file names: a crafted file given as
# `--ckpt_path` ran `os.system` in this check (then `weights_only=False`) before Lightning's own load refused it.
# So every read of a user-given file here is `weights_only=True`, whose unpickler admits tensors, containers,
# numbers and strings only; Lightning's load of a local file is weights-only by default too (torch >= 2.6), so a
# file it would accept passes here. Only an explicit `weights_only=False` from the user lets such a file through,
# to Lightning's load, unread by us.


def _first_line(error: BaseException) -> str:
    """The first line of torch's weights-only refusal (the rest is a tutorial on safe globals)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


# What every checkpoint Lightning writes for training holds.
_LIGHTNING_KEYS = ("state_dict", "global_step", "pytorch-lightning_version")


def writes_itself(checkpoint_io: Any, path: str | Path, storage_options: Any | None) -> bool:
    """Whether rank 0 writes ``path`` with :func:`save_unbuffered` rather than through ``checkpoint_io``.

    Lean and full-state checkpoints alike, where Lightning's own ``TorchCheckpointIO`` would write a local file
    (a ``CheckpointIO`` plugin of the user's writes as it wants). ``TorchCheckpointIO`` serializes into an in-memory
    buffer first, which for a full-state checkpoint would copy the whole base in host RAM; and fsspec stages the file
    in the system's temporary directory and moves it into place, which across file systems is a copy under the final
    name: a full disk left a truncated checkpoint there. Ours is written beside its final name and renamed when
    complete.
    """
    return type(checkpoint_io) is TorchCheckpointIO and storage_options is None and "://" not in str(path)


def save_unbuffered(checkpoint: Mapping[str, Any], path: Path) -> None:
    """``torch.save`` straight to a temporary file beside ``path``, then rename it into place.

    As atomic as Lightning's own write, without its in-memory buffer of the whole file (a
    full-state checkpoint would otherwise copy the base in host RAM). Temporary files that killed
    processes of this host left in the directory are removed first (NOTE [ Temporary checkpoint files ]).

    Raises:
        OSError: If the write fails, naming ``path``; ``errno.ENOSPC`` ("no space left") when the disk is full.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path.parent)
    temporary = str(path.parent / f".{path.name}.{writer_tag()}.{secrets.token_hex(4)}.tmp")
    # Mode 0o666 less the umask, as a plain `open` (Lightning's write included) gives: `mkstemp`'s 0o600 made every
    # checkpoint unreadable to the user's group.
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        torch.save(checkpoint, temporary)
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:
        raise _write_error(path, error) from error
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


# NOTE [ Temporary checkpoint files ]
# A checkpoint is written to `.NAME.<host>-<pid>.XXXXXXXX.tmp` beside its final name and renamed into
# place, so a reader never sees half a file. A process killed mid-write (SIGKILL, the OOM killer)
# leaves that file behind, as large as the checkpoint (the whole base with `save_frozen_base=True`),
# and nothing would ever remove it. So every save first removes the temporary files in its directory
# whose writer was a process of this host that no longer runs; a file of another host (a shared file
# system) or of a live process is left alone, and so is anything not named by this scheme.
_TEMPORARY = re.compile(r"^\..+\.(?P<host>[^.]+)-(?P<pid>\d+)\.[^.]+\.tmp$")


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary checkpoint files of dead writers of this host in ``directory``; return them.

    See NOTE [ Temporary checkpoint files ].
    """
    removed = []
    host = host_name()
    for entry in directory.glob(".*.tmp"):
        match = _TEMPORARY.match(entry.name)
        if match is None or match["host"] != host or process_exists(int(match["pid"])):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        removed.append(entry)
    return removed


def _write_error(path: Path, error: BaseException) -> OSError:
    """The error to raise for a failed checkpoint write: the path, and the full disk when it is one.

    torch's writer reports a full disk as ``basic_ios::clear: iostream error`` or "file write failed",
    without the path or the cause, so the free space is looked at here.
    """
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    full = getattr(error, "errno", None) == errno.ENOSPC or (free is not None and free < _NEARLY_FULL)
    if full:
        where = "" if free is None else f" ({free / 1e9:.2f} GB free)"
        return OSError(
            errno.ENOSPC,
            f"No space left on the device to write the checkpoint {path}{where}: {error}. Free space there, point"
            " the checkpoints elsewhere (`ModelCheckpoint(dirpath=...)`), keep fewer of them (`save_top_k`), or"
            " leave the frozen base out of them (`BlockwiseStrategy(save_frozen_base=False)`, the default).",
        )
    return OSError(getattr(error, "errno", None) or errno.EIO, f"Could not write the checkpoint {path}: {error}")


# Below this much free space a failed write is taken for a full disk (a file system keeps a reserve).
_NEARLY_FULL = 64 * 2**20


__all__ = ["check_checkpoint_file", "remove_stale_temporaries", "save_unbuffered", "writes_itself"]
