"""The layer inputs the offload holds for the backward: a handle for each, and the tally of their traffic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class OffloadStats:
    """Offload traffic since the last :meth:`ActivationOffload.reset_stats`."""

    saved: int = 0
    device_to_host_bytes: int = 0
    host_to_device_bytes: int = 0
    #: Inputs saved on the device: kept by a split (NOTE [ Split layer inputs ] in residency/activations.py) or not
    #: contiguous.
    kept_on_device: int = 0


class _Pool(Protocol):
    """What a saved input uses of the ``ActivationOffload`` that saved it (that module imports this one)."""

    _to_device: torch.cuda.Stream | None

    def _give(self, slab: Tensor, *events: torch.cuda.Event | None) -> None: ...


class SavedInput:
    """One layer input saved for the backward: in a host slab, or still on the device (kept, or not contiguous)."""

    __slots__ = (
        "__weakref__",
        "_device",
        "_fetched",
        "_fetched_event",
        "_host",
        "_pool",
        "_slab",
        "_stored",
        "_version",
    )

    def __init__(self, pool: _Pool, slab: Tensor | None, host: Tensor | None, device: Tensor | None):
        self._pool = pool
        self._slab = slab
        self._host = host
        self._device = device
        # What autograd's saved tensors check: an input kept on the device must not change before the backward.
        self._version = device._version if device is not None else 0
        self._stored: torch.cuda.Event | None = None
        self._fetched: Tensor | None = None
        self._fetched_event: torch.cuda.Event | None = None

    @property
    def host(self) -> Tensor | None:
        """The input's bytes in host memory (``None`` when it stayed on the device or was taken back)."""
        return self._host

    @property
    def pending(self) -> bool:
        """Whether the input waits in host memory and its copy back has not started."""
        return self._slab is not None and self._fetched is None

    @property
    def waiting(self) -> bool:
        """Whether the input still waits for the backward and nothing has started bringing it back."""
        return self._device is not None or self.pending

    def __del__(self) -> None:
        # A graph dropped without its backward (an exception, a loss never differentiated) gives its slab back.
        if self._slab is None:
            return
        if self._fetched is not None and self._fetched.is_cuda:
            # Its copy back may still be writing a buffer the compute stream no longer orders after it.
            self._fetched.record_stream(self._pool._to_device)
        self._pool._give(self._slab, self._stored, self._fetched_event)
        self._slab = self._stored = self._fetched_event = None


__all__ = ["OffloadStats", "SavedInput"]
