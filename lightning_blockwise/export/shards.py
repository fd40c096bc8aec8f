"""Safetensors shards written one tensor at a time, so that a merged model never sits whole in host memory.

:class:`ShardWriter` appends each tensor's bytes to the open shard as soon as it is computed and
starts a new shard when the next tensor would pass the size cap, as ``save_pretrained``'s
``max_shard_size`` does; :meth:`ShardWriter.finish` names the shards and writes
``model.safetensors.index.json`` the way ``from_pretrained`` reads them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

#: The single-file and index names ``from_pretrained`` looks for.
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors' dtype names.
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# The widest value a shape entry or an offset can print as (a uint64), for the header's bound.
_WIDEST = 2**64 - 1
_METADATA = {"format": "pt"}
_SEPARATORS = (",", ":")

# NOTE [ Streamed safetensors shards ]
# A safetensors file is an 8-byte header length, a JSON header that gives every tensor's dtype,
# shape and byte range, then the tensors' bytes, back to back with no holes. The header comes
# first but is only known once the shard's last tensor is computed (a re-quantized weight's
# quant-state JSON has a length that depends on its values). Collecting a shard's tensors in
# memory first would hold up to `max_shard_size` (5 GB by default) of them; writing the data to
# a side file and copying it behind the header at the end would write every byte twice. Instead
# each shard reserves room for the largest header it could need (every tensor still to be written,
# each with the widest numbers it could print), writes the tensors after that room as they come,
# and fills the header in at the end, padded with spaces, which the format allows ("the header
# MAY be trailing padded with whitespace"). The reserve is at most a few hundred bytes per tensor
# (under a megabyte for a 72B NF4 model); host memory holds one tensor at a time. Tensors are not
# aligned to their element size, as in any safetensors file whose dtypes are mixed; safetensors
# and `from_pretrained` read them either way.


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor that will be written: enough to bound its header entry and its bytes before it exists.

    Attributes:
        name: Its key in the state dict.
        ndim: Its number of dimensions.
        nbytes: Its size, or an upper bound where it depends on values (a quant-state JSON).
    """

    name: str
    ndim: int
    nbytes: int

    def header_bound(self) -> int:
        """The most bytes its entry in a safetensors header can take (NOTE [ Streamed safetensors shards ])."""
        entry = {"dtype": "BOOL", "shape": [_WIDEST] * self.ndim, "data_offsets": [_WIDEST, _WIDEST]}
        # The name and its entry, plus the comma between entries.
        return len(json.dumps({self.name: entry}, separators=_SEPARATORS)) - 2 + 1


class ShardWriter:
    """Write tensors in order into ``model-XXXXX-of-YYYYY.safetensors`` shards of at most ``max_shard_size`` bytes.

    A tensor larger than the cap gets a shard of its own, as in ``save_pretrained``. See
    NOTE [ Streamed safetensors shards ] for how a shard is written before its header is known.

    Args:
        directory: Where to write the shards (an empty staging directory).
        max_shard_size: The cap on a shard's tensor bytes.
        planned: Every tensor that will be written, in order: the headers' room is reserved from them.

    Raises:
        ValueError: If ``max_shard_size`` is not positive.

    Example::

        writer = ShardWriter(staging, 5 * 10**9, planned)
        for name, tensor in tensors:
            writer.write(name, tensor)
        writer.finish()
    """

    def __init__(self, directory: Path, max_shard_size: int, planned: Iterable[PlannedTensor]) -> None:
        if max_shard_size < 1:
            raise ValueError(f"ShardWriter: max_shard_size={max_shard_size} must be at least one byte.")
        self.directory = directory
        self.max_shard_size = max_shard_size
        self._bounds = {tensor.name: tensor.header_bound() for tensor in planned}
        self._left = sum(self._bounds.values())
        self._shards: list[Path] = []
        self._weight_map: dict[str, int] = {}
        self._file: BinaryIO | None = None
        self._header: dict[str, dict[str, object]] = {}
        self._reserve = 0
        self._offset = 0
        self.total_bytes = 0

    def write(self, name: str, tensor: Tensor) -> None:
        """Append ``tensor`` (on the CPU) to the open shard, or to a new one if it would pass the cap.

        Raises:
            KeyError: If ``name`` was not planned, or was written already.
            TypeError: If the tensor's dtype has no safetensors name.
        """
        if name not in self._bounds:
            raise KeyError(f"ShardWriter: `{name}` was not planned, or was written already; this is a bug.")
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"ShardWriter: `{name}` is {tensor.dtype}, which safetensors cannot store.")
        if self._file is None or (self._offset and self._offset + tensor.nbytes > self.max_shard_size):
            self._close_shard()
            self._open_shard()
        assert self._file is not None
        # Little-endian bytes, written from the tensor's own memory: no copy of it in host memory.
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [self._offset, self._offset + tensor.nbytes],
        }
        self._offset += tensor.nbytes
        self.total_bytes += tensor.nbytes
        self._left -= self._bounds.pop(name)
        self._weight_map[name] = len(self._shards) - 1

    def finish(self) -> list[Path]:
        """Close the last shard, give the shards their final names and write the index if there are several.

        Returns:
            The files written (shards, and the index if any).

        Raises:
            ValueError: If a planned tensor was never written.
        """
        if self._bounds:
            raise ValueError(
                f"ShardWriter: {len(self._bounds)} planned tensors were not written, e.g. {next(iter(self._bounds))}."
            )
        self._close_shard()
        count = len(self._shards)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        final = [self.directory / name for name in names]
        for shard, path in zip(self._shards, final, strict=True):
            shard.replace(path)
        if count > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {key: names[shard] for key, shard in sorted(self._weight_map.items())},
            }
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            final.append(self.directory / INDEX_FILE)
        return final

    def close(self) -> None:
        """Close the open shard's file without finishing it (after a failure; the caller removes the directory)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _open_shard(self) -> None:
        path = self.directory / f".shard-{len(self._shards):05d}.partial"
        self._shards.append(path)
        self._file = path.open("wb")
        metadata = len(json.dumps({"__metadata__": _METADATA}, separators=_SEPARATORS))
        # Rounded up to 8 bytes, so that the data starts aligned as in files safetensors writes.
        self._reserve = -(-(metadata + self._left) // 8) * 8
        self._file.seek(8 + self._reserve)
        self._header = {}
        self._offset = 0

    def _close_shard(self) -> None:
        if self._file is None:
            return
        header = json.dumps({"__metadata__": _METADATA, **self._header}, separators=_SEPARATORS).encode()
        if len(header) > self._reserve:
            raise RuntimeError(
                f"ShardWriter: the header of {self._shards[-1]} needs {len(header)} bytes but {self._reserve} were"
                " reserved; this is a bug."
            )
        self._file.seek(0)
        self._file.write(struct.pack("<Q", self._reserve))
        self._file.write(header.ljust(self._reserve, b" "))
        self._file.close()
        self._file = None


__all__ = ["INDEX_FILE", "SINGLE_FILE", "PlannedTensor", "ShardWriter"]
