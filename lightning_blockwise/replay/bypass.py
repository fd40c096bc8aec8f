"""Gradients that reach a rematerialized layer's output other than through the next layer: refused, with the fix."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor


# NOTE [ Gradients that bypass the next layer ]
# Under resident training the gradient of a decoder layer's output is summed in one buffer from
# everything that read it: the next layer's modules (its norm, its residual add) and anything else,
# e.g. a loss on `output_hidden_states` (transformers records them with a forward hook on each layer)
# or on what a user's hook on the layer kept. Here the next layer's contributions are summed inside its
# recompute first, and the other ones are added to that sum afterwards: another order of the same
# floating-point sum, so the adapter gradients differ in the last bits (issue 25). The recompute cannot
# take the other terms into its own sum, since they arrive in the outer backward's buffer, which only
# the layer below sees. So the layer below checks that what it receives is the very tensor the next
# layer handed down, and refuses anything else at the first backward; a hidden state that is only
# observed (logged, detached) adds nothing and passes. It checks the gradient as it arrived, before
# the tensor hooks a user registered on the output (`register_hook` on the hidden states; the strategy's
# own hook comes first and notes it): such a hook acts on the summed gradient under resident training,
# and here on the very tensor the next layer handed down, the same bits, so what it returns (a new
# gradient included) is as exact as what it observes (issue 41 found them blamed on
# `output_hidden_states`).
def note_arrival(arrival: dict[str, Tensor], grad: Tensor) -> None:
    """The tensor hook that keeps the gradient of a layer's output as it arrived, before the user's hooks."""
    arrival["grad"] = grad


def refuse_a_bypass(ctx: Any, grad_output: Tensor) -> None:
    """Refuse a layer's backward whose gradient is not the very tensor the next layer handed down."""
    handed = getattr(ctx, "handed", None)
    ctx.handed = None
    arrived = getattr(ctx, "arrival", {}).pop("grad", grad_output)
    if handed is None or arrived is handed:
        return
    index = ctx.remat.index
    raise MisconfigurationException(
        f"BlockwiseStrategy: the loss depends on the output of decoder layer {index} other than through decoder layer"
        f" {index + 1} (e.g. `output_hidden_states=True` with intermediate hidden states in the loss, or a forward hook"
        f" on the layer that keeps its output for a loss term). A rematerialized layer sums that gradient in another"
        " order than resident training, so the adapter gradients would differ in the last bits (NOTE [ Gradients"
        " that bypass the next layer ]). Leave intermediate hidden states out of the loss (detach them if they are"
        " metrics; the last one, after the final norm, is fine), or train this module with `strategy='auto'`."
    )


__all__ = ["note_arrival", "refuse_a_bypass"]
