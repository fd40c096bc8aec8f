"""The order of a training step's layer runs: the forward, then the backward with its replays."""

from __future__ import annotations

from collections.abc import Iterator

from lightning_blockwise.residency.base import Pass


def step_order(layer: int, phase: Pass, num_layers: int, every: int | None) -> Iterator[tuple[int, Pass]]:
    """The layer runs that follow ``layer``'s run in ``phase`` within a training step.

    The streamer prefetches in this order (NOTE [ Prefetch order ] in residency/streamer.py). The forward runs
    ``0..num_layers-1``, then the backward. Without input checkpoints (``every`` ``None``) the backward runs the
    layers in reverse. With them, the layers form segments ``[c, c+every)`` from ``c = 0``; from the top segment
    down, the backward replays ``c..t-1`` (``t`` the segment's top layer) and then runs ``t..c`` backward
    (NOTE [ Input checkpoints ] in replay/segments.py).
    """
    if phase is Pass.FORWARD:
        yield from ((i, Pass.FORWARD) for i in range(layer + 1, num_layers))
        below = num_layers
    else:
        first, top = _segment_of(layer, every, num_layers)
        if phase is Pass.REPLAY:
            yield from ((i, Pass.REPLAY) for i in range(layer + 1, top))
            yield from ((i, Pass.BACKWARD) for i in range(top, first - 1, -1))
        else:
            yield from ((i, Pass.BACKWARD) for i in range(layer - 1, first - 1, -1))
        below = first
    while below > 0:
        first, top = _segment_of(below - 1, every, num_layers)
        yield from ((i, Pass.REPLAY) for i in range(first, top))
        yield from ((i, Pass.BACKWARD) for i in range(top, first - 1, -1))
        below = first


def _segment_of(layer: int, every: int | None, num_layers: int) -> tuple[int, int]:
    """The first and the top layer of ``layer``'s segment (a layer alone without input checkpoints)."""
    if every is None:
        return layer, layer
    first = layer - layer % every
    return first, min(first + every, num_layers) - 1


__all__ = ["step_order"]
