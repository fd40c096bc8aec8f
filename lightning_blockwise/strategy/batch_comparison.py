"""Whether two batches are the same, bit for bit, without a device sync per batch; and copies of batches.

What block-major accumulation checks a batch read ahead against (NOTE [ A window's batches ] in
accumulation.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


def batches_differ(a: Any, b: Any) -> bool | Tensor:
    """Whether two batches differ, bit for bit (NaN equals NaN), through mappings, sequences and dataclasses.

    A ``bool`` where the host can tell without waiting for the device; else a 0-dim bool tensor on the
    batches' device, so that comparing GPU batches does not synchronize every micro-batch.
    """
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
            return True
        if (a.dtype, a.shape, a.device) != (b.dtype, b.shape, b.device):
            return True
        flag = (_bits(a) != _bits(b)).any()
        return bool(flag) if flag.device.type == "cpu" else flag
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            return True
        return _any([batches_differ(a[key], b[key]) for key in a])
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return True
        return _any([batches_differ(x, y) for x, y in zip(a, b, strict=True)])
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and not isinstance(a, type):
        if type(a) is not type(b):
            return True
        return _any([batches_differ(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)])
    try:
        return not bool(a == b)
    except Exception:  # an object without a usable `==` is compared by identity
        return a is not b


def _any(parts: list[bool | Tensor]) -> bool | Tensor:
    """True if a part is; else the device-side parts combined (False if there are none)."""
    if any(part is True for part in parts):
        return True
    flags = [part for part in parts if isinstance(part, Tensor)]
    return torch.stack(flags).any() if flags else False


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's bytes, to compare floating point values bit for bit."""
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    return tensor.contiguous().view(torch.uint8)


def clone_batch(batch: Any) -> Any:
    """``batch`` with every tensor copied (mappings, sequences and dataclasses rebuilt)."""
    return apply_to_collection(batch, Tensor, lambda t: t.clone())


__all__ = ["batches_differ", "clone_batch"]
