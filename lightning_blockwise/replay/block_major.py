"""Block-major gradient accumulation: a window's micro-batches run each decoder layer one after another.

With gradient accumulation over ``G`` micro-batches, streaming copies every block ``G`` times for the
forwards and ``G`` times for the backwards. A :class:`Window` runs layer ``l`` of every micro-batch
while block ``l`` is on the device, in the forward and again in the backward, so each block is copied
once per pass for the whole window (NOTE [ Block-major accumulation ]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.layer import ReplayedLayer
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.replay.window_backward import SavedInput, differentiate_window
from lightning_blockwise.replay.window_refusals import Intermediate, WindowError, draws_message, refuse_trainable_before
from lightning_blockwise.replay.window_workers import Workers
from lightning_blockwise.residency.base import Pass

# NOTE [ Block-major accumulation ]
# Lightning calls `training_step` for micro-batch k only after micro-batch k-1's forward and
# backward, and a training step is the user's code: it cannot be cut at the decoder. So each
# micro-batch of a window runs its `training_step` on a worker thread of its own, from the
# window's first micro-batch's call on, and the workers take turns (only one runs at any time,
# in a fixed order, so the user's code runs in a fixed order too): micro-batch 0 runs its code
# before the decoder and decoder layer 0, then micro-batch 1 does, ..., then each runs layer 1,
# and so on; a worker keeps the turn until it reaches its next layer, so the code between two
# layers runs in its turn too. A layer's block is acquired by the window's first micro-batch and
# released after its last. After the last layer a worker waits until Lightning asks for its
# micro-batch, then runs the rest of its step (final norm, head, loss, and `self.log` calls made
# there) inside that call, so the loss and those logs belong to micro-batch k's call. The code
# before the decoder of micro-batches 1..G-1 (and a `self.log` made there) runs inside micro-
# batch 0's call.
#
# The layers run without a graph; only the last one is an autograd node per micro-batch
# (`_WindowTop`), whose backward stores the gradient arriving at the top of the decoder. In
# the backward of the window's last micro-batch, that node runs the decoder's backward for
# the whole window: layer L-1 recomputed and differentiated for every micro-batch, in order,
# then layer L-2, ... Each adapter parameter belongs to one layer, so it receives its
# micro-batches' gradients in the order resident accumulation gives them (0, 1, ..., G-1),
# through its own `AccumulateGrad` (NOTE [ Exact rematerialization ] in remat.py): the sums
# are the same, bit for bit. The recompute of a micro-batch's layer is exact as in remat.py.
# The other layers' outputs go through `Intermediate`, which refuses a gradient (a loss on
# `output_hidden_states`): the window's backward could not carry it. What else a window cannot
# run is refused: NOTE [ What a block-major window refuses ] in window_refusals.py.

_local = threading.local()


def current_member() -> _Member | None:
    """The window micro-batch this thread runs, or ``None`` outside a block-major window."""
    return getattr(_local, "member", None)


class _Aborted(BaseException):
    """Raised in a window's threads to unwind them when the window is abandoned (not an error of theirs)."""


@dataclass
class _Member:
    """The thread-local handle of micro-batch ``index`` of ``window``."""

    window: Window
    index: int


