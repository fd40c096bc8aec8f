"""What a block-major window refuses, and the errors that say so.

A window runs its micro-batches layer by layer (NOTE [ Block-major accumulation ] in block_major.py),
which cannot keep the order of random numbers, carry a gradient below the decoder, or carry one from
an intermediate hidden state; each is refused here with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# NOTE [ What a block-major window refuses ]
# What a window cannot replay: random numbers in another order. Sequentially, micro-batch 1's
# draws come after micro-batch 0's whole step; here they would come after micro-batch 0's layer
# 0 only. So a layer that draws (dropout > 0) is refused: each layer's run, and the code between
# layers, is checked to leave the generators as it found them. Of the other places that may
# draw, the batches read ahead (a data pipeline in this process), the code before the decoder
# and the code after it, any one alone keeps its order; two of them drawing would interleave
# differently and are refused. Callbacks' draws in Lightning's own thread are not checked (they
# run at the same points of the loop, but with other micro-batches' code moved around them).
# The decoder's input gradient is not propagated (a trainable parameter before the decoder is
# refused; an input that only requires grad, as PEFT's k-bit preparation makes it, is fine).


class WindowError(RuntimeError):
    """A block-major window could not run; the message says why and what to change."""


class Intermediate(torch.autograd.Function):
    """A decoder layer's output inside a window, other than the last: a gradient reaching it is refused.

    The layers below the last run without a graph (NOTE [ Block-major accumulation ] in block_major.py), so a loss on an
    intermediate hidden state (``output_hidden_states``) would lose its gradient; this node makes that an error.
    """

    @staticmethod
    def forward(ctx: Any, layer: int, k: int, output: Tensor, anchor: Tensor) -> Tensor:  # type: ignore[override]
        """Pass ``output`` on as a view, remembering which layer and micro-batch it belongs to."""
        ctx.layer, ctx.k = layer, k
        ctx.set_materialize_grads(False)
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[None, ...]:
        """Refuse a gradient that reached the layer's output."""
        if grad is not None:
            raise WindowError(
                f"BlockwiseStrategy(block_major_accumulation=True): the loss of micro-batch {ctx.k} depends on the"
                f" output of decoder layer {ctx.layer} (`output_hidden_states`?), whose gradient a block-major window"
                " does not carry; use only the decoder's last output, or set `block_major_accumulation=False`."
            )
        return (None,) * 4


def refuse_trainable_before(hidden: Tensor) -> None:
    """Refuse a decoder input that trainable parameters feed: its gradient is not propagated.

    A tensor that merely requires a gradient (``enable_input_require_grads``, as PEFT's
    ``prepare_model_for_kbit_training`` sets on the embedding's output) has no parameter behind it.
    """
    if isinstance(hidden, nn.Parameter):
        raise WindowError(_TRAINABLE_BEFORE)
    seen, todo = set(), [hidden.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(getattr(node, "variable", None), nn.Parameter):
            raise WindowError(_TRAINABLE_BEFORE)
        todo.extend(next_node for next_node, _ in node.next_functions)


_TRAINABLE_BEFORE = (
    "BlockwiseStrategy(block_major_accumulation=True): trainable parameters feed the decoder's input (e.g. a"
    " trainable embedding, `modules_to_save=['embed_tokens']`); block-major accumulation does not propagate the"
    " gradient below the decoder. Freeze them, or set `block_major_accumulation=False`."
)


def draws_message(where: str) -> str:
    """The refusal of random numbers drawn at ``where`` (NOTE [ What a block-major window refuses ])."""
    return (
        f"BlockwiseStrategy(block_major_accumulation=True): {where} drew random numbers (dropout > 0?). Block-major"
        " accumulation runs a window's micro-batches layer by layer, which would change the order of their random"
        " numbers; set the adapters' and the model's dropout to 0, or set `block_major_accumulation=False`."
    )


__all__ = ["Intermediate", "WindowError", "draws_message", "refuse_trainable_before"]
