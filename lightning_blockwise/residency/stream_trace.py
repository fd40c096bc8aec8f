"""Observers of the streamer: a trace of where copies, waits and layer runs begin and end, and a tee.

The profiler (:mod:`lightning_blockwise.profiling.trace`) and the planner's timed step
(:mod:`lightning_blockwise.strategy.step_timing`) both read a :class:`Trace`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from typing_extensions import override

from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.stream_observer import StreamObserver

#: A point in time: a recorded CUDA event, or a host clock reading in seconds on the CPU.
Mark = torch.cuda.Event | float


class Trace(StreamObserver):
    """Counts the bytes the streamer copies and marks where copies, waits and layer runs start and end.

    It records only between :meth:`start` and :meth:`stop` (one training batch).

    Args:
        cuda: Mark with CUDA events on the current stream; otherwise read the host clock.
        block_of: The block of a decoder layer (the strategy's ``plan.block_of``).
    """

    def __init__(self, cuda: bool, block_of: Callable[[int], int] = lambda layer: layer) -> None:
        self.cuda = cuda
        self.block_of = block_of
        self.active = False
        self.bytes = 0
        self.copies: list[tuple[int, Mark, Mark]] = []
        self.waits: list[tuple[int, Mark, Mark]] = []
        # (block, pass, start, end) of each layer run.
        self.layers: list[tuple[int, Pass, Mark, Mark]] = []
        self._open: Mark | None = None
        self._open_wait: Mark | None = None
        self._open_layer: Mark | None = None
        self._pool: list[torch.cuda.Event] = []

    def mark(self) -> Mark:
        """Record a point on the current stream (the host clock on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def recycle(self, marks: list[Mark]) -> None:
        """Take back events whose times have been read."""
        if self.cuda:
            self._pool.extend(m for m in marks if isinstance(m, torch.cuda.Event))

    def start(self) -> None:
        """Start recording a batch: new span lists, the byte count at zero."""
        self.active = True
        self.bytes = 0
        self.copies, self.waits, self.layers = [], [], []

    def stop(self) -> None:
        """Stop recording; the span lists and the byte count stay as they are."""
        self.active = False

    @override
    def copy_started(self, block: int) -> None:
        if self.active:
            self._open = self.mark()

    @override
    def copy_finished(self, block: int, nbytes: int) -> None:
        if self.active and self._open is not None:
            self.copies.append((block, self._open, self.mark()))
            self.bytes += nbytes

    @override
    def wait_started(self, block: int) -> None:
        if self.active:
            self._open_wait = self.mark()

    @override
    def wait_finished(self, block: int) -> None:
        if self.active and self._open_wait is not None:
            self.waits.append((block, self._open_wait, self.mark()))

    @override
    def layer_started(self, layer: int, phase: Pass) -> None:
        if self.active:
            self._open_layer = self.mark()

    @override
    def layer_finished(self, layer: int, phase: Pass) -> None:
        if self.active and self._open_layer is not None:
            self.layers.append((self.block_of(layer), phase, self._open_layer, self.mark()))
            self._open_layer = None


class Tee(StreamObserver):
    """Hands every event of the streamer to two observers: the run's own, and a timing trace."""

    def __init__(self, first: StreamObserver, second: StreamObserver) -> None:
        self.observers = (first, second)

    @override
    def copy_started(self, block: int) -> None:
        for observer in self.observers:
            observer.copy_started(block)

    @override
    def copy_finished(self, block: int, nbytes: int) -> None:
        for observer in self.observers:
            observer.copy_finished(block, nbytes)

    @override
    def wait_started(self, block: int) -> None:
        for observer in self.observers:
            observer.wait_started(block)

    @override
    def wait_finished(self, block: int) -> None:
        for observer in self.observers:
            observer.wait_finished(block)

    @override
    def layer_started(self, layer: int, phase: Pass) -> None:
        for observer in self.observers:
            observer.layer_started(layer, phase)

    @override
    def layer_finished(self, layer: int, phase: Pass) -> None:
        for observer in self.observers:
            observer.layer_finished(layer, phase)


def elapsed_ms(origin: Mark, mark: Mark) -> float:
    """Milliseconds from ``origin`` to ``mark`` (both completed CUDA events, or both host clock readings)."""
    if isinstance(origin, float) and isinstance(mark, float):
        return (mark - origin) * 1e3
    assert isinstance(origin, torch.cuda.Event) and isinstance(mark, torch.cuda.Event)
    return origin.elapsed_time(mark)


__all__ = ["Mark", "Tee", "Trace", "elapsed_ms"]
