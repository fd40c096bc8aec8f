"""Which process of a machine loads a base's host copy and which map it: the key a load is shared under.

See NOTE [ One host copy per machine ] in residency/shared_arena.py for the mechanism; this module says
what makes two loads the same one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import BitsAndBytesConfig

from lightning_blockwise.residency.shared_arena import ArenaClaim, claim

#: How long a process waits for another one to finish loading the copy it shares (a 72B base loads in
#: about 20 s from a warm page cache on the H100 machine; a cold disk takes minutes).
SHARE_TIMEOUT_S = 3600.0
#: Bumped when what a shared copy holds changes, so that processes of two versions never share one.
_LAYOUT_VERSION = 1


def share_key(
    path: Path,
    files: Iterable[Path],
    block_size: int,
    bnb_config: BitsAndBytesConfig,
    compute_dtype: torch.dtype,
    pre_quantized: bool,
) -> str:
    """What a load's host copy is shared under: the checkpoint (its files' sizes and times) and every setting.

    Two loads share a copy only if the same files, unchanged, load with the same block size, 4-bit settings and
    dtype; ``bind_shared_block`` still compares every block's bytes.
    """
    parts: list[object] = [_LAYOUT_VERSION, path.resolve(), block_size, compute_dtype, pre_quantized]
    parts.append(bnb_config.to_json_string(use_diff=False))
    for file in sorted({Path(f).resolve() for f in files}):
        stat = file.stat()
        parts += [file, stat.st_size, stat.st_mtime_ns]
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def claim_load(key: str, share: bool) -> ArenaClaim | None:
    """This process's claim on the copy ``key`` names, or ``None`` when it keeps a copy of its own.

    A copy is shared only where arenas live in a memfd (Linux) and ``share`` asks for it.
    """
    if not share or not hasattr(os, "memfd_create"):
        return None
    return claim(key)


__all__ = ["SHARE_TIMEOUT_S", "claim_load", "share_key"]
