"""Tracing training batches: where the streamer's copies, waits and layer runs begin and end, read lazily.

``BlockwiseProfiler`` drives a :class:`BatchTracer`; :mod:`lightning_blockwise.profiling.report`
aggregates and reports what it reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.stream_trace import Mark, Trace, elapsed_ms


@dataclass
class BatchRecord:
    """One training batch's marks, until they are read."""

    index: int
    tokens: int | None
    start: Mark
    end: Mark
    bytes: int
    copies: list[tuple[int, Mark, Mark]]
    waits: list[tuple[int, Mark, Mark]]
    layers: list[tuple[int, Pass, Mark, Mark]]
    peak_allocated: int | None
    peak_reserved: int | None

    def marks(self) -> list[Mark]:
        """Every mark of the batch (to recycle once read)."""
        spans = [*self.copies, *self.waits, *self.layers]
        return [self.start, self.end, *(m for span in spans for m in span[-2:])]

    def done(self) -> bool:
        """Whether every event has completed (always on the CPU); does not wait."""
        last = [self.end, *(c[-1] for c in self.copies[-1:])]
        return all(not isinstance(m, torch.cuda.Event) or m.query() for m in last)


@dataclass
class Timeline:
    """A batch's spans in milliseconds from its start: what the PNG draws."""

    index: int
    step_ms: float
    copies: list[tuple[int, float, float]] = field(default_factory=list)
    waits: list[tuple[int, float, float]] = field(default_factory=list)
    layers: list[tuple[int, Pass, float, float]] = field(default_factory=list)

    @classmethod
    def of(cls, batch: BatchRecord) -> Timeline:
        """The timeline of a batch whose events have completed."""
        ms = lambda mark: elapsed_ms(batch.start, mark)  # noqa: E731
        return cls(
            index=batch.index,
            step_ms=ms(batch.end),
            copies=[(b, ms(s), ms(e)) for b, s, e in batch.copies],
            waits=[(b, ms(s), ms(e)) for b, s, e in batch.waits],
            layers=[(block, phase, ms(s), ms(e)) for block, phase, s, e in batch.layers],
        )


# NOTE [ Profiler timing ]
# The profiler must not slow the run it measures, so it never synchronizes per layer. While
# a training batch runs, its observer (NOTE [ Stream observer ] in residency/streamer.py) records a
# CUDA event on the stream where each copy, each wait of the compute stream for a copy and
# each layer run begins and ends, plus one event at the batch's start and end on the
# compute stream. Nothing reads them then: after each batch the profiler reads the batches
# whose last events have completed (``Event.query``, no wait), and at each logged step it
# synchronizes the device once and reads the rest. On the CPU there are no streams; the
# same hooks read a host clock, and copies and layer runs are synchronous.
class BatchTracer:
    """Marks each training batch on ``device`` and reads its timings once they are ready (NOTE [ Profiler timing ]).

    Hand :attr:`trace` to the strategy (``BlockwiseStrategy.set_observer``) to count the streamer's traffic.

    Args:
        device: The training device.
        block_of: The block of a decoder layer (the strategy's ``plan.block_of``).
    """

    def __init__(self, device: torch.device, block_of: Callable[[int], int] = lambda layer: layer) -> None:
        self.device = device
        self.trace = Trace(cuda=device.type == "cuda", block_of=block_of)
        self.batches = 0
        self._pending: list[BatchRecord] = []
        self._start: Mark = 0.0
        self._tokens: int | None = None

    def start_batch(self, tokens: int | None) -> None:
        """A training batch of ``tokens`` tokens starts: reset the device's peak counters and mark its start."""
        if self.trace.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._tokens = tokens
        self.trace.start()
        self._start = self.trace.mark()

    def end_batch(self) -> None:
        """The batch ends: mark its end and keep its marks until they are read."""
        trace = self.trace
        end = trace.mark()
        trace.stop()
        cuda = trace.cuda
        self._pending.append(
            BatchRecord(
                index=self.batches,
                tokens=self._tokens,
                start=self._start,
                end=end,
                bytes=trace.bytes,
                copies=trace.copies,
                waits=trace.waits,
                layers=trace.layers,
                peak_allocated=torch.cuda.max_memory_allocated(self.device) if cuda else None,
                peak_reserved=torch.cuda.max_memory_reserved(self.device) if cuda else None,
            )
        )
        self.batches += 1

    def read(self, wait: bool) -> list[tuple[Timeline, dict[str, float | None]]]:
        """The pending batches whose events have completed, oldest first; with ``wait``, all of them.

        Each comes as its timeline and its values (``None`` where the device lacks one):
        ``step_time_s``, ``tokens``, ``h2d_bytes_per_step``, ``h2d_s_per_step``, ``wait_s_per_step``,
        ``peak_allocated_bytes`` and ``peak_reserved_bytes``.
        """
        if wait and self.trace.cuda and self._pending:
            torch.cuda.synchronize(self.device)
        read = []
        while self._pending and (wait or self._pending[0].done()):
            batch = self._pending.pop(0)
            timeline = Timeline.of(batch)
            values = {
                "step_time_s": timeline.step_ms / 1e3,
                "tokens": None if batch.tokens is None else float(batch.tokens),
                "h2d_bytes_per_step": float(batch.bytes),
                "h2d_s_per_step": sum(e - s for _, s, e in timeline.copies) / 1e3,
                "wait_s_per_step": sum(e - s for _, s, e in timeline.waits) / 1e3,
                "peak_allocated_bytes": None if batch.peak_allocated is None else float(batch.peak_allocated),
                "peak_reserved_bytes": None if batch.peak_reserved is None else float(batch.peak_reserved),
            }
            read.append((timeline, values))
            self.trace.recycle(batch.marks())
        return read


__all__ = ["BatchRecord", "BatchTracer", "Mark", "Timeline", "Trace", "elapsed_ms"]
