"""Spending a budget on time: which blocks keep their graphs and which stay resident, from measured times."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# NOTE [ Spending the budget on time ]
# Memory beyond the streamed minimum buys two things per block: its layers' graphs (kept: no
# recompute, ``g`` bytes a layer) and its slab (resident: no copies, ``b`` bytes). Which buys
# more time depends on the machine. A block costs, per step,
#
#     streamed:  max(forward, copy) + max(backward, copy)
#     resident:  forward + backward
#
# where ``copy`` is its slab over the link, ``forward`` its layers' forward and ``backward``
# their backward: a forward more (the recompute) unless the block keeps its graphs. Copies
# run beside compute (prefetched on their own stream), hence the ``max``. On a compute-bound
# step (H100, 7B and 32B at 512 tokens: a block's copy takes less than its forward) residency
# saves nothing and every byte should go to graphs, which a streamed block may keep too
# (NOTE [ Kept graphs of streamed blocks ] in replay/kept.py). On a link-bound step (72B, a
# slow or shared link) keeping a streamed block's graph saves nothing, since the backward
# waits for the copy anyway, and residency first is right. The planner therefore times one
# training step (its layers' forward and backward, its copies) and then, for every count of
# resident blocks that fits, keeps graphs where they save the most per byte, and takes the
# split with the least predicted step time; ties go to more resident blocks (residency also
# saves host work and link traffic the model does not count). Before the timed step, and
# when no step has been timed, the budget goes to resident blocks that keep their graphs,
# from the first on: never slower than streaming, whatever the machine. What the model leaves
# out: the host's work per streamed block (acquire, release: ~0.5 ms a layer and pass on the
# H100's host) and the lower cost of plain autograd on resident kept blocks (no wrappers, no
# nested backward). On the host-bound H100 steps measured, the timed plans were no faster than
# the untimed ones (benchmarks/RESULTS.md, "Timed plan"), so ``timed_plan`` is opt-in.


@dataclass(frozen=True)
class StepTimes:
    """What one timed training step measured, per decoder layer (NOTE [ Spending the budget on time ]).

    Attributes:
        forward_s: A layer's forward (the median over the step's layers).
        recomputed_backward_s: A rematerialized layer's backward: its recompute and its backward.
        kept_backward_s: A layer's backward from a kept graph (measured on kept layers of streamed
            blocks; else the rematerialized backward less a forward).
        link_bytes_per_s: The host-to-device copy rate.
        tokens: Tokens of the timed micro-batch.
    """

    forward_s: float
    recomputed_backward_s: float
    kept_backward_s: float
    link_bytes_per_s: float
    tokens: int

    def block_seconds(self, layers: int, nbytes: int, resident: bool, kept: bool) -> float:
        """Predicted time of a block of ``layers`` layers and ``nbytes`` bytes in one training step."""
        forward = layers * self.forward_s
        backward = layers * (self.kept_backward_s if kept else self.recomputed_backward_s)
        if resident:
            return forward + backward
        copy = nbytes / self.link_bytes_per_s
        return max(forward, copy) + max(backward, copy)

    def step_seconds(
        self, block_layers: Sequence[int], block_bytes: Sequence[int], resident: int, kept: Collection[int]
    ) -> float:
        """Predicted decoder time of a step with the first ``resident`` blocks resident and ``kept`` keeping graphs."""
        return sum(
            self.block_seconds(layers, nbytes, index < resident, index in kept)
            for index, (layers, nbytes) in enumerate(zip(block_layers, block_bytes, strict=True))
        )

    def describe(self) -> str:
        """One line for the log: the measured parts."""
        return (
            f"a layer's forward {self.forward_s * 1e3:.2f} ms, its backward {self.recomputed_backward_s * 1e3:.2f} ms"
            f" recomputed / {self.kept_backward_s * 1e3:.2f} ms kept, copies at {self.link_bytes_per_s / 1e9:.1f} GB/s,"
            f" at {self.tokens} tokens"
        )


def choose_blocks(
    times: StepTimes,
    block_layers: Sequence[int],
    block_bytes: Sequence[int],
    graph_bytes: Sequence[int],
    fits: Callable[[int, int], bool],
) -> tuple[int, tuple[int, ...]]:
    """The resident prefix and the kept blocks with the least predicted step time that fit.

    Args:
        times: The measured step.
        block_layers: Layers in each block.
        block_bytes: Each block's slab size.
        graph_bytes: Each block's layers' graphs.
        fits: Whether a plan with this many resident blocks and kept graphs of this many bytes fits the budget.

    Returns:
        The number of resident blocks (a prefix) and the kept blocks, sorted.
    """
    best: tuple[float, int, tuple[int, ...]] | None = None
    for resident in range(len(block_bytes) + 1):
        if not fits(resident, 0):
            break
        saving = [
            times.block_seconds(layers, nbytes, index < resident, kept=False)
            - times.block_seconds(layers, nbytes, index < resident, kept=True)
            for index, (layers, nbytes) in enumerate(zip(block_layers, block_bytes, strict=True))
        ]
        order = sorted(range(len(block_bytes)), key=lambda i: (-saving[i] / max(graph_bytes[i], 1), i))
        kept: list[int] = []
        kept_bytes = 0
        for index in order:
            if saving[index] > 0 and fits(resident, kept_bytes + graph_bytes[index]):
                kept.append(index)
                kept_bytes += graph_bytes[index]
        seconds = times.step_seconds(block_layers, block_bytes, resident, set(kept))
        # `<=`: a tie goes to the later, larger resident prefix.
        if best is None or seconds <= best[0]:
            best = (seconds, resident, tuple(sorted(kept)))
    assert best is not None, "the caller checks that the streamed plan fits"
    return best[1], best[2]


__all__ = ["StepTimes", "choose_blocks"]
