"""Lightning callbacks for blockwise runs: a parity self-check and a profiler."""

from lightning_blockwise.callbacks.parity import ParityCheck, ParityError, ParityResult, TensorMismatch
from lightning_blockwise.callbacks.profiler import BlockwiseProfiler

__all__ = ["BlockwiseProfiler", "ParityCheck", "ParityError", "ParityResult", "TensorMismatch"]
