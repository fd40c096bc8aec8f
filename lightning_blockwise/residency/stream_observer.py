"""The streamer's observer: hooks for its copies, waits and layer runs, which this base ignores."""

from __future__ import annotations

from lightning_blockwise.residency.base import Pass


class StreamObserver:
    """Receives the streamer's copies, waits and layer runs as they are issued; this base ignores them.

    See NOTE [ Stream observer ] in residency/streamer.py. Subclass it and hand an instance to
    :meth:`~lightning_blockwise.BlockwiseStrategy.set_observer` to profile a run: the strategy
    gives it to every streamer it builds.
    """

    def copy_started(self, block: int) -> None:
        """A copy of ``block`` into its slot is about to be issued on the copy stream."""

    def copy_finished(self, block: int, nbytes: int) -> None:
        """The copy of ``block`` (``nbytes`` bytes) has been issued on the copy stream."""

    def wait_started(self, block: int) -> None:
        """The compute stream is about to wait for the copy of ``block``."""

    def wait_finished(self, block: int) -> None:
        """The compute stream's wait for the copy of ``block`` has been issued."""

    def layer_started(self, layer: int, phase: Pass) -> None:
        """Layer ``layer``'s block is usable; its kernels in ``phase`` follow on the compute stream."""

    def layer_finished(self, layer: int, phase: Pass) -> None:
        """The last kernel of layer ``layer`` in ``phase`` has been issued on the compute stream."""


__all__ = ["StreamObserver"]
