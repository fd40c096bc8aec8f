"""Timing one training step for the planner: a layer's forward and backward, and the link's copy rate."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from lightning_blockwise.planning.speed import StepTimes
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.stream_trace import Trace, elapsed_ms

#: Bytes of the host arena copied to time the link when the timed step copied nothing (every block resident).
PROBE_BYTES = 64 * 2**20


def step_times(trace: Trace, kept: frozenset[int], tokens: int, probe: Callable[[], float]) -> StepTimes | None:
    """The per-layer times of a traced training step, or ``None`` if it ran no layer forward and backward apart.

    Args:
        trace: The step's trace, its events completed (synchronize first on CUDA).
        kept: Blocks whose layers kept their graphs in the step.
        tokens: Tokens of the step's micro-batch.
        probe: Measures the link's rate, for a step that copied nothing.
    """
    spans: dict[tuple[Pass, bool], list[float]] = {}
    for block, phase, start, end in trace.layers:
        spans.setdefault((phase, block in kept), []).append(elapsed_ms(start, end) / 1e3)
    forward = spans.get((Pass.FORWARD, False), []) + spans.get((Pass.FORWARD, True), [])
    recomputed = spans.get((Pass.BACKWARD, False), [])
    kept_backward = spans.get((Pass.BACKWARD, True), [])
    if not forward or not (recomputed or kept_backward):
        return None
    forward_s = statistics.median(forward)
    # A kept layer's backward is the recomputed one less its recompute (a forward), and back.
    kept_s = statistics.median(kept_backward) if kept_backward else max(statistics.median(recomputed) - forward_s, 0)
    recomputed_s = statistics.median(recomputed) if recomputed else kept_s + forward_s
    copy_s = sum(elapsed_ms(start, end) for _, start, end in trace.copies) / 1e3
    link = trace.bytes / copy_s if trace.copies and copy_s > 0 else probe()
    return StepTimes(forward_s, recomputed_s, kept_s, link, tokens)


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


__all__ = ["PROBE_BYTES", "link_rate", "step_times"]
