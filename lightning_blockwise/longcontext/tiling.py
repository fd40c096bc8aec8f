"""Sequence-tiled MLPs: each decoder layer's MLP runs on ``tile_tokens`` tokens at a time, recomputed per tile."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_blockwise.architectures import find_decoder_stack

# NOTE [ Tiled MLP ]
# At long context one layer's recompute and backward are what is left on the device once the
# layer inputs are offloaded and the loss is chunked, and the MLP's intermediates are most of
# it (``tokens x intermediate`` elements each, several alive at once: 72B at 32k tokens, ~17 GB
# for one layer, ``benchmarks/layer_working_set.py``). An MLP acts on each token alone, so it
# can run tile by tile along the sequence; each tile runs under activation checkpointing, so
# only its input is kept and its intermediates exist for one tile at a time, in the forward
# and again in the backward (as Arctic/ALST-style long-sequence training tiles its MLPs).
#
# Tiles change the matmuls' shapes, and the GPU may pick other kernels and summation orders for
# them: a tiled MLP is not bit-identical to an untiled one. So it is the module's choice, like
# the chunked loss (NOTE [ Chunked loss ] in loss.py): tile the model in the module, for every
# strategy, and blockwise == resident holds for that module. Dropout inside a tile replays
# under checkpointing's RNG restore.

#: Default tokens per MLP tile: at 72B (intermediate 29568) one tile's intermediates are ~0.24 GB each.
DEFAULT_TILE_TOKENS = 4096


class TiledMLP:
    """The forward installed on one MLP (an instance attribute; the class is untouched)."""

    def __init__(self, mlp: nn.Module, tile_tokens: int) -> None:
        self.mlp = mlp
        self.tile_tokens = tile_tokens
        self._forward = type(mlp).forward

    def __call__(self, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """The MLP of ``hidden`` (``..., tokens, hidden``), ``tile_tokens`` tokens (over all rows) at a time."""
        tokens = hidden.shape[:-1].numel()
        if hidden.dim() < 2 or tokens <= self.tile_tokens:
            return self._forward(self.mlp, hidden, *args, **kwargs)
        rows = hidden.reshape(tokens, hidden.shape[-1])
        outputs = [self._tile(tile, *args, **kwargs) for tile in rows.split(self.tile_tokens)]
        return torch.cat(outputs).reshape(*hidden.shape[:-1], -1)

    def _tile(self, tile: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if not torch.is_grad_enabled():
            return self._forward(self.mlp, tile, *args, **kwargs)
        return checkpoint(self._forward, self.mlp, tile, *args, use_reentrant=False, **kwargs)


def tile_mlps(model: nn.Module, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Run every decoder layer's MLP ``tile_tokens`` tokens at a time (NOTE [ Tiled MLP ]).

    Call it where the module builds its model (``__init__`` or ``configure_model``), so that every
    strategy trains the same function; declare ``mlp_tile_tokens = tile_tokens`` on the
    LightningModule so that ``BlockwiseStrategy`` plans for it.

    Args:
        model: A (PEFT-wrapped) Hugging Face causal LM, or a module holding one.
        tile_tokens: Tokens per tile.

    Returns:
        How many MLPs were tiled.

    Raises:
        ValueError: If ``tile_tokens`` is below 1 or a decoder layer has no ``mlp``.
    """
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r} must be an integer of at least 1.")
    layers = find_decoder_stack(model, allow_unvalidated=True).layers
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    if any(mlp is None for mlp in mlps):
        raise ValueError(f"{type(layers[0]).__name__} has no `mlp` to tile; tile_mlps knows Llama-style layers.")
    for mlp in mlps:
        untile(mlp)
        mlp.forward = TiledMLP(mlp, tile_tokens)
    return len(mlps)


def untile(mlp: nn.Module) -> None:
    """Give an MLP its own forward back (no-op if it is not tiled)."""
    if isinstance(vars(mlp).get("forward"), TiledMLP):
        del mlp.forward


__all__ = ["DEFAULT_TILE_TOKENS", "TiledMLP", "tile_mlps", "untile"]
