"""Lightning callbacks for blockwise runs: a parity self-check, a profiler and sampled generations."""

from lightning_blockwise.callbacks.generation import SampleGenerations
from lightning_blockwise.callbacks.parity import ParityCheck, ParityError, ParityResult, TensorMismatch
from lightning_blockwise.callbacks.profiler import BlockwiseProfiler

__all__ = ["BlockwiseProfiler", "ParityCheck", "ParityError", "ParityResult", "SampleGenerations", "TensorMismatch"]
