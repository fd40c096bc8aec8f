"""The allocator under a budget: the user's PYTORCH_CUDA_ALLOC_CONF read, bad budgets refused, the cap set and put back.

The CUDA calls are stood in for on the CPU; `tests/strategy/test_gpu_budget.py` runs the real ones.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_blockwise.strategy.device_memory import (
    CARD_MARGIN,
    CARD_MARGIN_PERCENT,
    STRANDED_RELOCATE_BYTES,
    apply_cap,
    blas_workspace_bytes,
    card_budget,
    check_cap,
    expandable_segments_choice,
)

CARD = 80 * 2**30
DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _no_general_allocator_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    """PYTORCH_ALLOC_CONF would win over the PYTORCH_CUDA_ALLOC_CONF the tests set."""
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)


class _FakeCuda:
    """The per-process fraction and the allocator setting of one fake card."""

    def __init__(self, fraction: float = 1.0, settings: str = "") -> None:
        self.fraction = fraction
        self.settings = settings

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=CARD))
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: self.fraction)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self._set_fraction)
        monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", self._set_settings, raising=False)

    def _set_fraction(self, fraction: float, device: Any) -> None:
        self.fraction = fraction

    def _set_settings(self, settings: str) -> None:
        self.settings = settings


@pytest.mark.parametrize(
    ("conf", "expected"),
    [
        ("", None),
        ("max_split_size_mb:128", None),
        ("expandable_segments:True", True),
        ("max_split_size_mb:128, expandable_segments:False", False),
    ],
)
def test_the_users_choice_is_read(monkeypatch: pytest.MonkeyPatch, conf: str, expected: bool | None) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    assert expandable_segments_choice() is expected
    # torch reads PYTORCH_ALLOC_CONF first, and then ignores the CUDA-specific variable.
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert expandable_segments_choice() is False
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "")
    assert expandable_segments_choice() is None


def test_budget_becomes_the_cap_and_teardown_puts_back_what_it_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = _FakeCuda(fraction=0.9)
    cuda.install(monkeypatch)
    cap, changes = apply_cap(DEVICE, 20 * 2**30)
    assert cuda.fraction == 20 / 80 and cuda.settings == "expandable_segments:True"
    assert len(changes) == 2 and "expandable segments turned on" in changes[0] and "20.00 GiB" in changes[1]
    cap.restore()
    # The cap goes; expandable segments stay on for the process (NOTE [ Expandable segments ]).
    assert cuda.fraction == 0.9 and cuda.settings == "expandable_segments:True"


def test_no_budget_turns_on_segments_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    cap, changes = apply_cap(DEVICE, None)
    assert cuda.fraction == 1.0 and cuda.settings == "expandable_segments:True" and len(changes) == 1
    cap.restore()
    assert cuda.settings == "expandable_segments:True" and cuda.fraction == 1.0


def test_the_users_setting_stands(monkeypatch: pytest.MonkeyPatch) -> None:
    # Named by the user (on or off): left alone, and without a budget nothing else changes either.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    cuda = _FakeCuda(settings="expandable_segments:False")
    cuda.install(monkeypatch)
    cap, changes = apply_cap(DEVICE, None)
    assert changes == [] and cuda.settings == "expandable_segments:False"
    cap.restore()
    assert cuda.settings == "expandable_segments:False" and cuda.fraction == 1.0


@pytest.mark.parametrize(
    ("conf", "fraction", "budget", "match"),
    [
        ("expandable_segments:False", 1.0, 20 * 2**30, "Remove `expandable_segments:False`"),
        ("", 1.0, 81 * 2**30, r"more than the card's memory, 80.00 GiB. Lower it to at most 80.00 GiB"),
        ("", 0.25, 21 * 2**30, r"more than the cap set with `set_per_process_memory_fraction`, 20.00 GiB"),
    ],
)
def test_a_budget_that_cannot_be_kept_is_refused_before_anything_changes(
    monkeypatch: pytest.MonkeyPatch, conf: str, fraction: float, budget: int, match: str
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    cuda = _FakeCuda(fraction=fraction)
    cuda.install(monkeypatch)
    with pytest.raises(ValueError, match=match):
        check_cap(DEVICE, budget)
    with pytest.raises(ValueError, match=match):
        apply_cap(DEVICE, budget)
    assert cuda.fraction == fraction and cuda.settings == ""
    # Control arm: the same card takes a budget within it.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    check_cap(DEVICE, int(fraction * CARD))


def test_what_the_process_holds_outside_the_run_comes_on_top(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    _, changes = apply_cap(DEVICE, 20 * 2**30, held_outside=2 * 2**30)
    assert cuda.fraction == 22 / 80 and "22.00 GiB (20.00 GiB and 2.00 GiB the process held before)" in changes[-1]
    # Never past the card (or a cap the user set).
    fresh = _FakeCuda()
    fresh.install(monkeypatch)
    apply_cap(DEVICE, 79 * 2**30, held_outside=4 * 2**30)
    assert fresh.fraction == 1.0


class _Segments:
    """The allocator's reserved and allocated bytes on a fake card; moving the module out returns what it pinned."""

    def __init__(self, allocated: int, reserved: int, pinned_by_module: int) -> None:
        self.allocated, self.reserved, self.pinned_by_module = allocated, reserved, pinned_by_module
        self.moves: list[str] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)

    def relocate(self, target: torch.device) -> None:
        self.moves.append(target.type)
        if target.type == "cpu":  # the segments the module's tensors kept mapped are returned by empty_cache
            self.reserved -= self.pinned_by_module


