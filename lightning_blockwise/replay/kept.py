"""Kept layers of streamed blocks: the graph built in the forward is differentiated in the backward, not rebuilt.

The layer's forward runs once, with autograd, while its block is acquired; its graph waits for
the backward, which acquires the block again (back in the same slot) before differentiating it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.layer import ReplayedLayer
from lightning_blockwise.residency.base import Pass

# NOTE [ Kept graphs of streamed blocks ]
# A layer whose activations fit the budget need not be recomputed, even when its block
# streams. Its forward runs once under autograd and the graph is kept to the backward, as in
# resident training, but that graph reads the block in the backward: bitsandbytes'
# ``MatMul4Bit`` saves a view of the packed weight made in the forward (and reads the quant
# state's current tensors), a norm saves its weight. So the backward first acquires the
# block, which the streamer copies back into the slot it had in the forward (NOTE [ Slot
# affinity ] in residency/streamer.py): the saved views read its bytes again, and the
# rebound parameters and quant states name the same addresses. Between ``acquire`` and
# ``release`` of the backward the graph is differentiated and dropped, so the slot is not
# refilled under it (NOTE [ Slot reuse ]).
#
# The graph is built inside this Function's forward and differentiated inside its backward
# with ``torch.autograd.backward(..., inputs=...)``, as the recompute does (NOTE [ Exact
# rematerialization ] in remat.py): the adapters' gradients reach ``.grad`` through their own
# ``AccumulateGrad`` nodes, in resident training's order, and the outer graph sees one node
# per layer. Nothing is replayed: the forward ran once, drawing its random numbers where
# resident training draws them, and its graph holds what they produced (the dropout masks).


class KeptFunction(torch.autograd.Function):
    """One kept layer of a streamed block (NOTE [ Kept graphs of streamed blocks ])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        remat: ReplayedLayer,
        call: LayerCall,
        params: tuple[nn.Parameter, ...],
        hidden: Tensor,
        anchor: Tensor,
    ) -> Tensor:
        """Run the layer once under autograd while its block is acquired; keep the graph on ``ctx``."""
        wants_input_grad = hidden.requires_grad
        remat.residency.acquire(remat.index, Pass.FORWARD)
        x = hidden.detach().requires_grad_(wants_input_grad)
        with torch.enable_grad():
            output = remat.run(x, call)
        remat.residency.release(remat.index, Pass.FORWARD)
        ctx.remat, ctx.params, ctx.x, ctx.output = remat, params, x, output
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        """Acquire the block again, differentiate the kept graph: the input's gradient out, the adapters' to .grad."""
        remat: ReplayedLayer = ctx.remat
        if not hasattr(ctx, "output"):
            raise RuntimeError(
                f"BlockwiseStrategy: a second backward reached decoder layer {remat.index}, whose graph the first one"
                " consumed (a layer of a streamed block keeps its graph only to its backward: NOTE [ Kept graphs of"
                " streamed blocks ]). To backpropagate twice (`retain_graph=True`), keep graphs on resident blocks"
                " only, as the strategy's plans do: there they are plain autograd."
            )
        x: Tensor = ctx.x
        wants_input_grad = ctx.needs_input_grad[3]
        inputs = [x, *ctx.params] if wants_input_grad else list(ctx.params)
        # The block back in its forward slot before the graph reads it (NOTE [ Slot affinity ]).
        remat.residency.acquire(remat.index, Pass.BACKWARD)
        torch.autograd.backward(ctx.output, grad_output, inputs=inputs)
        # The kept graph dies here, inside the residency, as a recompute graph does.
        del ctx.output
        remat.residency.release(remat.index, Pass.BACKWARD)
        grad_input = x.grad if wants_input_grad else None
        del ctx.x
        return (None, None, None, grad_input, None)


__all__ = ["KeptFunction"]
