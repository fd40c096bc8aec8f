"""What ``BlockwiseProfiler`` reports: aggregates of the traced batches, the fit's summary, its table, JSON and PNG.

The per-batch values come from :meth:`lightning_blockwise.profiling.trace.BatchTracer.read`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.imports import RequirementCache
from torchmetrics import MaxMetric, MeanMetric, Metric

from lightning_blockwise.profiling.trace import Timeline
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.streamer import BlockStreamer

_RICH_AVAILABLE = RequirementCache("rich")


class Aggregates:
    """Torchmetrics aggregates of the per-batch values (float64: byte counts stay exact)."""

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
        """Add one batch's values (``None``: the device does not measure it)."""
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
        """Forget every batch."""
        for metric in self.metrics.values():
            metric.reset()
        self.steps = 0


class Profile:
    """A fit's traced batches, aggregated since the last log and over the fit with the first batch apart.

    Args:
        streaming: Whether the strategy streams weights (else the traffic keys are left out).
        cuda: Whether the run is on CUDA (else the wait and memory keys are left out).
    """

    def __init__(self, streaming: bool = False, cuda: bool = False) -> None:
        self.streaming = streaming
        self.cuda = cuda
        self.interval = Aggregates()
        self.fit = Aggregates()
        self.first: dict[str, float] = {}

    def update(self, index: int, values: Mapping[str, float | None]) -> None:
        """Add the values of training batch ``index`` (counted from 0 in the fit)."""
        self.interval.update(values)
        if index == 0:
            first = Aggregates()
            first.update(values)
            self.first = first.compute(self.streaming, self.cuda)
        else:
            self.fit.update(values)

    def compute_interval(self) -> dict[str, float]:
        """The aggregates since the last call, and start a new interval."""
        metrics = self.interval.compute(self.streaming, self.cuda)
        self.interval.reset()
        return metrics

    def summary(self, device: torch.device, batches: int, streamer: BlockStreamer | None) -> dict[str, Any]:
        """The aggregates over the fit (the first of ``batches`` apart when there are more) and the streamer's shape."""
        fit = self.fit.compute(self.streaming, self.cuda) if self.fit.steps else self.first
        summary: dict[str, Any] = {
            "device": str(device),
            "batches": self.fit.steps or batches,
            "first_batch_excluded": bool(self.fit.steps),
            **fit,
            "first_batch": self.first,
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


def write_summary(summary: Mapping[str, Any], dirpath: Path) -> None:
    """Write the summary to ``dirpath / "blockwise_profile.json"`` and print it as a table."""
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / "blockwise_profile.json").write_text(json.dumps(summary, indent=1))
    _print_table(summary)


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


def draw_timeline(timeline: Timeline, path: Path, device: torch.device) -> None:
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
    colors = {Pass.FORWARD: "tab:blue", Pass.BACKWARD: "tab:green", Pass.REPLAY: "tab:purple"}
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
            Patch(color="tab:purple", label="replay (input checkpoints)"),
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


__all__ = ["Aggregates", "Profile", "draw_timeline", "write_summary"]
