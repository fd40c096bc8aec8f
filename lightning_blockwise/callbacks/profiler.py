"""``BlockwiseProfiler``: VRAM, host-to-device traffic, copy stalls and throughput of a blockwise run.

# NOTE [ Profiler timing ]
# The profiler must not slow the run it measures, so it never synchronizes per layer. While
# a training batch runs, its observer (NOTE [ Stream observer ] in streamer.py) records a
# CUDA event on the stream where each copy, each wait of the compute stream for a copy and
# each layer run begins and ends, plus one event at the batch's start and end on the
# compute stream. Nothing reads them then: after each batch the profiler reads the batches
# whose last events have completed (``Event.query``, no wait), and at each logged step it
# synchronizes the device once and reads the rest. On the CPU there are no streams; the
# same hooks read a host clock, and copies and layer runs are synchronous.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.imports import RequirementCache
from torchmetrics import MaxMetric, MeanMetric, Metric
from typing_extensions import override

from lightning_blockwise.residency import Pass
from lightning_blockwise.streamer import BlockStreamer, StreamObserver

_RICH_AVAILABLE = RequirementCache("rich")

#: A point in time: a recorded CUDA event, or a host clock reading in seconds on the CPU.
_Mark = torch.cuda.Event | float


class _Trace(StreamObserver):
    """Counts the bytes the streamer copies and marks where copies, waits and layer runs start and end."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.block_of: Callable[[int], int] = lambda layer: layer
        self.active = False
        self.bytes = 0
        self.copies: list[tuple[int, _Mark, _Mark]] = []
        self.waits: list[tuple[int, _Mark, _Mark]] = []
        # (block, pass, start, end) of each layer run.
        self.layers: list[tuple[int, Pass, _Mark, _Mark]] = []
        self._open: _Mark | None = None
        self._open_wait: _Mark | None = None
        self._open_layer: _Mark | None = None
        self._pool: list[torch.cuda.Event] = []

    def mark(self) -> _Mark:
        """Record a point on the current stream (the host clock on the CPU)."""
        if not self.cuda:
            return time.perf_counter()
        event = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def recycle(self, marks: list[_Mark]) -> None:
        """Take back events whose times have been read."""
        if self.cuda:
            self._pool.extend(m for m in marks if isinstance(m, torch.cuda.Event))

    def start(self) -> None:
        self.active = True
        self.bytes = 0
        self.copies, self.waits, self.layers = [], [], []

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


@dataclass
class _Batch:
    """One training batch's marks, until they are read."""

    index: int
    tokens: int | None
    start: _Mark
    end: _Mark
    bytes: int
    copies: list[tuple[int, _Mark, _Mark]]
    waits: list[tuple[int, _Mark, _Mark]]
    layers: list[tuple[int, Pass, _Mark, _Mark]]
    peak_allocated: int | None
    peak_reserved: int | None

    def marks(self) -> list[_Mark]:
        spans = [*self.copies, *self.waits, *self.layers]
        return [self.start, self.end, *(m for span in spans for m in span[-2:])]

    def done(self) -> bool:
        """Whether every event has completed (always on the CPU); does not wait."""
        last = [self.end, *(c[-1] for c in self.copies[-1:])]
        return all(not isinstance(m, torch.cuda.Event) or m.query() for m in last)


@dataclass
class _Timeline:
    """A batch's spans in milliseconds from its start: what the PNG draws."""

    index: int
    step_ms: float
    copies: list[tuple[int, float, float]] = field(default_factory=list)
    waits: list[tuple[int, float, float]] = field(default_factory=list)
    layers: list[tuple[int, Pass, float, float]] = field(default_factory=list)


def _ms(origin: _Mark, mark: _Mark) -> float:
    if isinstance(origin, float) and isinstance(mark, float):
        return (mark - origin) * 1e3
    assert isinstance(origin, torch.cuda.Event) and isinstance(mark, torch.cuda.Event)
    return origin.elapsed_time(mark)


