"""Writing a run's product once, on global rank 0, with every rank in step: what a fit's last hook does.

Example::

    target = Path(trainer.log_dir) / "adapter"  # on every rank: `log_dir` is a collective
    written = export_on_rank_zero(trainer.strategy, lambda: export_adapter(model, target), "MyModule")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

# NOTE [ One export, every rank in step ]
# Every hook runs on every rank, so a collective in a hook must be joined by all of them or by none.
# `trainer.log_dir` is one (a broadcast of rank 0's directory, whatever the logger): a rank that
# skips it while another calls it crashes the run on gloo and leaves it waiting on NCCL until the
# timeout, at the end of a fit whose adapter was never written. So the directory is worked out on
# every rank, and the export itself is rank 0's alone, between two points all ranks reach:
# - a barrier before it, so that the adapter only appears once every rank has finished training
#   (a rank that failed in its last step leaves no adapter that looks complete);
# - a broadcast after it of where rank 0 wrote (a fallback directory, NOTE [ Atomic adapter export ]
#   in export/adapter.py) or why it could not, so that no rank returns before the adapter exists (a
#   launcher that sees every process done may read it at once) and a failed export fails every rank
#   instead of leaving the others waiting for rank 0.
# The write itself is atomic (`export_adapter` stages it and renames it into place).


def export_on_rank_zero(strategy: Strategy, write: Callable[[], Path], owner: str) -> Path:
    """Call ``write`` on global rank 0 once every rank gets here; return where it wrote, on every rank.

    NOTE [ One export, every rank in step ]. Every rank must call it, at the same point; with one process it is
    ``write()``.

    Args:
        strategy: The Trainer's strategy (its ``barrier`` and ``broadcast``).
        write: Writes the export and returns where it went; called on global rank 0 only.
        owner: Who exports, for the error the other ranks raise (e.g. ``"CausalLMFineTune"``).

    Returns:
        What ``write`` returned on rank 0.

    Raises:
        MisconfigurationException: On the other ranks, if ``write`` raised one on rank 0 (which re-raises its own).
        RuntimeError: On the other ranks, if ``write`` raised anything else on rank 0.
    """
    strategy.barrier("export_on_rank_zero")
    written: Path | None = None
    failure: BaseException | None = None
    if strategy.is_global_zero:
        try:
            written = write()
        except Exception as raised:  # told to the other ranks before it is raised here
            failure = raised
    # What the other ranks learn: where it went, or rank 0's error (its message, and whether it was the user's).
    error = None if failure is None else (str(failure), isinstance(failure, MisconfigurationException))
    where, error = strategy.broadcast((None if written is None else str(written), error), src=0)
    if failure is not None:
        raise failure
    if error is not None:
        text, misconfigured = error
        message = f"{owner}: global rank 0 could not write the export: {text}"
        raise MisconfigurationException(message) if misconfigured else RuntimeError(message)
    assert where is not None
    return Path(where)


__all__ = ["export_on_rank_zero"]
