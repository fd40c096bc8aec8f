"""A causal-LM loss that never holds the full-vocabulary logits: the head and cross-entropy by row chunks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

# NOTE [ Chunked loss ]
# Hugging Face's causal-LM forward builds the logits of every token (N x V in bf16), and its
# loss upcasts them to fp32 and keeps log-softmax's fp32 output for the backward: at 16k
# tokens and a 152k vocabulary that is about 30 GB, more than a 72B base streamed. Here the
# decoder runs as usual up to its last hidden states; only the rows that have a label are
# kept, and the head, its fp32 upcast and the cross-entropy run on ``chunk_tokens`` of them
# at a time under activation checkpointing (the backward recomputes each chunk's logits), so
# at most one chunk's logits exist at once.
#
# It is not bit-identical to Hugging Face's loss: the head's matmul runs with other shapes
# (the GPU may pick other kernels and summation orders) and the sum over tokens adds chunk
# sums. So it is the module's choice, made once for every strategy: a module that uses it
# trains with it under ``strategy="auto"`` as under ``"blockwise"``, and the exactness
# contract (blockwise == resident, bit for bit) holds for that module. The measured
# deviation from Hugging Face's loss is in docs/long-context.md.
#
# NOTE [ One gradient write per chunk ]
# The chunks are ``split`` from the labelled hidden states, not sliced: a slice's backward writes its
# chunk's gradient into a new zero-filled tensor of the whole hidden states' size, and autograd sums
# those, so n chunks cost n full-size allocations, fills and additions (at 16k tokens, a 7B shape's
# chunks of 1024: 16 of 117 MB each). ``split``'s backward concatenates the chunks' gradients once.
# The values are the same: each element of the sum was its own chunk's gradient plus zeros, which
# is that gradient exactly (but for a zero's sign, which the backward of the rows' gather, an
# addition into zeros, erases in both; tests/longcontext/test_loss.py compares both with ``torch.equal``).

#: Label of a position that is not learned (Hugging Face's and torch's ``ignore_index``).
IGNORE_INDEX = -100
#: Default rows of logits built at a time: 1024 x 152k x 12 B is ~1.9 GB at the chunk's peak
#: (4096 measured 7.5 GB of a 10 GB peak at 7B and 16k tokens on the H100).
DEFAULT_CHUNK_TOKENS = 1024
# Config entries that change the logits in ways this loss does not reproduce.
_UNSUPPORTED_LOGIT_SETTINGS = ("logit_scale", "logits_scaling", "output_multiplier_scale")


@dataclass
class ChunkedLossOutput:
    """What :func:`chunked_causal_lm_loss` returns: the loss, and no logits.

    Attributes:
        loss: The mean cross-entropy over labelled tokens (fp32).
        num_tokens: The labelled tokens it averages over.
    """

    loss: Tensor
    num_tokens: int

    @property
    def logits(self) -> Tensor:
        """Never built: reading them raises (see NOTE [ Chunked loss ] in loss.py)."""
        raise AttributeError(
            "ChunkedLossOutput has no logits: the chunked loss never builds the full-vocabulary logits (that is its"
            " point). Call the model itself (`model(input_ids=...)`) where you need logits, e.g. under"
            " `torch.no_grad()` for a few tokens."
        )


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, Any]:
    """The decoder (up to the final norm), the LM head and the config of a (PEFT-wrapped) causal LM.

    Raises:
        ValueError: If the model has no decoder/head pair this loss understands.
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
    if head is None or decoder is None or decoder is lm:
        raise ValueError(
            f"{type(lm).__name__} has no separate decoder and LM head (`get_decoder()`, `get_output_embeddings()`),"
            " which the chunked loss runs apart. Use a Hugging Face *ForCausalLM model, or the model's own loss."
        )
    config = lm.config
    text_config = getattr(config, "text_config", None) or config
    unsupported = [n for n in _UNSUPPORTED_LOGIT_SETTINGS if getattr(text_config, n, None) not in (None, 1, 1.0)]
    if unsupported:
        raise ValueError(
            f"{type(lm).__name__} scales its logits ({', '.join(unsupported)}), which the chunked loss does not"
            " reproduce. Use the model's own loss."
        )
    return decoder, head, text_config


def chunked_causal_lm_loss(
    model: nn.Module,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    num_items_in_batch: int | Tensor | None = None,
    **kwargs: Any,
) -> ChunkedLossOutput:
    """The causal-LM loss of ``model`` on a batch, built ``chunk_tokens`` rows of logits at a time.

    The same quantity as Hugging Face's ``model(input_ids, labels=labels).loss`` (labels shifted
    by one inside, ``-100`` not learned, the mean over labelled tokens, or the sum over
    ``num_items_in_batch``), computed without the full logits (NOTE [ Chunked loss ]). Use it
    for every strategy the module trains under, so that runs compare like with like.

    Args:
        model: A Hugging Face causal LM, PEFT-wrapped or not.
        input_ids: Token ids, ``(batch, seq)``.
        labels: Targets aligned with ``input_ids`` (shifted inside), ``-100`` where nothing is learned.
        attention_mask: Hugging Face's attention mask.
        chunk_tokens: Rows of logits built at a time.
        num_items_in_batch: Divide the summed loss by this instead of the labelled tokens of the batch
            (gradient accumulation over batches of different lengths, as Hugging Face's loss).
        kwargs: Passed to the decoder (``position_ids``, ...).

    Returns:
        The loss (no logits: reading ``.logits`` raises and says why).

    Raises:
        ValueError: If ``chunk_tokens`` is below 1, or the model is not a causal LM this loss understands.

    Example::

        def training_step(self, batch, batch_idx):
            return chunked_causal_lm_loss(self.model, **batch).loss
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens!r} must be an integer of at least 1.")
    decoder, head, config = causal_lm_parts(model)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
    targets = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    rows = targets.ne(IGNORE_INDEX).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    targets = targets.index_select(0, rows)
    softcap = getattr(config, "final_logit_softcapping", None)
    total = hidden.new_zeros((), dtype=torch.float32)
    # Split, not sliced: NOTE [ One gradient write per chunk ]. (No rows would split into one empty chunk.)
    chunks = zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True) if rows.numel() else ()
    for part, part_targets in chunks:
        total = total + checkpoint(_chunk_loss, head, part, part_targets, softcap, use_reentrant=False)
    if rows.numel() == 0:
        # No labelled token: a zero loss that still reaches the parameters (Hugging Face's mean would be nan).
        total = total + hidden.sum() * 0
    divisor = max(rows.numel(), 1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(divisor, Tensor):
        divisor = divisor.to(total.device)
    return ChunkedLossOutput(loss=total / divisor, num_tokens=int(rows.numel()))


def _chunk_loss(head: nn.Module, hidden: Tensor, targets: Tensor, softcap: float | None) -> Tensor:
    logits = head(hidden)
    if softcap is not None:
        # As Gemma 2 and 3 cap their logits, before the loss's upcast.
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


__all__ = ["DEFAULT_CHUNK_TOKENS", "IGNORE_INDEX", "ChunkedLossOutput", "causal_lm_parts", "chunked_causal_lm_loss"]