def _timeline(batch: _Batch) -> _Timeline:
    ms = lambda mark: _ms(batch.start, mark)  # noqa: E731
    return _Timeline(
        index=batch.index,
        step_ms=ms(batch.end),
        copies=[(b, ms(s), ms(e)) for b, s, e in batch.copies],
        waits=[(b, ms(s), ms(e)) for b, s, e in batch.waits],
        layers=[(block, phase, ms(s), ms(e)) for block, phase, s, e in batch.layers],
    )


class _Aggregates:
    """Torchmetrics aggregates of the per-batch measurements (float64: byte counts stay exact)."""

    def __init__(self) -> None:
        self.metrics: dict[str, Metric] = {
            "step_time_s": MeanMetric(),
            "tokens": MeanMetric(),
            "h2d_bytes_per_step": MeanMetric(),
            "h2d_s_per_step": MeanMetric(),
            "wait_s_per_step": MeanMetric(),
            "peak_allocated_bytes": MaxMetric(),
            "peak_reserved_bytes": MaxMetric(),
        }
        for metric in self.metrics.values():
            metric.set_dtype(torch.float64)
        self.steps = 0

    def update(self, values: Mapping[str, float | None]) -> None:
        self.steps += 1
        for name, value in values.items():
            if value is not None:
                self.metrics[name].update(value)

    def compute(self, streaming: bool, cuda: bool) -> dict[str, float]:
        """The aggregates as the profiler reports them; what this device and strategy lack is left out."""
        if self.steps == 0:
            return {}
        values = {k: m.compute().item() for k, m in self.metrics.items() if m.update_called}
        out = {"step_time_s": values["step_time_s"]}
        if "tokens" in values:
            out["tokens_per_s"] = values["tokens"] / values["step_time_s"]
        if streaming:
            out["h2d_bytes_per_step"] = values["h2d_bytes_per_step"]
            out["h2d_s_per_step"] = values["h2d_s_per_step"]
            seconds = values["h2d_s_per_step"]
            out["h2d_gb_per_s"] = values["h2d_bytes_per_step"] / seconds / 1e9 if seconds > 0 else 0.0
        if streaming and cuda:
            out["wait_s_per_step"] = values["wait_s_per_step"]
            out["wait_fraction"] = values["wait_s_per_step"] / values["step_time_s"]
        if cuda:
            out["peak_allocated_bytes"] = values["peak_allocated_bytes"]
            out["peak_reserved_bytes"] = values["peak_reserved_bytes"]
        return out

    def reset(self) -> None:
        for metric in self.metrics.values():
            metric.reset()
        self.steps = 0


def _input_ids_numel(batch: Any) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
    return ids.numel() if isinstance(ids, torch.Tensor) else None


