"""What a blockwise checkpoint holds: the trainable state, a fingerprint of the frozen base, the RNG states.

The frozen base is every tensor of the Hugging Face model that training does not change: the
decoder layers' frozen tensors (NF4 packed weights and their quantization statistics, norms,
biases), and the frozen input embedding, final norm and LM head. The checkpoint directory the
model was loaded from already holds them, so by default a checkpoint leaves them out
(NOTE [ Lean checkpoints ]) and records a fingerprint of the base instead, to refuse a
checkpoint resumed over another base.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

# What a checkpoint needs from bitsandbytes' state-dict entries; importable from here as before.
from lightning_blockwise.compat.bitsandbytes import is_saved_quantization_metadata as is_quantization_metadata
from lightning_blockwise.compat.bitsandbytes import saved_nested_offsets
from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.residency.binding import views
from lightning_blockwise.residency.layout import BlockLayout

#: The checkpoint key under which the strategy keeps what it adds to Lightning's checkpoint.
CHECKPOINT_KEY = "blockwise"

#: Bumped when what is stored under ``CHECKPOINT_KEY`` changes meaning.
FORMAT_VERSION = 1

# Bytes sampled per tensor for the fingerprint: enough that two different bases (another seed,
# other trained weights) differ in some sampled byte, few enough that a 72B base takes a second.
_SAMPLES_PER_TENSOR = 4096

# Config entries that name where a model came from, not what it is.
_CONFIG_NOISE = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")

# NOTE [ Lean checkpoints ]
# A checkpoint of a blockwise run keeps what training changes (trainable parameters, whatever the
# module holds outside the Hugging Face model, optimizer, schedulers, loops, callbacks) and leaves
# out the frozen base: at 72B that is ~40 GB a checkpoint that the base's own directory already
# has. In its place it records `base_fingerprint`: a hash of the model config and of a strided
# sample of every frozen tensor's bytes, so a lean checkpoint resumed over another base (same
# shapes, other weights) is refused instead of silently training a different model. With
# `save_frozen_base=True` the file is self-contained: every frozen tensor once, read from the host
# copy (never a device slot: NOTE [ One storage per slab entry ] in residency/binding.py), written
# straight to disk so that nothing of the base is copied in host memory.


@dataclass(frozen=True)
class BaseKeys:
    """Which keys of a LightningModule's ``state_dict`` are the frozen base, and which are trained.

    Attributes:
        frozen: Keys of the Hugging Face model's frozen tensors (bitsandbytes' quantization
            statistics included).
        trainable: Keys of parameters that require grad, anywhere in the module.
    """

    frozen: frozenset[str]
    trainable: frozenset[str]

    @classmethod
    def of(cls, module: nn.Module, base_model: nn.Module) -> BaseKeys:
        """Sort ``module``'s state-dict keys; ``base_model`` is the Hugging Face model inside it."""
        prefix = next(name for name, sub in module.named_modules(remove_duplicate=False) if sub is base_model)
        base = base_model.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True)
        trainable = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        return cls(frozen=frozenset(base) - trainable, trainable=frozenset(trainable))


def base_fingerprint(config: Any, tensors: Iterable[Tensor]) -> str:
    """A hash of a model config and of a strided byte sample of each frozen tensor, in order.

    Args:
        config: The Hugging Face model's config (where the model was loaded from is ignored).
        tensors: The frozen base's tensors, in state-dict order (read where they are: a device
            tensor has only its sampled bytes copied).

    Returns:
        A hex digest.
    """
    settings = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for tensor in tensors:
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        flat = (
            tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)
        )
        count = min(flat.numel(), _SAMPLES_PER_TENSOR)
        if count:
            index = torch.linspace(0, flat.numel() - 1, count, dtype=torch.float64).long()
            digest.update(flat[index.to(flat.device)].cpu().numpy().tobytes())
    return digest.hexdigest()


class HostViews:
    """The host-arena view of every decoder-layer frozen tensor, found from wherever it is bound now.

    A streamed block may be bound to a device slot when a checkpoint is written; the host
    arena is the authoritative copy (and the only one a full-state checkpoint should read or a
    full-state load should write). Tensors are matched by the address of their first byte.

    Args:
        layouts: Every block's layout.
        slabs: Every block's slab in the host arena.
    """

    def __init__(self, layouts: Iterable[BlockLayout], slabs: Iterable[Tensor]) -> None:
        self._by_address: dict[int, Tensor] = {}
        for layout, slab in zip(layouts, slabs, strict=True):
            for entry, view in zip(layout.entries, views(layout, slab), strict=True):
                for binding in entry.bindings:
                    self._by_address[binding.current().data_ptr()] = view

    def get(self, tensor: Tensor) -> Tensor | None:
        """The host view of ``tensor`` if it is a decoder layer's frozen tensor, else ``None``."""
        view = self._by_address.get(tensor.data_ptr()) if tensor.numel() else None
        if view is None or view.dtype != tensor.dtype or view.shape != tensor.shape:
            return None
        return view


