"""Spending the budget on time (NOTE [ Spending the budget on time ]): the choice against every split there is."""

from __future__ import annotations

import itertools
import random

import pytest

from lightning_blockwise.planning import plan_residency
from lightning_blockwise.planning.memory import with_headroom
from lightning_blockwise.planning.speed import StepTimes, choose_blocks

#: A step whose copies hide under compute: a block's copy (100 bytes at 1000 B/s = 0.1 s) is shorter than its forward.
COMPUTE_BOUND = StepTimes(1.0, recomputed_backward_s=2.5, kept_backward_s=1.5, link_bytes_per_s=1000, tokens=8)
#: A step that waits on the link: a block's copy takes 10 s against 1 s of forward.
LINK_BOUND = StepTimes(1.0, recomputed_backward_s=2.5, kept_backward_s=1.5, link_bytes_per_s=10, tokens=8)


def _fits(block_bytes: list[int], capacity: int) -> callable:
    return lambda resident, kept_bytes: sum(block_bytes[:resident]) + kept_bytes <= capacity


def _layers(block_bytes: list[int]) -> list[int]:
    """Two layers per full block (100 bytes), one in a smaller one."""
    return [2 if size == 100 else 1 for size in block_bytes]


def _best_of_all(
    times: StepTimes, block_bytes: list[int], graph_bytes: list[int], capacity: int
) -> tuple[float, list[tuple[int, tuple[int, ...]]]]:
    """The least predicted time over every resident prefix and kept subset that fit, and the splits reaching it."""
    layers = _layers(block_bytes)
    results = []
    for resident in range(len(block_bytes) + 1):
        for size in range(len(block_bytes) + 1):
            for kept in itertools.combinations(range(len(block_bytes)), size):
                if sum(block_bytes[:resident]) + sum(graph_bytes[i] for i in kept) <= capacity:
                    results.append((times.step_seconds(layers, block_bytes, resident, set(kept)), resident, kept))
    best = min(seconds for seconds, _, _ in results)
    return best, [(r, k) for seconds, r, k in results if seconds <= best * (1 + 1e-12)]


def test_compute_bound_spends_on_graphs_first_streamed_ones_too() -> None:
    blocks, graphs = [100] * 6, [30] * 6
    resident, kept = choose_blocks(COMPUTE_BOUND, [1] * 6, blocks, graphs, _fits(blocks, 6 * 30 + 100))
    # Every layer keeps its graph (5 of them in streamed blocks); what is left buys one resident block.
    assert kept == (0, 1, 2, 3, 4, 5) and resident == 1


def test_link_bound_spends_on_residency_first() -> None:
    blocks, graphs = [100] * 6, [30] * 6
    resident, kept = choose_blocks(LINK_BOUND, [1] * 6, blocks, graphs, _fits(blocks, 6 * 30 + 100))
    # Keeping a streamed block's graph saves nothing when its backward waits for the copy: resident blocks instead.
    assert resident == 2 and set(kept) <= set(range(resident))


@pytest.mark.parametrize("last_block", [1.0, 0.6], ids=["uniform", "smaller last block"])
@pytest.mark.parametrize("seed", range(12))
def test_the_choice_is_the_best_split_there_is(seed: int, last_block: float) -> None:
    """Against every resident prefix and kept subset that fit: the least predicted time, and no other fits better."""
    rng = random.Random(seed)
    count = 5
    times = StepTimes(
        forward_s=rng.uniform(0.5, 2),
        recomputed_backward_s=rng.uniform(2, 5),
        kept_backward_s=rng.uniform(0.5, 2),
        link_bytes_per_s=rng.choice([5.0, 50.0, 500.0]),
        tokens=8,
    )
    # A smaller last block: a block size that does not divide the layer count (fewer layers, fewer bytes).
    graph = rng.choice([10, 40, 120])
    blocks = [100] * (count - 1) + [int(100 * last_block)]
    graphs = [graph] * (count - 1) + [int(graph * last_block)]
    capacity = rng.randrange(0, sum(blocks) + sum(graphs))
    resident, kept = choose_blocks(times, _layers(blocks), blocks, graphs, _fits(blocks, capacity))
    assert sum(blocks[:resident]) + sum(graphs[i] for i in kept) <= capacity
    best, splits = _best_of_all(times, blocks, graphs, capacity)
    assert times.step_seconds(_layers(blocks), blocks, resident, set(kept)) <= best * (1 + 1e-12)
    # Ties go to the largest resident prefix among the best splits.
    assert resident == max(r for r, _ in splits)


def test_control_a_worse_split_is_told_apart() -> None:
    """Control of the comparison above: the untimed split (resident-kept prefix) is slower on a compute-bound step."""
    blocks, graphs = [100] * 6, [30] * 6
    capacity = 6 * 30 + 100
    # Three slots of 100 bytes on top (the plan streams at least three blocks here).
    first = plan_residency(blocks, 2, 0, 0, 0, with_headroom(3 * 100 + capacity), graph_bytes=graphs)
    assert first.kept == (0, 1) and first.resident == (0, 1)
    best, _ = _best_of_all(COMPUTE_BOUND, blocks, graphs, capacity)
    first_seconds = COMPUTE_BOUND.step_seconds(_layers(blocks), blocks, len(first.resident), set(first.kept))
    assert first_seconds > best


def test_a_timed_plan_fits_the_budget_and_keeps_streamed_graphs() -> None:
    blocks, graphs = [100] * 8, [30] * 8
    minimum = plan_residency(blocks, 2, 1000, 10, 50, None).minimum
    budget = minimum + 8 * 30 + 10
    untimed = plan_residency(blocks, 2, 1000, 10, 50, budget, graph_bytes=graphs)
    timed = plan_residency(
        blocks, 2, 1000, 10, 50, budget, graph_bytes=graphs, times=COMPUTE_BOUND, block_layers=[1] * 8
    )
    assert with_headroom(timed.predicted_peak) <= budget and with_headroom(untimed.predicted_peak) <= budget
    # Untimed: graphs only where the block is resident too. Timed, compute-bound: graphs of streamed blocks as well.
    assert set(untimed.kept) <= set(untimed.resident)
    assert len(timed.kept) > len(untimed.kept) and set(timed.kept) - set(timed.resident)
