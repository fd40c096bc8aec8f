"""Query-tiled attention: each decoder layer attends ``tile_tokens`` queries at a time, each tile recomputed alone."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lightning_blockwise.architectures import find_decoder_stack

# NOTE [ Tiled attention ]
# With the layer inputs offloaded, the loss chunked and the MLP tiled, the largest single block of a
# long step is attention's: SDPA's backward (flash or efficient kernel, C++ autograd) allocated 4.02
# hidden-sized bf16 tensors at once over the whole sequence (H100, Qwen2.5-7B shape, 65k tokens; at
# 262k tokens that block was 7.03 GiB and the step did not fit a 22 GiB cap). Attention is causal, so
# the queries [s, e) need the keys and values [0, e) only: here the queries run ``tile_tokens`` at a
# time, each tile against its key prefix with a causal mask aligned lower-right (query s + i sees keys
# 0 .. s + i), and the outputs are concatenated along the sequence. Each tile runs under activation
# checkpointing, so what a tile's backward allocates for its queries exists for one tile at a time.
# What scales with the keys does not shrink: a tile's key and value gradients (with grouped-query
# attention, flash's backward expands them to every query head) are over its prefix, the whole
# sequence for the last tile. And each tile's forward runs again in the backward: one more attention
# forward per step, which at long context is most of a layer's compute.
#
# The mask is `torch.nn.attention.bias.causal_lower_right`, which SDPA dispatches to flash's causal
# kernel (lower-right in that kernel) or the efficient kernel's lower-right mask on CUDA, with
# `enable_gqa` so that the keys and values are never repeated to every head. transformers' own sdpa
# function is what runs a sequence within one tile, unchanged; the tiles call SDPA directly because
# that function repeats the keys and values for any explicit mask on CUDA (`use_gqa_in_sdpa`), which
# would bring back sequence-sized key and value copies and their gradients.
#
# It is installed the way transformers switches attention: a function registered in its
# `AttentionInterface` (and sdpa's mask function under the same name in `AttentionMaskInterface`, so
# that transformers builds exactly the masks it builds for sdpa, where an unknown name would get
# none: a padding mask dropped in silence), selected on the model instance with
# `set_attn_implementation`; other models in the process keep theirs. Supported: causal
# self-attention with no mask (transformers passes none for a causal batch without padding), no
# attention dropout, no cache longer than the queries. A tiled call that has anything else (a padding
# mask, a sliding window or packed sequences' positions, which make transformers pass one) is refused
# with the fix, never run untiled in silence.
#
# Tiles change the shapes of attention's matmuls and its reductions, so the output is not bit-identical
# to untiled attention: like the chunked loss and the tiled MLP (NOTE [ Tiled MLP ] in tiling.py), it is
# the module's choice, made for every strategy, and blockwise == resident holds for that module.

#: Default queries per tile: at the Qwen2.5-7B shape one tile's query-sized backward block is ~0.47 GB.
DEFAULT_TILE_TOKENS = 16384
#: transformers' attention implementation that tiled attention wraps.
WRAPPED_IMPLEMENTATION = "sdpa"
# The registered name of one tile size ("sdpa" in it: transformers then checks the model supports sdpa).
_PREFIX = "lightning_blockwise_tiled_sdpa_"
_UNTILE = "`untile_attention(model)` (or `CausalLMFineTune(attention_tile_tokens=None)`)"


class TiledSDPA:
    """transformers' ``sdpa`` attention with the queries run ``tile_tokens`` at a time (NOTE [ Tiled attention ]).

    One instance per tile size, registered in transformers' ``AttentionInterface`` under :attr:`name`.
    """

    def __init__(self, tile_tokens: int) -> None:
        self.tile_tokens = tile_tokens

    @property
    def name(self) -> str:
        """The attention implementation name this tile size is registered and selected under."""
        return f"{_PREFIX}{self.tile_tokens}"

    def __call__(
        self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
    ) -> tuple[Tensor, None]:
        """Attention as transformers' attention functions compute it: ``(batch, tokens, heads, head_dim)``, no weights.

        Raises:
            ValueError: If a sequence longer than one tile comes with what the tiles do not compute (a mask, attention
                dropout, a cache, non-causal attention, a softcap or position bias), naming the fix.
        """
        sdpa = ALL_ATTENTION_FUNCTIONS[WRAPPED_IMPLEMENTATION]
        if query.shape[2] <= self.tile_tokens:
            return sdpa(module, query, key, value, attention_mask, **kwargs)
        self._check(module, query, key, attention_mask, kwargs)
        outputs, end = [], 0
        for tile in query.split(self.tile_tokens, dim=2):
            end += tile.shape[2]
            keys, values = key[:, :, :end], value[:, :, :end]
            if torch.is_grad_enabled():
                out = checkpoint(_attend, tile, keys, values, kwargs.get("scaling"), use_reentrant=False)
            else:
                out = _attend(tile, keys, values, kwargs.get("scaling"))
            outputs.append(out.transpose(1, 2))
        # Contiguous (batch, tokens, heads, head_dim), as transformers' sdpa function returns it.
        return torch.cat(outputs, dim=1), None

    def _check(
        self, module: nn.Module, query: Tensor, key: Tensor, attention_mask: Tensor | None, kwargs: dict[str, Any]
    ) -> None:
        where = f"tile_attention(model, {self.tile_tokens}): a sequence of {query.shape[2]} tokens"
        if attention_mask is not None:
            raise ValueError(
                f"{where} came with an attention mask, and tiled attention computes plain causal attention only."
                " transformers passes a mask for padding, packed sequences (position_ids that restart) and sliding"
                " windows shorter than the sequence. Train on rows without padding (every row the full length,"
                " attention_mask all ones or none) and without packing, or turn tiling off with"
                f" {_UNTILE}."
            )
        if kwargs.get("dropout", 0.0):
            raise ValueError(
                f"{where} came with attention dropout {kwargs['dropout']}, which tiled attention does not apply."
                " Set each decoder layer's `self_attn.attention_dropout = 0.0` (or the config's `attention_dropout`"
                f" before building the model), or turn tiling off with {_UNTILE}."
            )
        is_causal = kwargs.get("is_causal")
        if not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
            raise ValueError(f"{where} is non-causal attention; tiled attention is causal only. Use {_UNTILE}.")
        if key.shape[2] != query.shape[2]:
            raise ValueError(
                f"{where} came with {key.shape[2]} keys (a cache): tiled attention is for training, queries and keys"
                f" of one sequence. Pass `use_cache=False`, or use {_UNTILE} to generate."
            )
        unsupported = [name for name in ("softcap", "position_bias") if kwargs.get(name) is not None]
        if unsupported:
            raise ValueError(
                f"{where} came with {', '.join(unsupported)}, which tiled attention does not compute. Use {_UNTILE}."
            )


def _attend(query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
    """Causal SDPA of one query tile against its key prefix, the mask aligned lower-right (NOTE [ Tiled attention ])."""
    bias = causal_lower_right(query.shape[2], key.shape[2])
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=bias, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
    )


def tile_attention(model: nn.Module, tile_tokens: int = DEFAULT_TILE_TOKENS) -> int:
    """Run every decoder layer's attention ``tile_tokens`` queries at a time (NOTE [ Tiled attention ]).

    Call it where the module builds its model (``__init__`` or ``configure_model``), so that every strategy trains
    the same function; declare ``attention_tile_tokens = tile_tokens`` on the LightningModule so that
    ``BlockwiseStrategy`` plans for it. Tiling again replaces the tile size; :func:`untile_attention` undoes it.
    Sequences of at most ``tile_tokens`` tokens run transformers' sdpa attention exactly as before.

    Args:
        model: A (PEFT-wrapped) Hugging Face causal LM using ``attn_implementation="sdpa"``, or a module holding one.
        tile_tokens: Queries per tile.

    Returns:
        How many attention modules run tiled.

    Raises:
        ValueError: If ``tile_tokens`` is below 1, a decoder layer has no ``self_attn``, the model's attention is not
            transformers' ``sdpa`` (or does not dispatch through ``AttentionInterface``), or it has attention dropout.

    Example::

        tile_attention(model, 16384)  # and `attention_tile_tokens = 16384` on the LightningModule
    """
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r} must be an integer of at least 1.")
    owner, attentions = _attention_owner(model)
    current = owner.config._attn_implementation
    if current != WRAPPED_IMPLEMENTATION and tiled_attention_tokens(model) is None:
        raise ValueError(
            f"tile_attention wraps transformers' sdpa attention, and this {type(owner).__name__} uses {current!r}."
            " Load it with `attn_implementation='sdpa'` (or call `model.set_attn_implementation('sdpa')`) first."
        )
    dropout = [getattr(attention, "attention_dropout", 0.0) for attention in attentions]
    if any(dropout):
        raise ValueError(
            f"tile_attention: the attention modules apply dropout ({max(dropout)}), which tiled attention does not."
            " Build the model with `attention_dropout=0.0` in its config (or set each `self_attn.attention_dropout ="
            " 0.0`)."
        )
    tiled = TiledSDPA(tile_tokens)
    ALL_ATTENTION_FUNCTIONS.register(tiled.name, tiled)
    # The masks sdpa gets (NOTE [ Tiled attention ]): without an entry transformers would build none at all.
    ALL_MASK_ATTENTION_FUNCTIONS.register(tiled.name, ALL_MASK_ATTENTION_FUNCTIONS[WRAPPED_IMPLEMENTATION])
    owner.set_attn_implementation(tiled.name)
    if owner.config._attn_implementation != tiled.name:
        # transformers only warns where a class's attention does not go through `AttentionInterface`.
        raise ValueError(
            f"tile_attention: {type(owner).__name__} does not select its attention through transformers'"
            " `AttentionInterface` (`set_attn_implementation` left it unchanged), so its attention cannot be tiled."
        )
    return len(attentions)


def untile_attention(model: nn.Module) -> None:
    """Give the model transformers' sdpa attention back (no-op if its attention is not tiled)."""
    if tiled_attention_tokens(model) is not None:
        owner, _ = _attention_owner(model)
        owner.set_attn_implementation(WRAPPED_IMPLEMENTATION)