class BlockwiseProfiler(Callback):
    """Measures what streaming costs a run: VRAM, host-to-device traffic, copy stalls, step time, tokens/s.

    Every ``log_every_n_steps`` optimizer steps (the Trainer's), the profiler logs to the
    Trainer's loggers the aggregates over the training batches since its last log. A *step*
    here is one training batch (with gradient accumulation, a micro-batch; the optimizer step
    falls in the last one), timed from ``on_train_batch_start`` to ``on_train_batch_end``.
    Keys (those a device or strategy lacks are not logged):

    - ``blockwise/step_time_s``: mean time of a batch (CUDA events on the compute stream; host clock on the CPU).
    - ``blockwise/tokens_per_s``: mean tokens per batch over mean batch time. Tokens are
      ``batch["input_ids"].numel()``, padding included (no device sync), unless ``count_tokens`` is given.
    - ``blockwise/h2d_bytes_per_step``: mean bytes copied from the host arena to the device slots per batch,
      counted where the copies are issued. Needs ``strategy="blockwise"``.
    - ``blockwise/h2d_s_per_step``: mean time the copy stream spent copying per batch (on the CPU: the
      synchronous copies, host clock).
    - ``blockwise/h2d_gb_per_s``: achieved copy bandwidth, ``h2d_bytes_per_step / h2d_s_per_step`` in GB/s.
    - ``blockwise/wait_s_per_step``: mean time per batch the compute stream stood waiting for copies
      (CUDA only): the part of the traffic that did not hide under compute.
    - ``blockwise/wait_fraction``: ``wait_s_per_step / step_time_s`` (CUDA only).
    - ``blockwise/peak_allocated_bytes``, ``blockwise/peak_reserved_bytes``: the largest per-batch peak of
      ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (CUDA only; the profiler resets the peak
      counters at every batch start).

    At the end of fit it prints the same numbers over the whole fit as a table (the first batch,
    which fills the slots and warms up the allocator, is reported apart when there are more)
    and writes them as JSON to ``blockwise_profile.json`` in ``dirpath``. With ``timeline`` it
    also draws one batch as ``blockwise_timeline.png``: the copy lane against the compute lane,
    one bar per block, so you can see whether the transfers hide under compute.

    Timing reads CUDA events lazily and synchronizes only once per logged step (NOTE [ Profiler
    timing ]); the profiler changes neither the computation nor the data the run sees.

    Args:
        timeline: ``True`` draws the last batch of the fit; an ``int`` draws that training batch
            (counted from 0 in this fit); ``False`` draws nothing.
        dirpath: Where the JSON and PNG go. Defaults to ``trainer.log_dir`` (the default root dir without a logger).
        count_tokens: Tokens in a batch, if ``input_ids.numel()`` is not what you want (e.g.
            ``lambda batch: int(batch["attention_mask"].sum())``, at the price of a device sync per batch).

    Raises:
        MisconfigurationException: If ``timeline`` is a negative index.

    Example::

        from lightning_blockwise import BlockwiseProfiler

        trainer = Trainer(strategy="blockwise", accelerator="gpu", callbacks=[BlockwiseProfiler(timeline=True)])
        trainer.fit(module)  # logs blockwise/..., prints the summary, writes the JSON and the PNG
    """

    def __init__(
        self,
        timeline: bool | int = False,
        dirpath: str | Path | None = None,
        count_tokens: Callable[[Any], int | None] | None = None,
    ) -> None:
        if not isinstance(timeline, bool) and timeline < 0:
            raise MisconfigurationException(
                f"`BlockwiseProfiler(timeline={timeline})` must be True, False or the index of a training batch (>= 0)."
            )
        self.timeline = timeline
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.count_tokens = count_tokens or _input_ids_numel
        self.summary: dict[str, Any] = {}
        self._trace = _Trace(cuda=False)
        self._device = torch.device("cpu")
        self._pending: list[_Batch] = []
        self._interval = _Aggregates()
        self._fit = _Aggregates()
        self._first: dict[str, float] = {}
        self._batches = 0
        self._step_at_start = 0
        self._start: _Mark = 0.0
        self._tokens: int | None = None
        self._drawn: _Timeline | None = None
        self._trainer: Trainer | None = None

    @property
    def _streamer(self) -> BlockStreamer | None:
        return None if self._trainer is None else getattr(self._trainer.strategy, "streamer", None)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer = trainer
        self._device = trainer.strategy.root_device
        self._trace = _Trace(cuda=self._device.type == "cuda")
        self._pending, self._batches, self._first, self._drawn = [], 0, {}, None
        self._interval.reset()
        self._fit.reset()
        if self._streamer is None:
            rank_zero_warn(
                "BlockwiseProfiler: the strategy does not stream weights, so only step time, tokens/s and VRAM are"
                " reported. Use `Trainer(strategy='blockwise')` to profile host-to-device traffic."
            )

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        streamer = self._streamer
        # Another callback may replace the streamer between batches (e.g. a parity check); follow it.
        if streamer is not None and streamer.observer is not self._trace:
            streamer.observer = self._trace
            self._trace.block_of = streamer.plan.block_of
        if self._trace.cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        self._tokens = self.count_tokens(batch)
        self._step_at_start = trainer.global_step
        self._trace.start()
        self._start = self._trace.mark()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        trace = self._trace
        end = trace.mark()
        trace.active = False
        cuda = trace.cuda
        self._pending.append(
            _Batch(
                index=self._batches,
                tokens=self._tokens,
                start=self._start,
                end=end,
                bytes=trace.bytes,
                copies=trace.copies,
                waits=trace.waits,
                layers=trace.layers,
                peak_allocated=torch.cuda.max_memory_allocated(self._device) if cuda else None,
                peak_reserved=torch.cuda.max_memory_reserved(self._device) if cuda else None,
            )
        )
        self._batches += 1
        every = trainer.log_every_n_steps
        stepped = trainer.global_step != self._step_at_start
        if every > 0 and stepped and trainer.global_step % every == 0:
            self._read(wait=True)
            metrics = self._interval.compute(self._streamer is not None, cuda)
            # float64 host tensors: Lightning would store plain floats as float32, which rounds byte counts.
            logged = {f"blockwise/{k}": torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}
            pl_module.log_dict(logged, on_step=True, on_epoch=False)
            self._interval.reset()
        else:
            self._read(wait=False)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read(wait=True)
        streamer = self._streamer
        if streamer is not None and streamer.observer is self._trace:
            streamer.observer = StreamObserver()
        self.summary = self._summarize(streamer)
        dirpath = self._dirpath(trainer)
        self._write(dirpath)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        streamer = self._streamer
        if streamer is not None and streamer.observer is self._trace:
            streamer.observer = StreamObserver()

    def _read(self, wait: bool) -> None:
        """Turn the pending batches' marks into measurements, oldest first; with ``wait``, all of them."""
        if wait and self._trace.cuda and self._pending:
            torch.cuda.synchronize(self._device)
        while self._pending and (wait or self._pending[0].done()):
            batch = self._pending.pop(0)
            timeline = _timeline(batch)
            values = {
                "step_time_s": timeline.step_ms / 1e3,
                "tokens": None if batch.tokens is None else float(batch.tokens),
                "h2d_bytes_per_step": float(batch.bytes),
                "h2d_s_per_step": sum(e - s for _, s, e in timeline.copies) / 1e3,
                "wait_s_per_step": sum(e - s for _, s, e in timeline.waits) / 1e3,
                "peak_allocated_bytes": None if batch.peak_allocated is None else float(batch.peak_allocated),
                "peak_reserved_bytes": None if batch.peak_reserved is None else float(batch.peak_reserved),
            }
            self._interval.update(values)
            if batch.index == 0:
                first = _Aggregates()
                first.update(values)
                self._first = first.compute(self._streamer is not None, self._trace.cuda)
            else:
                self._fit.update(values)
            if self.timeline is True or (self.timeline is not False and batch.index == self.timeline):
                self._drawn = timeline
            self._trace.recycle(batch.marks())

    def _summarize(self, streamer: BlockStreamer | None) -> dict[str, Any]:
        streaming, cuda = streamer is not None, self._trace.cuda
        fit = self._fit.compute(streaming, cuda) if self._fit.steps else self._first
        summary: dict[str, Any] = {
            "device": str(self._device),
            "batches": self._fit.steps or self._batches,
            "first_batch_excluded": bool(self._fit.steps),
            **fit,
            "first_batch": self._first,
        }
        if streamer is not None:
            summary["streamer"] = {
                "blocks": streamer.plan.num_blocks,
                "block_size": streamer.plan.block_size,
                "streamed_blocks": len(streamer.streamed),
                "resident_blocks": len(streamer.resident),
                "slots": len(streamer.slots),
                "prefetch_depth": streamer.prefetch_depth,
            }
        return summary

    def _dirpath(self, trainer: Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        return Path(trainer.log_dir or trainer.default_root_dir)

    @rank_zero_only
    def _write(self, dirpath: Path) -> None:
        dirpath.mkdir(parents=True, exist_ok=True)
        (dirpath / "blockwise_profile.json").write_text(json.dumps(self.summary, indent=1))
        _print_table(self.summary)
        if self.timeline is not False:
            if self._drawn is None:
                rank_zero_warn(
                    f"BlockwiseProfiler(timeline={self.timeline}): the fit ran {self._batches} training batches, so"
                    " there was no such batch to draw. Pass an index below that."
                )
            else:
                _draw(self._drawn, dirpath / "blockwise_timeline.png", self._device)


#: Summary rows: key, label, scale, unit (bytes are scaled when printed).
_ROWS = [
    ("step_time_s", "step time", 1e3, "ms"),
    ("tokens_per_s", "throughput", 1, "tokens/s"),
    ("h2d_bytes_per_step", "host-to-device per step", 1, "bytes"),
    ("h2d_s_per_step", "copy time per step", 1e3, "ms"),
    ("h2d_gb_per_s", "copy bandwidth", 1, "GB/s"),
    ("wait_s_per_step", "compute waited on copies", 1e3, "ms"),
    ("wait_fraction", "waited / step time", 100, "%"),
    ("peak_allocated_bytes", "peak VRAM allocated", 1, "bytes"),
    ("peak_reserved_bytes", "peak VRAM reserved", 1, "bytes"),
]


def _format(value: float, scale: float, unit: str) -> tuple[str, str]:
    if unit == "bytes":
        scale, unit = (1e-9, "GB") if value >= 1e8 else (1e-6, "MB")
    return f"{value * scale:,.3f}", unit


def _print_table(summary: Mapping[str, Any]) -> None:
    title = f"BlockwiseProfiler: {summary['batches']} training batches on {summary['device']}"
    if summary["first_batch_excluded"]:
        title += " (first excluded)"
    rows = [(label, *_format(summary[key], scale, unit)) for key, label, scale, unit in _ROWS if key in summary]
    if _RICH_AVAILABLE:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for column in ("metric", "value", "unit"):
            table.add_column(column, justify="right" if column == "value" else "left")
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    width = max(len(label) for label, _, _ in rows)
    print("\n".join([title, *(f"  {label:<{width}}  {value:>14} {unit}" for label, value, unit in rows)]))


def _draw(timeline: _Timeline, path: Path, device: torch.device) -> None:
    """Two lanes over one batch: copies on the copy stream, layer runs (merged per block) and waits on compute."""
    # Imported here: matplotlib takes a while to import and only the timeline needs it.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    runs: list[tuple[int, Pass, float, float]] = []  # consecutive layer runs of one block, merged
    for block, phase, start, end in timeline.layers:
        if runs and runs[-1][0] == block and runs[-1][1] is phase:
            runs[-1] = (block, phase, runs[-1][2], end)
        else:
            runs.append((block, phase, start, end))
    figure = Figure(figsize=(14, 3.2))
    axes = figure.add_subplot()
    colors = {Pass.FORWARD: "tab:blue", Pass.BACKWARD: "tab:green"}
    for block, phase, start, end in runs:
        axes.broken_barh([(start, end - start)], (0.1, 0.8), color=colors[phase], edgecolor="white", linewidth=0.5)
        axes.text((start + end) / 2, 0.5, str(block), ha="center", va="center", fontsize=6, color="white")
    for _, start, end in timeline.waits:
        axes.broken_barh([(start, end - start)], (0.0, 0.1), color="tab:red")
    for block, start, end in timeline.copies:
        axes.broken_barh([(start, end - start)], (1.1, 0.8), color="tab:orange", edgecolor="white", linewidth=0.5)
        axes.text((start + end) / 2, 1.5, str(block), ha="center", va="center", fontsize=6)
    axes.set_yticks([0.5, 1.5], ["compute", "copy"])
    axes.set_xlabel("ms from the start of the batch")
    copy_ms = sum(e - s for _, s, e in timeline.copies)
    wait_ms = sum(e - s for _, s, e in timeline.waits)
    axes.set_title(
        f"Training batch {timeline.index} on {device}: {timeline.step_ms:.1f} ms, {len(timeline.copies)} block copies"
        f" taking {copy_ms:.2f} ms, compute waited {wait_ms:.2f} ms"
    )
    axes.legend(
        handles=[
            Patch(color="tab:blue", label="forward"),
            Patch(color="tab:green", label="backward (recompute)"),
            Patch(color="tab:orange", label="copy"),
            Patch(color="tab:red", label="compute waits for a copy"),
        ],
        loc="upper right",
        fontsize=7,
        ncols=4,
    )
    axes.set_ylim(-0.1, 2.6)
    figure.tight_layout()
    figure.savefig(path, dpi=150)


__all__ = ["BlockwiseProfiler"]
