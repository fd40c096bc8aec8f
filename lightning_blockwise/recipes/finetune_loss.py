"""``CausalLMFineTune``'s loss of a batch: the model's own or chunked; a packed batch checked against its attention."""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel
from torch import Tensor

from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from lightning_blockwise.recipes.packing import check_packed_attention, is_packed


def batch_loss(
    model: PeftModel, batch: dict[str, Tensor], loss_chunk_tokens: int | None, attention_tile_tokens: int | None
) -> Tensor:
    """The causal-LM loss of ``batch`` (labels -100 where nothing is learned), as the recipe's steps compute it.

    Args:
        model: The recipe's model.
        batch: The whole batch, for the model (a packed one's ``position_ids`` and ``use_cache=False`` included).
        loss_chunk_tokens: The module's ``loss_chunk_tokens``.
        attention_tile_tokens: The module's ``attention_tile_tokens``.

    Raises:
        MisconfigurationException: If ``batch`` is packed and the attention is tiled, or cannot keep its examples
            apart.
    """
    if is_packed(batch):
        if attention_tile_tokens is not None:
            raise MisconfigurationException(
                f"CausalLMFineTune(attention_tile_tokens={attention_tile_tokens}): packed batches need a mask"
                " that keeps their examples apart, and tiled attention computes plain causal attention without one"
                " (NOTE [ Tiled attention ] in longcontext/attention.py). Turn off the data module's `packing`, or"
                " set attention_tile_tokens to None."
            )
        try:
            check_packed_attention(model)
        except ValueError as error:
            raise MisconfigurationException(
                f"CausalLMFineTune: {error} Load the model with `attn_implementation='sdpa'` (or 'eager'), or"
                " turn off the data module's `packing`."
            ) from None
    # The whole batch goes to the model: a packed one's `position_ids` and `use_cache=False` included.
    if loss_chunk_tokens is None:
        return model(**batch).loss
    return chunked_causal_lm_loss(model, chunk_tokens=loss_chunk_tokens, **batch).loss


__all__ = ["batch_loss"]
