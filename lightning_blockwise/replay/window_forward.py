"""Block-major accumulation's own forward over each rematerialized layer, installed while windows run.

The engine's :class:`~lightning_blockwise.replay.remat.RematLayer` knows nothing of windows: a run without
block-major accumulation checks nothing per layer call. A run with it wraps each layer's installed forward at a
window's opening and unwraps it at its close; inside, a call from a window's worker thread runs the window's turn
(NOTE [ Block-major accumulation ] in block_major.py), any other call the layer's own rematerializing forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn

from lightning_blockwise.replay.block_major import current_member
from lightning_blockwise.replay.remat import RematLayer, installed


class WindowForward:
    """The forward of one decoder layer while block-major windows run: the window's turn, or the layer's own.

    Args:
        remat: The rematerializing forward installed on the layer, which this one wraps (``wrapped_remat``, where
            :func:`~lightning_blockwise.replay.remat.installed` finds it: NOTE [ A wrapper over the installed
            forward ] in remat.py).
    """

    def __init__(self, remat: RematLayer) -> None:
        self.wrapped_remat = remat

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the layer as its own forward would be called: hidden states first, then its arguments."""
        member = current_member()
        if member is None:
            # Not a window's micro-batch (a validation step between windows, a callback's forward).
            return self.wrapped_remat(*args, **kwargs)
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        return member.window.forward_layer(self.wrapped_remat, member.index, hidden, args, kwargs)


def wrap(layers: Sequence[nn.Module]) -> None:
    """Install a :class:`WindowForward` over each layer's rematerializing forward (once: wrapping twice is a no-op).

    Raises:
        ValueError: If a layer has no rematerializing forward installed.
    """
    for index, layer in enumerate(layers):
        remat = installed(layer)
        if remat is None:
            raise ValueError(f"decoder layer {index} has no rematerializing forward to wrap for a block-major window")
        if not isinstance(vars(layer).get("forward"), WindowForward):
            layer.forward = WindowForward(remat)


def unwrap(layers: Sequence[nn.Module]) -> None:
    """Put each layer's rematerializing forward back where :func:`wrap` installed a :class:`WindowForward`."""
    for layer in layers:
        forward = vars(layer).get("forward")
        if isinstance(forward, WindowForward):
            layer.forward = forward.wrapped_remat


__all__ = ["WindowForward", "unwrap", "wrap"]
