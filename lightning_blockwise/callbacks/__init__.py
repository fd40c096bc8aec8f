"""Lightning callbacks for blockwise runs: a parity self-check, a profiler, sampled generations, plots and a bar."""

from lightning_blockwise.callbacks.generation import SampleGenerations
from lightning_blockwise.callbacks.metrics_plot import MetricsPlot
from lightning_blockwise.callbacks.parity import ParityCheck, ParityError, ParityResult, TensorMismatch
from lightning_blockwise.callbacks.profiler import BlockwiseProfiler
from lightning_blockwise.callbacks.progress_bar import EpochProgressBar

__all__ = [
    "BlockwiseProfiler",
    "EpochProgressBar",
    "MetricsPlot",
    "ParityCheck",
    "ParityError",
    "ParityResult",
    "SampleGenerations",
    "TensorMismatch",
]
