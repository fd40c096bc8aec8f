"""The longest-context search and the expected step time (planning/longest.py): pure arithmetic, by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_blockwise.planning.longest import SEARCH_LIMIT, StepCost, longest_fit, step_time


@pytest.mark.parametrize("threshold", [1024, 1025, 5000, 131072, 131071, 700_000])
def test_the_answer_fits_and_one_step_more_does_not(threshold: int) -> None:
    asked = []

    def fits(tokens: int) -> bool:
        asked.append(tokens)
        return tokens <= threshold

    answer = longest_fit(fits)
    assert answer is not None and answer % 1024 == 0
    assert fits(answer) and not fits(answer + 1024)
    # Doubling, then bisection: a few dozen questions at most, not one per length.
    assert len(asked) <= 2 * (threshold // 1024).bit_length() + 4


def test_nothing_fits_and_everything_fits() -> None:
    assert longest_fit(lambda tokens: False) is None
    assert longest_fit(lambda tokens: True) == SEARCH_LIMIT
    assert longest_fit(lambda tokens: True, granularity=1000, limit=10_500) == 10_000
    with pytest.raises(ValueError, match="granularity=0 must be between 1 and limit"):
        longest_fit(lambda tokens: True, granularity=0)


def test_a_search_on_a_predicate_that_is_not_monotone_can_miss() -> None:
    """The control arm of the monotone assumption: a hole at 2048 hides every longer length that fits."""
    assert longest_fit(lambda tokens: tokens != 2048 and tokens <= 8192) == 1024


def test_step_time_by_hand() -> None:
    cost = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500, offloaded_bytes=100)
    # 6 x 1000 x 4 matmul FLOPs and 9 x 4^2 x 10 x 2 attention FLOPs, at 1 TFLOP/s.
    assert cost.flops(4) == 6 * 1000 * 4 + 9 * 16 * 10 * 2
    time = step_time(cost, 4, tflops=1e-12, link_gbps=1e-9)
    assert time.compute == pytest.approx(24000 + 2880)
    # Two passes of the arena and the inputs coming back host-to-device; the inputs going out the other way.
    assert time.link == pytest.approx(2 * 500 + 100)
    assert time.seconds == time.compute and time.bound == "compute"
    slow_link = step_time(cost, 4, tflops=1e-12, link_gbps=1e-12)
    assert slow_link.bound == "link" and slow_link.seconds == slow_link.link


def test_step_time_with_recomputed_matmuls_and_a_second_level_recompute() -> None:
    plain = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500)
    tiled = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500, recomputed_params=300)
    assert tiled.flops(4) - plain.flops(4) == 2 * 300 * 4
    twice = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500, recompute_every=4)
    # A third forward: 8 x params x tokens and 11 x tokens^2; the arena crosses the link three times.
    assert twice.flops(4) == 8 * 1000 * 4 + 11 * 16 * 10 * 2
    assert (twice.link_bytes(), plain.link_bytes()) == (1500, 1000)


def test_kept_layers_run_one_forward_not_two() -> None:
    """A layer that keeps its activations is not recomputed (NOTE [ Expected step time ]); the others are."""
    plain = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500)
    kept = StepCost(
        matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500, kept_layers=1, kept_params=400
    )
    # Its recompute's 2 x 400 x 4 matmul and 2 x 4^2 x 10 attention FLOPs are not run (control: plain counts them).
    assert plain.flops(4) - kept.flops(4) == 2 * 400 * 4 + 2 * 16 * 10
    # Every layer kept: resident training's forward and backward, 4 x params and 7 x tokens^2 x size x layers.
    resident = StepCost(
        matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=0, kept_layers=2, kept_params=1000
    )
    assert resident.flops(4) == 4 * 1000 * 4 + 7 * 16 * 10 * 2
    # With a second-level recompute a kept layer skips both recomputes.
    twice = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500, recompute_every=2)
    assert twice.flops(4) - replace(twice, kept_layers=1, kept_params=400).flops(4) == 2 * (2 * 400 * 4 + 2 * 16 * 10)


def test_tiled_attention_runs_one_attention_forward_more() -> None:
    """Each tile's forward runs again in its backward (NOTE [ Expected step time ]), kept layers included."""
    plain = StepCost(matmul_params=1000, num_layers=2, attention_size=10, arena_bytes=500)
    tiled = replace(plain, tiled_attention=True)
    # 2 x 4^2 x 10 per layer: 9 + 2 = 11 x tokens^2 x size x layers (control: the untiled step's 9).
    assert tiled.flops(4) - plain.flops(4) == 2 * 16 * 10 * 2
    assert tiled.flops(4) == 6 * 1000 * 4 + 11 * 16 * 10 * 2
    # A kept layer skips the recompute, not the tiles' own: the difference is the same with every layer kept.
    kept = replace(plain, kept_layers=2, kept_params=1000)
    assert replace(kept, tiled_attention=True).flops(4) - kept.flops(4) == 2 * 16 * 10 * 2
    assert tiled.link_bytes() == plain.link_bytes()


@pytest.mark.parametrize(("tflops", "link"), [(0, 25), (150, 0), (-1, 25), (float("nan"), 25)])
def test_step_time_refuses_rates_that_are_not_positive(tflops: float, link: float) -> None:
    cost = StepCost(matmul_params=1, num_layers=1, attention_size=1, arena_bytes=1)
    with pytest.raises(ValueError, match="must both be positive rates"):
        step_time(cost, 1, tflops=tflops, link_gbps=link)
