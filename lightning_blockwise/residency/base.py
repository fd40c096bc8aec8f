"""Where a block's frozen tensors live between uses, as seen by the rematerializing layers.

Every wrapped layer brackets each run of its frozen weights (its forward, its recompute
in the backward) with :meth:`Residency.acquire` and :meth:`Residency.release`. An
implementation that streams weights makes the layer's block usable on the compute
device in ``acquire`` (waiting for its copy, starting the next ones) and marks in
``release`` that the last kernel reading the block has been issued, so its slot may be
refilled once that work is done. :class:`AlwaysResident` is the implementation for
weights that never move.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum

from typing_extensions import override


class Pass(Enum):
    """Which pass a layer run belongs to; it decides the order blocks are needed in."""

    FORWARD = "forward"
    BACKWARD = "backward"
    #: A forward run inside the backward that recomputes layer inputs not kept (NOTE [ Input checkpoints ] in
    #: replay/segments.py): layers in forward order, between backward runs.
    REPLAY = "replay"


class Residency(ABC):
    """Makes each layer's frozen tensors usable on the compute device while the layer runs."""

    @abstractmethod
    def acquire(self, layer: int, phase: Pass) -> None:
        """Called before layer ``layer`` reads its frozen tensors in ``phase``."""

    @abstractmethod
    def release(self, layer: int, phase: Pass) -> None:
        """Called after the last kernel of layer ``layer`` in ``phase`` has been issued."""

    @abstractmethod
    def close(self) -> None:
        """Free what this residency holds on the device (streams, slots); the module stays usable."""


class AlwaysResident(Residency):
    """Weights stay where the module keeps them; nothing to move or wait for."""

    @override
    def acquire(self, layer: int, phase: Pass) -> None:
        pass

    @override
    def release(self, layer: int, phase: Pass) -> None:
        pass

    @override
    def close(self) -> None:
        pass
