"""The host link's copy rate, measured on a slice of the host arena."""

from __future__ import annotations

import time

import torch
from torch import Tensor

#: Bytes of the host arena copied to time the link.
PROBE_BYTES = 64 * 2**20


def link_rate(host: Tensor, device: torch.device) -> float:
    """Bytes per second of a copy of (up to :data:`PROBE_BYTES` of) ``host`` to ``device``; the second of two."""
    source = host.view(torch.uint8).flatten()[:PROBE_BYTES]
    target = torch.empty_like(source, device=device)
    seconds = 0.0
    for _ in range(2):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            target.copy_(source)
            seconds = time.perf_counter() - began
    return source.numel() / max(seconds, 1e-9)


__all__ = ["PROBE_BYTES", "link_rate"]