def tiled_attention_tokens(model: nn.Module) -> int | None:
    """The queries per tile of the model's tiled attention (:func:`tile_attention`), ``None`` if untiled."""
    owner, _ = _attention_owner(model)
    name = owner.config._attn_implementation
    tiled = ALL_ATTENTION_FUNCTIONS.get(name) if isinstance(name, str) and name.startswith(_PREFIX) else None
    return tiled.tile_tokens if isinstance(tiled, TiledSDPA) else None


def _attention_owner(model: nn.Module) -> tuple[PreTrainedModel, list[nn.Module]]:
    """The outermost Hugging Face model whose config the decoder layers' attention reads, and those attentions.

    A text-only causal LM's own config; a multimodal model's text model, so that its other towers keep theirs.
    """
    stack = find_decoder_stack(model, allow_unvalidated=True)
    attentions = [getattr(layer, "self_attn", None) for layer in stack.layers]
    if any(attention is None for attention in attentions):
        raise ValueError(
            f"{type(stack.layers[0]).__name__} has no `self_attn` to tile; tile_attention knows Llama-style layers."
        )
    config = getattr(attentions[0], "config", None) or stack.model.config
    owner = next(
        (m for m in stack.model.modules() if isinstance(m, PreTrainedModel) and m.config is config), stack.model
    )
    return owner, attentions


__all__ = [
    "DEFAULT_TILE_TOKENS",
    "WRAPPED_IMPLEMENTATION",
    "TiledSDPA",
    "tile_attention",
    "tiled_attention_tokens",
    "untile_attention",
]
