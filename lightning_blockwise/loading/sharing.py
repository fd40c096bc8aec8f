"""Which process of a machine loads a base's host copy and which map it: the key a load is shared under.

See NOTE [ One host copy per machine ] in residency/shared_arena.py for the mechanism; this module says
what makes two loads the same one.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from transformers import BitsAndBytesConfig

#: Bumped when what a shared copy holds changes, so that processes of two versions never share one.
_LAYOUT_VERSION = 1


def share_key(
    path: Path,
    block_size: int,
    bnb_config: BitsAndBytesConfig | None,
    compute_dtype: torch.dtype,
    pre_quantized: bool,
) -> str:
    """What a load's host copy is shared under: the checkpoint (its files' sizes and times) and every setting.

    Two loads share a copy only if the same files, unchanged, load with the same block size, 4-bit settings (none:
    dense) and dtype; ``bind_shared_block`` still compares every block's bytes. The files are listed, not opened: a
    load that does not fit the host RAM is refused before any shard is read.
    """
    parts: list[object] = [_LAYOUT_VERSION, path.resolve(), block_size, compute_dtype, pre_quantized]
    parts.append("dense" if bnb_config is None else bnb_config.to_json_string(use_diff=False))
    for file in sorted(path.resolve().glob("*.safetensors*")):
        stat = file.stat()
        parts += [file, stat.st_size, stat.st_mtime_ns]
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def share_enabled(share: bool) -> bool:
    """Whether a load shares its copy: asked for, and arenas live in a memfd (Linux)."""
    return share and hasattr(os, "memfd_create")


def run_scope() -> str:
    """What names this run among the processes of the machine: its rendezvous address (``MASTER_ADDR:MASTER_PORT``).

    A copy shared under a key that ends in it is shared by this run's ranks only (``BlockwiseStrategy``'s
    ``share_host_copy=None``), never with another job that loads the same base.
    """
    return f"run/{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def scoped(key: str, scope: str | None) -> str:
    """``key`` narrowed to the processes that share with the same ``scope`` (``None``: any process of this user)."""
    return key if scope is None else f"{key}/{scope}"


__all__ = ["run_scope", "scoped", "share_enabled", "share_key"]