class Window:
    """One accumulation window: ``count`` micro-batches whose decoder layers run block-major.

    Args:
        count: Micro-batches in the window.
        num_layers: Decoder layers.
        device: The compute device (its CUDA device is made current in the window's threads).
        hooks_once: Fire each adapter's ``AccumulateGrad`` hooks once per window, for its last micro-batch (a DDP
            reducer listens on them: NOTE [ Block-major windows on several ranks ] in window_backward.py); else once
            per micro-batch.
    """

    def __init__(self, count: int, num_layers: int, device: torch.device, hooks_once: bool = False) -> None:
        if count < 2:
            raise ValueError(f"a block-major window needs at least 2 micro-batches, got {count}")
        self.count = count
        self.num_layers = num_layers
        self.device = device
        self.hooks_once = hooks_once
        self._cond = threading.Condition()
        # The turn: ("forward", layer, micro-batch), ("tail", micro-batch), or None (nobody's).
        self._turn: tuple[Any, ...] | None = ("forward", 0, 0)
        #: Micro-batches still in the forward (one that returns before the decoder drops out).
        self._active: list[int] = list(range(count))
        self._layer_reached = [-1] * count
        self._results: dict[int, Any] = {}
        self._error: BaseException | None = None
        self._aborted = False
        self._forward_done = False
        self._saved: list[list[SavedInput | None]] = [[None] * num_layers for _ in range(count)]
        self._remats: list[ReplayedLayer | None] = [None] * num_layers
        self._grads: dict[int, Tensor] = {}
        self._backward_done = False
        self._live = 0  # micro-batches whose `training_step` has not returned or unwound
        #: The layer whose block the forward holds (acquired by the first active micro-batch).
        self._acquired: int | None = None
        # Whether each micro-batch's code before the decoder drew random numbers.
        self._drew_before = [False] * count
        self._start_rng: dict[int, RngSnapshot] = {}
        self._tail_rng: dict[int, RngSnapshot] = {}
        self._layer_end_rng: dict[int, RngSnapshot] = {}
        #: Whether reading the window's batches ahead drew random numbers (a data pipeline in this process).
        self.drew_ahead = False

    # -- the window's threads -------------------------------------------------------------------

    def start(self, step: Callable[[int], Any], workers: Workers) -> None:
        """Run ``step(k)`` (micro-batch ``k``'s whole ``training_step``) on worker ``k``; the workers take turns."""
        self._live = self.count
        for k in range(self.count):
            workers.submit(k, lambda k=k: self._run(step, k))

    def _run(self, step: Callable[[int], Any], k: int) -> None:
        _local.member = _Member(self, k)
        try:
            self._wait(("forward", 0, k))
            self._start_rng[k] = RngSnapshot.capture(self.device)
            result = step(k)
            drew_elsewhere = self.drew_ahead or any(self._drew_before[k + 1 :])
            if k in self._tail_rng and not self._tail_rng[k].unchanged() and drew_elsewhere:
                raise WindowError(draws_message(f"the code after the decoder in micro-batch {k}'s training_step"))
            with self._cond:
                if self._layer_reached[k] == -1:
                    # Returned before the decoder: nothing of it is in the window's layers.
                    self._drop(k)
                elif self._layer_reached[k] < self.num_layers - 1 or self._turn != ("tail", k):
                    raise WindowError(
                        f"BlockwiseStrategy(block_major_accumulation=True): the training_step of micro-batch {k}"
                        f" returned after decoder layer {self._layer_reached[k]} of {self.num_layers}; block-major"
                        " accumulation needs every training_step to run the whole decoder once."
                    )
                self._results[k] = result
                self._cond.notify_all()
        except _Aborted:
            pass
        except BaseException as error:  # handed to the thread Lightning runs, which raises it
            with self._cond:
                if self._error is None:
                    self._error = error
                self._cond.notify_all()
        finally:
            _local.member = None
            with self._cond:
                self._live -= 1
                self._cond.notify_all()

    def _wait(self, turn: tuple[Any, ...]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._turn == turn or self._error is not None or self._aborted)
            if self._aborted or self._error is not None:
                raise _Aborted

    def _drop(self, k: int) -> None:
        """Micro-batch ``k`` returned before the decoder, in its turn at layer 0: hand the turn on (lock held)."""
        self._active.remove(k)
        if self._acquired is not None and not [j for j in self._active if j > k]:
            # The micro-batches before it ran layer 0 on a block that only the last one releases.
            self._release(self._acquired)
        self._advance(0, k)

    def _advance(self, layer: int, k: int) -> None:
        """Hand the turn from micro-batch ``k`` at ``layer`` to the next one (lock held)."""
        later = [j for j in self._active if j > k]
        if later:
            self._turn = ("forward", layer, later[0])
        elif layer + 1 < self.num_layers and self._active:
            self._turn = ("forward", layer + 1, self._active[0])
        else:
            self._turn, self._forward_done = None, True
        self._cond.notify_all()

    def _release(self, layer: int) -> None:
        remat = self._remats[layer]
        assert remat is not None
        remat.residency.release(layer, Pass.FORWARD)
        self._acquired = None

    # -- the layers, called from WindowForward in the window's threads --------------------------------

    def forward_layer(self, remat: ReplayedLayer, k: int, hidden: Tensor, args: tuple, kwargs: dict) -> Tensor:
        """Run ``remat``'s layer for micro-batch ``k`` in its turn; see NOTE [ Block-major accumulation ]."""
        layer = remat.index
        if layer != self._layer_reached[k] + 1:
            # Checked before waiting: a second decoder pass would wait for a turn that never comes.
            raise WindowError(
                f"BlockwiseStrategy(block_major_accumulation=True): micro-batch {k} called decoder layer {layer}"
                f" after layer {self._layer_reached[k]}; block-major accumulation needs the decoder's layers called"
                " once each, in order, per training_step (not a second decoder pass, e.g. a reference forward or"
                " `generate`). Set `block_major_accumulation=False` for this module."
            )
        if layer == 0:
            refuse_trainable_before(hidden)
            self._drew_before[k] = not self._start_rng[k].unchanged()
            if self._drew_before[k] and self.drew_ahead:
                raise WindowError(draws_message(f"the code before the decoder in micro-batch {k}'s training_step"))
        else:
            # The code between two layers ran in this micro-batch's turn; only now does the turn pass on.
            if not self._layer_end_rng[k].unchanged():
                raise WindowError(
                    draws_message(f"the code between decoder layers {layer - 1} and {layer} of micro-batch {k}")
                )
            with self._cond:
                self._advance(layer - 1, k)
        self._wait(("forward", layer, k))
        self._remats[layer] = remat
        call = LayerCall.capture(hidden.device, args, kwargs)
        if k == self._active[0]:
            remat.residency.acquire(layer, Pass.FORWARD)
            self._acquired = layer
        rng = RngSnapshot.capture(hidden.device)
        last = layer == self.num_layers - 1
        if last:
            output = _WindowTop.apply(self, k, remat, call, hidden, remat.anchor)
        else:
            with torch.no_grad():
                output = remat.run_once(hidden, call)
        if not rng.unchanged():
            raise WindowError(draws_message(f"decoder layer {layer} of micro-batch {k}"))
        self._saved[k][layer] = SavedInput(hidden, hidden._version, call)
        with self._cond:
            if k == self._active[-1]:
                self._release(layer)
            self._layer_reached[k] = layer
            if last:
                self._advance(layer, k)
        if not last:
            # Nothing drew during the layer (checked above): its starting state is the state at its end.
            self._layer_end_rng[k] = rng
            # Differentiable only to refuse a loss on it (`output_hidden_states`): its gradient would be lost.
            return Intermediate.apply(layer, k, output, remat.anchor)
        # The rest of the step runs when Lightning asks for this micro-batch (`result`).
        self._wait(("tail", k))
        self._tail_rng[k] = RngSnapshot.capture(hidden.device)
        return output

    # -- the thread Lightning runs ------------------------------------------------------------------

    def result(self, k: int) -> Any:
        """Let micro-batch ``k`` finish its ``training_step`` and return what it returned.

        Raises:
            BaseException: What a window thread raised, re-raised here.
        """
        with self._cond:
            self._cond.wait_for(lambda: self._forward_done or self._error is not None or k in self._results)
            self._raise_error()
            if k not in self._results:
                self._turn = ("tail", k)
                self._cond.notify_all()
                self._cond.wait_for(lambda: k in self._results or self._error is not None)
                self._raise_error()
            # Popped: a result held here would keep its graph, whose `_WindowTop` holds this window (a cycle
            # through the autograd graph that the garbage collector cannot see).
            return self._results.pop(k)

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._aborted = True
            self._cond.notify_all()
            raise error

    def abort(self) -> None:
        """Unwind the window's waiting micro-batches (the window is abandoned) and drop what it saved."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._live == 0)
        self._saved, self._grads, self._results, self._remats = [], {}, {}, []
        self._start_rng, self._tail_rng, self._layer_end_rng = {}, {}, {}

    # -- the backward ---------------------------------------------------------------------------

    def stash(self, k: int, grad: Tensor) -> None:
        """Keep the gradient at the top of the decoder of micro-batch ``k``; the last one runs the window's backward."""
        self._grads[k] = grad
        if k == self._active[-1]:
            self.backward()

    def backward(self) -> None:
        """Differentiate the decoder for every micro-batch that stored a gradient, block by block, last layer first.

        Runs at most once; a micro-batch whose backward never reached the decoder (its ``training_step``
        returned ``None``, or a loss that does not depend on it) contributes nothing, as in resident training.
        """
        if self._backward_done or not self._grads:
            return
        self._backward_done = True
        order = sorted(self._grads)  # the order resident accumulation gives the adapters their gradients
        grads = [self._grads[k] for k in order]
        differentiate_window(self._remats, self._saved, order, grads, hooks_once=self.hooks_once)
        self._grads = {}


class _WindowTop(torch.autograd.Function):
    """The decoder's last layer of one window micro-batch: the only autograd node of its decoder.

    See NOTE [ Block-major accumulation ].
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, window: Window, k: int, remat: ReplayedLayer, call: LayerCall, hidden: Tensor, anchor: Tensor
    ) -> Tensor:
        ctx.window, ctx.k = window, k
        ctx.set_materialize_grads(False)
        return remat.run_once(hidden, call)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor | None) -> tuple[None, ...]:
        if grad_output is not None:
            ctx.window.stash(ctx.k, grad_output)
        return (None,) * 6


__all__ = ["Window", "WindowError", "Workers", "current_member"]
