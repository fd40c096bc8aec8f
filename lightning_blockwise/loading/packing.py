"""The host arena a load fills: each block's bytes predicted from the meta model, then each loaded block packed in."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from lightning_blockwise.residency import arena as arena_module
from lightning_blockwise.residency.arena import slab_offsets
from lightning_blockwise.residency.binding import bind, bind_checked, pack
from lightning_blockwise.residency.layout import ALIGNMENT, BlockLayout, frozen_tensors, layout_block, tensor_offsets


def block_ranges(num_layers: int, block_size: int) -> tuple[range, ...]:
    """The decoder-layer indices of each block of ``block_size`` layers (the last one may be shorter)."""
    return tuple(range(s, min(s + block_size, num_layers)) for s in range(0, num_layers, block_size))


def predict_block_bytes(layers: Sequence[nn.Module], alignment: int = ALIGNMENT) -> int:
    """The exact slab bytes of one block of a meta model: its ``layout_block(...).nbytes`` once loaded.

    The block's :func:`~lightning_blockwise.residency.walk.frozen_tensors` at their aligned offsets, every
    4-bit weight not quantized yet counted as the tensors bitsandbytes will store for it
    (NOTE [ NF4 bytes ] in compat/bitsandbytes/formats.py). Needs shapes and dtypes only, so it works
    on the meta device, before anything is read.

    Args:
        layers: The decoder layers of one block, their linears converted to ``Linear4bit`` (on the
            meta device, or loaded).
        alignment: The layout's alignment.
    """
    return tensor_offsets((tensor.nbytes for tensor in frozen_tensors(layers)), alignment)[-1]


def predict_slabs(
    path: Path, layers: nn.ModuleList, ranges: Sequence[range], check_ram: bool = True
) -> tuple[list[int], int]:
    """Each block's slab bytes and the arena's size, predicted from the meta model; refused if RAM is short.

    Args:
        path: The checkpoint directory, for the error message.
        layers: The meta model's decoder layers.
        ranges: The layer indices of each block.
        check_ram: Refuse when the arena does not fit the host RAM (not for a copy another process holds).

    Raises:
        MisconfigurationException: If the arena does not fit the available host RAM.
    """
    sizes = [predict_block_bytes([layers[i] for i in r]) for r in ranges]
    predicted = slab_offsets(sizes)[-1]
    # Read through the module, as the arena does, so that one stand-in for the host's memory serves both.
    available = arena_module.available_host_memory()
    if check_ram and predicted > available - arena_module.HOST_RAM_RESERVE:
        raise MisconfigurationException(
            f"load_blockwise: the decoder layers of `{path}` need a {predicted / 1e9:.2f} GB host arena (predicted"
            f" from config.json), but only {available / 1e9:.2f} GB of host RAM are available (keeping"
            f" {arena_module.HOST_RAM_RESERVE / 1e9:.1f} GB in reserve). Free host memory or use a machine with more"
            " RAM."
        )
    return sizes, predicted


def pack_block(layers: nn.ModuleList, layer_range: range, slab: Tensor) -> BlockLayout:
    """Lay out one loaded block, pack it into its slab and bind its layers to it.

    Raises:
        RuntimeError: If the block's bytes differ from the prediction the slab was sized by (a bug).
    """
    layout = layout_block([layers[i] for i in layer_range], first_index=layer_range[0])
    if layout.nbytes != slab.numel():
        raise RuntimeError(
            f"load_blockwise: block of layers {layer_range[0]}-{layer_range[-1]} needs {layout.nbytes} bytes"
            f" but {slab.numel()} were predicted from config.json; this is a bug, please report it."
        )
    pack(layout, slab)
    # Binding drops the block's freshly loaded host tensors: memory holds the arena plus one block.
    bind(layout, slab)
    return layout


def bind_shared_block(layers: nn.ModuleList, layer_range: range, slab: Tensor) -> BlockLayout:
    """Bind one loaded block to its slab in another process's host copy, once its bytes are checked equal.

    NOTE [ One host copy per machine ] in residency/shared_arena.py; the check is
    :func:`~lightning_blockwise.residency.binding.bind_checked`.

    Raises:
        RuntimeError: If the block's bytes differ from the shared slab's (another base or settings).
    """
    layout = layout_block([layers[i] for i in layer_range], first_index=layer_range[0])
    try:
        bind_checked(layout, slab)
    except ValueError:
        raise RuntimeError(
            f"load_blockwise: the block of layers {layer_range[0]}-{layer_range[-1]} loaded here differs from the host"
            " copy another process shares under the same checkpoint and settings; the checkpoint may have changed"
            " on disk while it loaded. Run again, or pass `share=False` to load a copy of this process's own."
        ) from None
    return layout
