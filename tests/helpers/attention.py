"""What the kept-attention tests observe: the attention kernels that run, and a record one bit off (the control)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_blockwise.replay import kept_attention
from lightning_blockwise.replay.kept_attention import ATTENTION_OPERATORS

#: Integer views of float elements by their size: flipping the lowest bit moves a value by one unit in the last place.
_BITS = {2: torch.int16, 4: torch.int32}


class CountAttention(TorchDispatchMode):
    """Counts the fused attention kernels that run (those a kept record answers never reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    @property
    def total(self) -> int:
        """Every kernel counted."""
        return sum(self.calls.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func in ATTENTION_OPERATORS:
            self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def record_one_bit_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: every recorded attention output has the lowest bit of its first element flipped."""
    record = kept_attention._Record.__torch_dispatch__

    def flipped(self: Any, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        outputs = record(self, func, types, args, kwargs)
        entry = self.kept.entries[-1] if func in ATTENTION_OPERATORS else None
        if entry is not None:
            kept = entry.outputs[0].detach().clone()
            kept.view(_BITS[kept.element_size()])[(0,) * kept.dim()] ^= 1
            entry.outputs = (kept, *entry.outputs[1:])
            entry.versions = (kept._version, *entry.versions[1:])
        return outputs

    monkeypatch.setattr(kept_attention._Record, "__torch_dispatch__", flipped)
