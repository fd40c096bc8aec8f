"""`MetricsPlot`: the loss curves it records are the logged losses, and the PNG it writes holds them."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from matplotlib.image import imread

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.callbacks import MetricsPlot
from lightning_blockwise.callbacks.metrics_plot import plot_series
from tests.helpers.models import CausalLMModule, LoggingModule, build_model, loader, padded_batches, trainer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _fit(tmp_path: Path, plot: MetricsPlot, accumulate: int = 1) -> tuple[LoggingModule, CSVLogger]:
    module = LoggingModule(lambda: build_model("llama"))
    logger = CSVLogger(tmp_path, name="logs")
    fitter = trainer(
        BlockwiseStrategy(), max_steps=4, accumulate_grad_batches=accumulate, logger=logger, log_every_n_steps=1,
        limit_val_batches=1, val_check_interval=2 * accumulate, num_sanity_val_steps=1, callbacks=[plot],
    )  # fmt: skip
    batches = padded_batches(8)
    fitter.fit(module, loader(batches), loader(batches[:1]))
    return module, logger


def test_plots_the_logged_losses_to_a_png_in_the_log_dir(tmp_path: Path) -> None:
    plot = MetricsPlot()
    module, logger = _fit(tmp_path, plot)
    # The recorded curves are the losses the module logged: one training point per step, one validation point per
    # validation (after steps 2 and 4; the sanity check is left out).
    train = [(step + 1, loss.item()) for step, loss in enumerate(module.losses)]
    assert plot.series["train_loss"] == train
    assert [step for step, _ in plot.series["val_loss"]] == [2, 4]
    assert [value for _, value in plot.series["val_loss"]] == [loss.item() for loss in module.val_losses[1:]]
    # ... and they are what the logger wrote to metrics.csv.
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = [float(row["train_loss"]) for row in csv.DictReader(f) if row["train_loss"]]
    assert logged == pytest.approx([value for _, value in train], rel=1e-6)
    # A valid PNG next to metrics.csv, with something drawn on it.
    assert plot.path == Path(logger.log_dir) / "loss.png"
    assert plot.path.read_bytes().startswith(PNG_SIGNATURE)
    pixels = torch.from_numpy(imread(plot.path))
    assert pixels.shape == (400, 700, 4) and pixels.flatten(0, 1).unique(dim=0).shape[0] > 10


def test_one_point_per_optimizer_step_with_accumulation(tmp_path: Path) -> None:
    """Two micro-batches a step: the step's point is the last micro-batch's loss (what the logger logs for it)."""
    plot = MetricsPlot(metrics=["train_loss"])
    module, _ = _fit(tmp_path, plot, accumulate=2)
    assert plot.series.keys() == {"train_loss"}
    assert plot.series["train_loss"] == [(step + 1, module.losses[2 * step + 1].item()) for step in range(4)]


def test_the_curves_survive_a_resume(tmp_path: Path) -> None:
    plot = MetricsPlot()
    _fit(tmp_path, plot)
    restored = MetricsPlot()
    restored.load_state_dict(plot.state_dict())
    assert restored.series == plot.series and restored.series is not plot.series


def test_nothing_logged_writes_nothing(tmp_path: Path) -> None:
    """Control: a run that logs no loss gets no PNG (and no error)."""
    plot = MetricsPlot()
    trainer(BlockwiseStrategy(), max_steps=2, default_root_dir=tmp_path, callbacks=[plot]).fit(
        CausalLMModule(lambda: build_model("llama")), loader(padded_batches(4))
    )
    assert plot.series == {} and plot.path is None and not list(tmp_path.rglob("*.png"))


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"MetricsPlot\(filename='loss.jpg'\) writes a PNG"):
        MetricsPlot(filename="loss.jpg")
    with pytest.raises(MisconfigurationException, match=r"MetricsPlot\(metrics=\[\]\) would plot nothing"):
        MetricsPlot(metrics=[])


class _RankTrainer:
    """A trainer as one rank sees it at fit end; `log_dir` counts its reads (each is a broadcast in Lightning)."""

    def __init__(self, zero: bool, log_dir: Path) -> None:
        self.is_global_zero = zero
        self.default_root_dir = str(log_dir)
        self._log_dir = log_dir
        self.reads = 0

    @property
    def log_dir(self) -> str:
        self.reads += 1
        return str(self._log_dir)


@pytest.mark.parametrize("series", [{}, {"train_loss": [(1, 2.0), (2, 1.0)]}], ids=["nothing logged", "logged"])
def test_every_rank_reads_the_log_dir_and_rank_zero_alone_plots(tmp_path: Path, series: dict) -> None:
    """`trainer.log_dir` is a collective (NOTE [ One export, every rank in step ]): every rank reads it once at fit
    end, logged or not, and only rank 0 writes. Control: rank 0 writes the PNG where rank 1 writes nothing."""
    ranks = [_RankTrainer(zero, tmp_path / f"rank{int(not zero)}") for zero in (True, False)]
    for rank in ranks:
        plot = MetricsPlot()
        plot.series = dict(series)
        plot.on_fit_end(rank, None)  # type: ignore[arg-type]
        assert rank.reads == 1
    assert (tmp_path / "rank0" / "loss.png").is_file() == bool(series)
    assert not (tmp_path / "rank1").exists()


def test_a_filename_in_a_folder_creates_the_folder(tmp_path: Path) -> None:
    """`MetricsPlot(filename="plots/loss.png")` was accepted and then crashed at the end of a finished fit."""
    plot = MetricsPlot(filename="plots/loss.png")
    plot.series = {"train_loss": [(1, 2.0), (2, 1.0)]}
    plot.on_fit_end(_RankTrainer(True, tmp_path / "version_0"), None)  # type: ignore[arg-type]
    assert plot.path == tmp_path / "version_0" / "plots" / "loss.png"
    assert plot.path.read_bytes().startswith(PNG_SIGNATURE)
    # Control: the plot itself creates no folder; without the one created above the write fails.
    with pytest.raises(FileNotFoundError):
        plot_series(plot.series, tmp_path / "no-folder" / "loss.png")


def test_log_scale_must_be_a_bool() -> None:
    """NOTE [ A string is not a flag ] in compat/flags.py: `log_scale="no"` drew a log scale."""
    with pytest.raises(MisconfigurationException, match=r"^`MetricsPlot\(log_scale='no'\)` must be True or False"):
        MetricsPlot(log_scale="no")  # type: ignore[arg-type]
    assert MetricsPlot(log_scale=False).log_scale is False  # control: a bool is taken
