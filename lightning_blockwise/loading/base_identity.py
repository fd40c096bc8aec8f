"""Which base a checkpoint directory holds: a hash of its ``config.json`` and a digest of a few of its tensors.

Example::

    identity = base_identity("/models/Qwen2.5-7B")
    identity.differences(base_identity("/models/Qwen2.5-7B-Instruct"))  # ["weights"]
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NOTE [ The identity of a base ]
# An adapter or a checkpoint must say which base it was trained over, so that a merge, a generation or a resume
# over another base of the same shapes (an instruct and a base model, another fine-tune) is refused rather than
# computing another function silently. A path says nothing (bases move, and one path can be re-downloaded with
# other weights), and the blockwise fingerprint (NOTE [ Lean checkpoints ] in strategy/checkpointing.py) hashes the
# loaded, quantized tensors: it needs the base loaded and depends on the quantization. The identity here is read
# from the files alone, in milliseconds at any size: the SHA-256 of `config.json` (the keys that name where the
# model came from left out), and a SHA-256 of a few tensors' names, dtypes, shapes and bytes read straight from the
# safetensors files (each file's header gives every tensor's byte range; three windows of each sampled tensor are
# read, never the whole). The sampled tensors are spread evenly over the sorted names, so the digest does not
# depend on how the checkpoint is sharded. Two bases that differ only outside every window would be taken for one:
# fine-tunes change every tensor a window lands in, and nothing here is a defence against a crafted file.

#: Config entries that name where a model came from or what wrote it, not what it is.
_CONFIG_NOISE = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")
#: How many tensors the weight digest samples, and the bytes read at each of three places in each.
_SAMPLED_TENSORS = 32
_WINDOW_BYTES = 4096
_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class BaseIdentity:
    """What identifies a base checkpoint (NOTE [ The identity of a base ]).

    Attributes:
        config_sha256: The hash of its ``config.json`` without the entries that name where it came from.
        weights_sha256: The digest of a sample of its safetensors tensors; ``None`` where the base has no weights
            of its own (``random_init``) or none in safetensors.
        path: Where the base was, for messages only (never compared).
    """

    config_sha256: str
    weights_sha256: str | None
    path: str | None = None

    def differences(self, other: BaseIdentity) -> list[str]:
        """What differs from ``other``: ``"config"`` and/or ``"weights"`` (weights only where both have a digest)."""
        differing = []
        if self.config_sha256 != other.config_sha256:
            differing.append("config")
        if None not in (self.weights_sha256, other.weights_sha256) and self.weights_sha256 != other.weights_sha256:
            differing.append("weights")
        return differing

    def describe(self) -> str:
        """One line for messages: the path and the hashes' first digits."""
        weights = "none" if self.weights_sha256 is None else f"{self.weights_sha256[:12]}..."
        return f"`{self.path}` (config {self.config_sha256[:12]}..., weights {weights})"

    def to_dict(self) -> dict[str, Any]:
        """The identity as plain JSON values (what records and checkpoints store)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Any) -> BaseIdentity:
        """The identity :meth:`to_dict` wrote.

        Raises:
            ValueError: If ``saved`` is not such a dict.
        """
        if not isinstance(saved, dict) or not isinstance(saved.get("config_sha256"), str):
            raise ValueError(f"not a base identity: {saved!r}")
        weights, path = saved.get("weights_sha256"), saved.get("path")
        if not isinstance(weights, (str, type(None))) or not isinstance(path, (str, type(None))):
            raise ValueError(f"not a base identity: {saved!r}")
        return cls(saved["config_sha256"], weights, path)


def base_identity(path: str | Path, with_weights: bool = True) -> BaseIdentity:
    """The identity of the base checkpoint directory ``path`` (NOTE [ The identity of a base ]).

    Args:
        path: A local Hugging Face checkpoint directory (``config.json``, safetensors weights).
        with_weights: ``False``: the config alone (a ``random_init`` base, whose weights are not the files').

    Raises:
        ValueError: If ``path`` has no readable ``config.json``, or a safetensors file or index is corrupt.
    """
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path / 'config.json'} cannot be read as JSON ({error}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object.")
    settings = {key: value for key, value in config.items() if key not in _CONFIG_NOISE}
    config_sha256 = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    weights = _weights_digest(path) if with_weights else None
    return BaseIdentity(config_sha256, weights, str(path.expanduser().resolve()))


def _weights_digest(path: Path) -> str | None:
    files = _tensor_files(path)
    if not files:
        return None
    headers = {file: _header(file) for file in set(files.values())}
    names = sorted(files)
    step = max(1, len(names) / _SAMPLED_TENSORS)
    sampled = sorted({names[min(len(names) - 1, int(i * step))] for i in range(_SAMPLED_TENSORS)} | {names[-1]})
    digest = hashlib.sha256()
    for name in sampled:
        file = files[name]
        start_of_data, header = headers[file]
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise ValueError(f"{file} does not hold `{name}`, which its index says it does.")
        begin, end = (start_of_data + offset for offset in entry["data_offsets"])
        digest.update(f"{name}|{entry['dtype']}|{entry['shape']}|".encode())
        with open(file, "rb") as handle:
            for at in sorted(
                {begin, max(begin, (begin + end) // 2 - _WINDOW_BYTES // 2), max(begin, end - _WINDOW_BYTES)}
            ):
                handle.seek(at)
                digest.update(handle.read(min(_WINDOW_BYTES, end - at)))
    return digest.hexdigest()


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it; empty where the base has none."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{index} is not a safetensors index ({error}).") from None
        return {name: path / file for name, file in weight_map.items()}
    single = path / _SINGLE_FILE
    if not single.is_file():
        return {}
    return {name: single for name in _header(single)[1] if name != "__metadata__"}


def _header(file: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data starts, and its JSON header (each tensor's dtype, shape, byte range)."""
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise ValueError(f"{file} is not a safetensors file ({error}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object).")
    return 8 + length, header


__all__ = ["BaseIdentity", "base_identity"]
