"""``MetricsPlot``: a PNG of the run's loss curves written at the end of ``fit``, with nothing else installed.

Example::

    trainer = Trainer(strategy="blockwise", callbacks=[MetricsPlot()])
    trainer.fit(module, datamodule=data)  # then open <log_dir>/loss.png
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from lightning_blockwise.compat.flags import check_flag
from lightning_blockwise.compat.lightning_namespaces import FollowsTrainer, follow

#: One point of a curve: the optimizer step it was recorded after, and the metric's value.
Point = tuple[int, float]


class MetricsPlot(FollowsTrainer, Callback):
    """Record logged metrics as training goes and plot them to a PNG in the log directory at the end of ``fit``.

    The values come from ``trainer.callback_metrics`` (what ``self.log`` produced), so the plot needs
    no particular logger: it works with CSV, TensorBoard or ``logger=False``. Training metrics are
    recorded after every optimizer step (from the micro-batch that ends it), validation metrics
    after every validation (not the sanity check), each against ``trainer.global_step``. The recorded
    curves are part of the callback's checkpoint state, so a resumed run plots from its first step.

    Args:
        filename: Name of the PNG, written to ``trainer.log_dir`` (the logger's version directory, or
            ``default_root_dir`` without a logger); a relative path such as ``"plots/loss.png"`` is created there.
        metrics: The metric names to plot; ``None``: every logged metric whose name ends in ``loss``
            (``train_loss``, ``val_loss``, ...).
        log_scale: Plot the values on a logarithmic axis (useful when the loss falls by orders of magnitude).

    Attributes:
        series: Metric name -> the recorded ``(global_step, value)`` points, in order: what the PNG shows.
        path: Where the PNG was written at the end of the last ``fit``; ``None`` before, or when nothing was logged.

    Raises:
        MisconfigurationException: If ``filename`` does not end in ``.png``, ``metrics`` is empty, or ``log_scale`` is
            not a bool.
    """

    def __init__(
        self, filename: str = "loss.png", metrics: Sequence[str] | None = None, log_scale: bool = False
    ) -> None:
        if not filename.endswith(".png"):
            raise MisconfigurationException(
                f"MetricsPlot(filename={filename!r}) writes a PNG: give a name ending in `.png`, e.g. 'loss.png'."
            )
        if metrics is not None and not metrics:
            raise MisconfigurationException(
                "MetricsPlot(metrics=[]) would plot nothing: name the metrics (e.g. ['train_loss', 'val_loss']), or"
                " leave it None for every metric whose name ends in `loss`."
            )
        check_flag("MetricsPlot", "log_scale", log_scale)
        self.filename = filename
        self.metrics = list(metrics) if metrics is not None else None
        self.log_scale = log_scale
        self.series: dict[str, list[Point]] = {}
        self.path: Path | None = None
        self._step_before = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The first hook a Trainer calls: one of the other Lightning namespace makes this callback its twin here
        # (NOTE [ Two Lightning namespaces ] in compat/lightning_namespaces.py).
        follow(self, trainer)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_before = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # One point per optimizer step, from the micro-batch that ended it (the value a logger writes for the
        # step); a micro-batch inside an accumulation window has not stepped yet. Validation metrics stay in
        # `callback_metrics` after a validation: recording them here too would draw each validation as a flat
        # stretch across the following training steps.
        if trainer.global_step > self._step_before:
            self._record(trainer, lambda name: not name.startswith("val"))

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._record(trainer, lambda name: name.startswith("val"))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # On every rank, before anything returns: `log_dir` is a collective that every rank must join (NOTE [ One
        # export, every rank in step ] in recipes/rank_zero_export.py); the plot itself is rank 0's.
        directory = Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        if not self.series:
            rank_zero_info(f"MetricsPlot: no {self._wanted()} was logged; {self.filename} not written.")
            return
        self.path = directory / self.filename
        # `filename` may name a folder ("plots/loss.png"): matplotlib does not create it, and failing at fit end
        # would lose the plot of a finished run.
        self.path.parent.mkdir(parents=True, exist_ok=True)
        plot_series(self.series, self.path, log_scale=self.log_scale)
        rank_zero_info(f"MetricsPlot: {', '.join(self.series)} plotted to {self.path}")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"series": {name: list(points) for name, points in self.series.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.series = {
            name: [(int(step), float(value)) for step, value in points] for name, points in state_dict["series"].items()
        }

    def _record(self, trainer: pl.Trainer, kind: Callable[[str], bool]) -> None:
        step = trainer.global_step
        for name, value in trainer.callback_metrics.items():
            if not kind(name) or not self._plots(name) or not isinstance(value, torch.Tensor) or value.numel() != 1:
                continue
            self.series.setdefault(name, []).append((step, float(value)))

    def _plots(self, name: str) -> bool:
        return name in self.metrics if self.metrics is not None else name.endswith("loss")

    def _wanted(self) -> str:
        return ", ".join(self.metrics) if self.metrics is not None else "metric ending in `loss`"


def plot_series(series: dict[str, list[Point]], path: Path, log_scale: bool = False) -> None:
    """Draw each named series as a line against the optimizer step and save the figure as a PNG at ``path``.

    Args:
        series: Metric name -> ``(step, value)`` points.
        path: Where to write the PNG.
        log_scale: A logarithmic value axis.
    """
    # Matplotlib's object API with the Agg canvas, not `pyplot`: pyplot would pick (and keep) a global
    # interactive backend, which a training process on a headless machine has no use for and a notebook
    # user would not expect a callback to change.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, points in series.items():
        steps, values = zip(*points, strict=True)
        # A single point (one validation) has no line to draw: a marker shows it.
        axes.plot(steps, values, label=name, marker="o" if len(points) < 2 else None)
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("value")
    if log_scale:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path, format="png")


__all__ = ["MetricsPlot", "plot_series"]
