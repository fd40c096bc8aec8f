"""The backward of a block-major window: the decoder differentiated block by block, every micro-batch per block.

NOTE [ Block-major accumulation ] in block_major.py says why the window's layers run without a graph and
how this recompute stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.layer import ReplayedLayer
from lightning_blockwise.replay.window_refusals import WindowError
from lightning_blockwise.residency.base import Pass

# NOTE [ Block-major windows on several ranks ]
# Under DDP Lightning runs micro-batches 0..G-2 of a window under `no_sync` and the last one
# without: that one's forward makes the reducer expect one hook per parameter (`prepare_for_backward`
# in DDP's post-forward), and its backward reduces each parameter's `.grad`, the sum of the G
# micro-batches' gradients, in buckets as the hooks come (the gradient divided by the world size,
# then summed over the ranks). Here each micro-batch's `training_step` goes through DDP's forward on
# its worker: the code before the decoder, DDP's pre-forward included, runs in micro-batch 0's call
# (under `no_sync`), the rest, DDP's post-forward included, in Lightning's call for that micro-batch,
# so the last one prepares the reducer as under DDP. (Only its `prepare_for_forward`, an iteration
# count for DDP's runtime statistics, is skipped.) The whole window's backward runs in the backward of
# that last micro-batch, where every `AccumulateGrad` node that runs fires the reducer's hook: run per
# micro-batch, a parameter would be marked ready G times and DDP stops ("marked as ready twice"). So
# the window's backward runs each parameter's node only for its last micro-batch (`hooks_once` in
# window_backward.py); the earlier micro-batches' gradients are computed with `torch.autograd.grad`
# and added to `.grad` first, as the node adds them (first kept, then added in place, in order
# 0..G-1). The reducer then reads the sum that G sequential backwards would leave, once per window,
# with the parameters in the order the per-micro-batch recompute gives them (layer by layer, last
# first), so its buckets, division and sums are DDP's own. An adapter's tensor hooks (`register_hook`)
# still see every micro-batch's gradient; hooks that run after its node (DDP's, and
# `register_post_accumulate_grad_hook`) run once per window on several ranks, G times on one device.


@dataclass
class SavedInput:
    """What a micro-batch's layer keeps for the window's backward: its input, that input's version, its call."""

    hidden: Tensor
    version: int
    call: LayerCall


def differentiate_window(
    remats: list[ReplayedLayer | None],
    saved_inputs: list[list[SavedInput | None]],
    order: list[int],
    grads: list[Tensor | None],
    hooks_once: bool = False,
) -> None:
    """Recompute and differentiate each layer, last first, for micro-batches ``order`` in that order.

    Args:
        remats: The window's decoder layers, by index.
        saved_inputs: ``saved_inputs[k][layer]``, each dropped once used.
        order: The micro-batches whose gradient reached the top of the decoder.
        grads: The gradient at the top of the decoder of each micro-batch of ``order``.
        hooks_once: Run each adapter's ``AccumulateGrad`` node for the last micro-batch of ``order`` only, and add
            the others' gradients to ``.grad`` before it as that node adds them (NOTE [ Block-major windows on
            several ranks ]); else every micro-batch's gradient goes through the node.

    Raises:
        WindowError: If a layer's saved input was modified in place after the layer ran.
    """
    for layer in reversed(range(len(remats))):
        remat = remats[layer]
        assert remat is not None
        params = [p for p in remat.params if p.requires_grad]
        remat.residency.acquire(layer, Pass.BACKWARD)
        for position, k in enumerate(order):
            saved = saved_inputs[k][layer]
            assert saved is not None
            saved_inputs[k][layer] = None
            if saved.hidden._version != saved.version:
                raise WindowError(
                    f"BlockwiseStrategy(block_major_accumulation=True): the input of decoder layer {layer} of"
                    f" micro-batch {k} was modified in place after the layer ran; the recompute would differ."
                )
            x = saved.hidden.detach().requires_grad_(layer > 0)
            with torch.enable_grad(), saved.call.autocast_context():
                output = remat.rerun(x, saved.call)
            inputs = [x, *params] if layer > 0 else params
            grad_input = None
            if inputs and hooks_once and position < len(order) - 1:
                # Not through the nodes: DDP's reducer listens on their hooks, once per window.
                found = torch.autograd.grad(output, inputs, grads[position], allow_unused=True)
                grad_input = found[0] if layer > 0 else None
                for param, grad in zip(params, found[len(inputs) - len(params) :], strict=True):
                    _add_to_grad(param, grad)
            elif inputs:
                torch.autograd.backward(output, grads[position], inputs=inputs)
                grad_input = x.grad if layer > 0 else None
            del output
            grads[position] = grad_input
        remat.residency.release(layer, Pass.BACKWARD)


def _add_to_grad(param: Tensor, grad: Tensor | None) -> None:
    """Add ``grad`` to ``param.grad`` as the parameter's ``AccumulateGrad`` node would, without running its hooks.

    The node keeps the first gradient (or a copy of it in the parameter's layout) and adds the next ones in place, so
    the sum is the same, bit for bit. The first is always copied here: the node copies a gradient that something
    else still holds, and one the layer hands down with its input's (a parameter added to the hidden states) would
    otherwise change under the layer below when the next micro-batch adds to it.
    """
    if grad is None:
        return
    with torch.no_grad():
        if param.grad is None:
            param.grad = torch.empty_like(param).copy_(grad)
        else:
            param.grad.add_(grad)


__all__ = ["SavedInput", "differentiate_window"]