class FrozenBase:
    """The frozen base of a module set up for blockwise training, as checkpoints see it.

    Knows which state-dict keys are the base (:class:`BaseKeys`), its fingerprint, and how to
    read and write its decoder tensors in the host copy (:class:`HostViews`). Built after the
    decoder layers were packed into the arena and before any block is bound to the device.

    Args:
        module: The LightningModule.
        base_model: The Hugging Face model inside it.
        layouts: Every block's layout.
        slabs: Every block's slab in the host arena.
    """

    def __init__(
        self, module: nn.Module, base_model: nn.Module, layouts: Iterable[BlockLayout], slabs: Iterable[Tensor]
    ) -> None:
        self.module = module
        self.base_model = base_model
        self._layouts = list(layouts)
        self._slabs = list(slabs)
        self.keys = BaseKeys.of(module, base_model)
        self.fingerprint = self._fingerprint()

    def checkpoint_state(self, state: dict[str, Any], include_base: bool) -> dict[str, Any]:
        """``module.state_dict()`` as a checkpoint holds it (NOTE [ Lean checkpoints ])."""
        if not include_base:
            return {key: value for key, value in state.items() if key not in self.keys.frozen}
        host = self._host()
        return {key: _prefer(host.get(value), value) for key, value in state.items()}

    def checkpoint_meta(self, include_base: bool) -> dict[str, Any]:
        """What a checkpoint records under :data:`CHECKPOINT_KEY`: the format, the base, the RNG states now.

        Args:
            include_base: Whether the checkpoint carries the frozen base (``save_frozen_base``).
        """
        return {
            "format_version": FORMAT_VERSION,
            "frozen_base": include_base,
            "base_fingerprint": self.fingerprint,
            # NOTE [ Exact resume ] in replay/rng.py.
            "rng": GlobalRngState.capture().state_dict(),
        }

    def take_checkpoint(self, checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Check a checkpoint against this base and write its frozen decoder tensors into the host copy.

        Returns:
            The rest of its state dict, to load into the module as usual, and whether it carried
            the base (then call :meth:`refresh` after that load).

        Raises:
            ValueError: If the checkpoint is of another base or lacks trainable parameters
                (:meth:`check_loadable`), or a frozen tensor's dtype or shape differs.
        """
        meta = checkpoint.get(CHECKPOINT_KEY) or {}
        state = dict(checkpoint["state_dict"])
        has_base = self.has_base(state)
        self.check_loadable(state, meta.get("base_fingerprint"))
        return (self.load_into_host(state) if has_base else state), has_base

    def mismatch(self, missing_keys: Iterable[str], unexpected_keys: Iterable[str]) -> str | None:
        """Why a ``load_state_dict(strict=False)`` result does not match the module, or ``None``.

        Missing frozen-base keys are expected (NOTE [ Lean checkpoints ]).
        """
        missing = [key for key in missing_keys if key not in self.keys.frozen]
        unexpected = list(unexpected_keys)
        if not (missing or unexpected):
            return None
        return (
            f"the checkpoint does not match the module: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}."
            " Set `strict_loading = False` on the module to load what matches."
        )

    def has_base(self, state: Mapping[str, Any]) -> bool:
        """Whether a checkpoint's state dict carries (some of) the frozen base."""
        return any(key in self.keys.frozen for key in state)

    def check_loadable(self, state: Mapping[str, Any], saved_fingerprint: str | None) -> None:
        """Refuse a lean checkpoint of another base, and one that lacks trainable parameters.

        Raises:
            ValueError: With the reason and the fix.
        """
        if not self.has_base(state) and saved_fingerprint is not None and saved_fingerprint != self.fingerprint:
            raise ValueError(
                f"the checkpoint was written over another frozen base (its fingerprint {saved_fingerprint[:12]}..."
                f" differs from this model's {self.fingerprint[:12]}...: another config, other weights or another"
                " quantization). Load the base the checkpoint was trained on, or save checkpoints with"
                " `BlockwiseStrategy(save_frozen_base=True)` to carry the base along."
            )
        missing = sorted(self.keys.trainable - state.keys())
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} trainable parameters of the module (e.g. `{missing[0]}`), which"
                " would start again from their initial values. Resume with the adapter configuration (targets,"
                " rank) the checkpoint was trained with."
            )

    def load_into_host(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Write a checkpoint's frozen decoder tensors into the host copy; return the rest to load as usual.

        The host arena is the only authoritative copy of the decoder layers' frozen tensors, so they
        are written there, never into a device slot a block happens to be bound to. bitsandbytes'
        metadata entries are consumed (the nested offsets they carry included). Call
        :meth:`refresh` once the rest is loaded.

        Raises:
            ValueError: If a tensor's dtype or shape differs from the module's.
        """
        current = self.module.state_dict(keep_vars=True)
        host = self._host()
        rest = {}
        for key, value in state.items():
            target = current.get(key) if key in self.keys.frozen else None
            view = None if target is None else host.get(target)
            if view is None:
                if not is_quantization_metadata(key):
                    rest[key] = value
                continue
            if value.dtype != view.dtype or value.shape != view.shape:
                raise ValueError(
                    f"the checkpoint's `{key}` is {value.dtype} {tuple(value.shape)}, the module's {view.dtype}"
                    f" {tuple(view.shape)}. Build the module with the checkpoint's architecture and quantization."
                )
            view.copy_(value)
        for offset, saved in saved_nested_offsets(self.module, state):
            view = host.get(offset)
            if view is not None:
                view.copy_(saved)
        return rest

    def refresh(self) -> None:
        """Fingerprint the base again, after :meth:`load_into_host` and the load of the rest changed it."""
        self.fingerprint = self._fingerprint()

    def _host(self) -> HostViews:
        return HostViews(self._layouts, self._slabs)

    def _fingerprint(self) -> str:
        host = self._host()
        state = self.module.state_dict(keep_vars=True)
        tensors = [_prefer(host.get(t), t) for key, t in state.items() if key in self.keys.frozen]
        return base_fingerprint(self.base_model.config, tensors)


def check_checkpoint_file(path: str | Path | None) -> None:
    """Refuse a ``ckpt_path`` that is not a Lightning checkpoint, naming the file and the problem.

    Run before any model work: torch and Lightning otherwise fail deep inside the load (``OSError: [Errno 22]``,
    ``EOFError``, ``KeyError: 101``) or only after the base is packed (a file without Lightning's keys). The file
    is opened memory-mapped, so a full-state checkpoint is not read into memory here.

    Args:
        path: The ``ckpt_path`` given to ``fit``/``validate``/...; ``None``: nothing to check (URLs: Lightning).

    Raises:
        MisconfigurationException: If the file is missing, empty, truncated, not a ``torch.save`` file, or holds no
            Lightning checkpoint.
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
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as error:  # Any failure to read it is the file's problem: said with its name.
        raise MisconfigurationException(f"`ckpt_path` {str(path)!r} cannot be read: {error!r}. {fix}") from None
    missing = [key for key in _LIGHTNING_KEYS if not (isinstance(checkpoint, Mapping) and key in checkpoint)]
    if missing:
        found = list(checkpoint)[:5] if isinstance(checkpoint, Mapping) else type(checkpoint).__name__
        raise MisconfigurationException(
            f"`ckpt_path` {str(path)!r} is not a Lightning checkpoint: it lacks {missing} (it holds {found}; a bare"
            f" `state_dict` or an adapter file?). {fix}"
        )


# What every checkpoint Lightning writes for training holds.
_LIGHTNING_KEYS = ("state_dict", "global_step", "pytorch-lightning_version")


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
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.{_writer_tag()}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
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
    host = _host()
    for entry in directory.glob(".*.tmp"):
        match = _TEMPORARY.match(entry.name)
        if match is None or match["host"] != host or _alive(int(match["pid"])):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        removed.append(entry)
    return removed


def _host() -> str:
    # Dots and dashes would blur the name's fields.
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


def _writer_tag() -> str:
    return f"{_host()}-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


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


def _prefer(first: Tensor | None, second: Any) -> Any:
    return second if first is None else first


__all__ = [
    "CHECKPOINT_KEY",
    "FORMAT_VERSION",
    "BaseKeys",
    "FrozenBase",
    "HostViews",
    "base_fingerprint",
    "check_checkpoint_file",
    "is_quantization_metadata",
    "remove_stale_temporaries",
    "save_unbuffered",
    "saved_nested_offsets",
]