def test_segments_the_base_left_behind_are_returned_before_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    # 3 GiB allocated in 10 GiB of segments; the module's tensors pin 6 GiB of the 7 free, 1 GiB stays stranded.
    segments = _Segments(allocated=3 * 2**30, reserved=10 * 2**30, pinned_by_module=6 * 2**30)
    segments.install(monkeypatch)
    _, changes = apply_cap(DEVICE, 7 * 2**30, relocate=segments.relocate)
    assert segments.moves == ["cpu", "cuda"]
    assert "6.00 GiB the allocator held free in segments mapped before the run returned" in changes[1]
    # What stays stranded is counted like memory held outside the run: the budget's 7 GiB is still the run's.
    assert cuda.fraction == 8 / 80
    assert "8.00 GiB (7.00 GiB and 1.00 GiB the process held before, 1.00 GiB of it reserved and free)" in changes[2]


def test_little_stranded_memory_is_counted_not_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    free = STRANDED_RELOCATE_BYTES - 2**20
    segments = _Segments(allocated=3 * 2**30, reserved=3 * 2**30 + free, pinned_by_module=free)
    segments.install(monkeypatch)
    _, changes = apply_cap(DEVICE, 7 * 2**30, relocate=segments.relocate)
    assert segments.moves == [] and len(changes) == 2
    assert cuda.fraction == (7 * 2**30 + free) / CARD
    # Control: one MiB more and the tensors move.
    segments = _Segments(allocated=3 * 2**30, reserved=3 * 2**30 + free + 2**20, pinned_by_module=free + 2**20)
    segments.install(monkeypatch)
    apply_cap(DEVICE, 7 * 2**30, relocate=segments.relocate)
    assert segments.moves == ["cpu", "cuda"] and cuda.fraction == 7 / 80


@pytest.mark.parametrize(
    ("config", "workspace"),
    [(":4096:8", 32 * 2**20), (":4096:2:16:8", 8 * 2**20 + 128 * 2**10), (":16:8", 128 * 2**10)],
)
def test_blas_workspaces_follow_the_users_config(monkeypatch: pytest.MonkeyPatch, config: str, workspace: int) -> None:
    """Two workspaces (the forward's and autograd's threads) of the size CUBLAS_WORKSPACE_CONFIG gives."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert blas_workspace_bytes(torch.device("cuda", 0)) == 2 * workspace
    assert blas_workspace_bytes(torch.device("cpu")) == 0


def _card_state(monkeypatch: pytest.MonkeyPatch, free: int, reserved: int, fraction: float = 1.0) -> None:
    _FakeCuda(fraction).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, CARD))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)


def test_the_cards_budget_is_what_the_process_may_use_less_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE [ The card as the default budget ]: free plus what this process's allocator holds already.
    _card_state(monkeypatch, free=70 * 2**30, reserved=6 * 2**30)
    card = card_budget(DEVICE)
    usable = 76 * 2**30
    assert card.usable == usable
    assert card.margin == usable * CARD_MARGIN_PERCENT // 100 > CARD_MARGIN
    assert card.budget == usable - card.margin
    assert "the card's budget" in card.why and "`vram_budget` overrides" in card.why


def test_the_cards_budget_respects_a_cap_another_job_and_what_the_process_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A per-process cap already set binds before the free memory does.
    _card_state(monkeypatch, free=70 * 2**30, reserved=2**30, fraction=0.25)
    capped = card_budget(DEVICE)
    assert capped.usable == CARD // 4
    assert capped.budget == CARD // 4 - CARD_MARGIN  # a 20 GiB limit keeps the 1 GiB floor
    assert "per-process cap" in capped.why
    # Another job on the card: only the free memory counts, and what this process holds outside the module too.
    _card_state(monkeypatch, free=10 * 2**30, reserved=2 * 2**30)
    shared = card_budget(DEVICE, held_outside=3 * 2**30)
    assert shared.budget == 12 * 2**30 - 3 * 2**30 - CARD_MARGIN
    assert "outside the module" in shared.why
    # Control: the same state with nothing held outside gives more.
    assert card_budget(DEVICE).budget == shared.budget + 3 * 2**30


def test_no_cards_budget_where_expandable_segments_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    _card_state(monkeypatch, free=70 * 2**30, reserved=0)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    card = card_budget(DEVICE)
    assert card.budget is None
    assert "every block streams" in card.why and "vram_budget" in card.why
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert card_budget(DEVICE).budget is not None  # control


def test_card_is_the_strategys_default_and_none_streams_every_block() -> None:
    from lightning_blockwise import BlockwiseStrategy

    default = BlockwiseStrategy()
    # The card's budget is measured at setup.
    assert default.options.uses_card and default.options.vram_budget is None and default.planned_budget is None
    streamed = BlockwiseStrategy(vram_budget=None)
    assert not streamed.options.uses_card and streamed.planned_budget is None
    set_budget = BlockwiseStrategy(vram_budget="16GiB")
    assert not set_budget.options.uses_card and set_budget.planned_budget == 16 * 2**30
