"""A local checkpoint directory: its config, the safetensors file of every key, its shards opened and checked."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from safetensors import safe_open
from transformers import AutoConfig

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def load_config(path: Path) -> Any:
    """The checkpoint's config, from its directory and never from the network.

    Raises:
        MisconfigurationException: If ``path`` is not a directory holding ``config.json``.
    """
    if not path.exists():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` does not exist; pass a local Hugging Face checkpoint directory (as written by"
            " `save_pretrained`)."
        )
    if not path.is_dir():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` is a file; pass the checkpoint directory that holds it and config.json."
        )
    if not (path / "config.json").is_file():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` has no config.json; pass a local Hugging Face checkpoint directory (as written"
            " by `save_pretrained`)."
        )
    # A path transformers does not find locally must be an error, never a Hub repo id to download.
    return AutoConfig.from_pretrained(path, local_files_only=True)


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it; every file must exist.

    Raises:
        MisconfigurationException: If the directory has no safetensors weights, or its index lists missing shards.
        ValueError: If the index or the single file is corrupt.
    """
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"load_blockwise: `{index}` is not a safetensors index ({err}).") from err
        files = {key: path / name for key, name in weight_map.items()}
        missing = sorted({str(file) for file in files.values() if not file.is_file()})
        if missing:
            raise MisconfigurationException(
                f"load_blockwise: `{index}` lists shards that do not exist: {', '.join(missing)}. Download or copy the"
                " whole checkpoint."
            )
        return files
    single = path / _SINGLE_FILE
    if not single.is_file():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` has neither `{_SINGLE_FILE}` nor `{_INDEX_FILE}`. Only safetensors checkpoints"
            " are supported; convert .bin checkpoints with `save_pretrained(..., safe_serialization=True)`."
        )
    with _open_shard(single) as handle:
        return dict.fromkeys(handle.keys(), single)


@contextmanager
def open_checkpoint(files: Mapping[str, Path]) -> Iterator[dict[str, Any]]:
    """Open every shard of :func:`checkpoint_files` once, memory-mapped, for the duration of the block.

    Yields:
        Checkpoint key -> the open ``safe_open`` handle of the shard that holds it.

    Raises:
        ValueError: If a shard is corrupt or truncated.
    """
    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open_shard(file)) for file in sorted(set(files.values()))}
        yield {key: handles[file] for key, file in files.items()}


@contextmanager
def _open_shard(file: Path) -> Iterator[Any]:
    """``safe_open`` (memory-mapped) that names the file when its header or size is corrupt."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:
        # safetensors checks the header and that the data covers it: a truncated file fails here.
        raise ValueError(
            f"load_blockwise: cannot read `{file}`: {err}. The file is corrupt or truncated; download or copy it again."
        ) from err
    with handle as opened:
        yield opened
