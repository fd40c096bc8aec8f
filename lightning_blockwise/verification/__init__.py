"""Parity of one training step, resident vs blockwise: the result model and the checking engine.

:class:`~lightning_blockwise.callbacks.parity.ParityCheck` runs :func:`check_step` at fit start;
:mod:`.result` holds what it finds (:class:`ParityResult` and its report), :mod:`.check` runs
and compares the steps.
"""

from lightning_blockwise.verification.check import check_step, compare, first_batch, no_trace
from lightning_blockwise.verification.result import ParityError, ParityResult, TensorMismatch

__all__ = ["ParityError", "ParityResult", "TensorMismatch", "check_step", "compare", "first_batch", "no_trace"]
