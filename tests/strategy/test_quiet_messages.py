"""The strategy's messages, quiet by default and complete with LIGHTNING_BLOCKWISE_VERBOSE=1 (issue 43 item 12).

Re-plans (NOTE [ Re-plans in the log ] in strategy/step_planner.py), a `vram_budget` on the CPU said once, and sizes
that are not zero never printed as zero (NOTE [ No size printed as zero ] in planning/units.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_module
from torch import Tensor

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.quiet_logs import VERBOSE_ENV
from lightning_blockwise.planning.units import format_gb, format_gib, format_mib
from tests.helpers.models import CausalLMModule, build_model, fit, padded_batches

#: The re-plan lines the strategy logs, as Lightning's rank-zero logger records them.
_REPLAN = re.compile(r"^BlockwiseStrategy: (longer batch|masked attention over rows)")
_LARGEST = "BlockwiseStrategy: planned again"


def _growing_batches() -> list[dict[str, Tensor]]:
    """Four padded batches, each longer than the one before: four re-plans (the first for its masked rows)."""
    return [padded_batches(1, seq=seq, seed=seq)[0] for seq in (6, 8, 10, 12)]


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelno, record.getMessage()))


@contextmanager
def _strategy_records() -> Iterator[list[tuple[int, str]]]:
    """What the strategy logs through Lightning's `rank_zero_*`, DEBUG included, kept at the logger they write to.

    That logger is the last Lightning namespace's to be imported (`pytorch_lightning` renames it, as an earlier test in
    the same process may have), and Lightning's own may not propagate to pytest's `caplog`: a handler on it sees all.
    """
    log = rank_zero_module.log
    kept, level = _Kept(), log.level
    log.addHandler(kept)
    log.setLevel(logging.DEBUG)
    try:
        yield kept.records
    finally:
        log.removeHandler(kept)
        log.setLevel(level)


def _fit_growing() -> list[tuple[int, str]]:
    # Lightning's logger shows INFO: DEBUG is recorded here to count what went there.
    with _strategy_records() as records:
        fit(CausalLMModule(lambda: build_model("llama")), "blockwise", _growing_batches(), max_steps=4,
            accumulate_grad_batches=1)  # fmt: skip
    return records


def test_replans_show_the_first_and_the_largest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    records = _fit_growing()
    replans = [(level, message) for level, message in records if _REPLAN.match(message)]
    assert [level for level, _ in replans] == [logging.INFO] + [logging.DEBUG] * 3
    assert replans[0][1].startswith("BlockwiseStrategy: masked attention over rows of 6 tokens")
    largest = [message for level, message in records if level == logging.INFO and message.startswith(_LARGEST)]
    # Once, at the end: the count, the switch that shows each, and the last (largest) plan: 2 rows of 12 tokens.
    assert len(largest) == 1 and "planned again 4 times" in largest[0] and f"{VERBOSE_ENV}=1" in largest[0]
    assert "at 24 tokens per micro-batch" in largest[0] and largest[0].endswith(replans[-1][1].split(": ", 1)[1])


def test_control_verbose_shows_every_replan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the same run with LIGHTNING_BLOCKWISE_VERBOSE=1 shows all four at INFO, and no summary."""
    monkeypatch.setenv(VERBOSE_ENV, "1")
    records = _fit_growing()
    replans = [level for level, message in records if _REPLAN.match(message)]
    assert replans == [logging.INFO] * 4
    assert not [message for _, message in records if message.startswith(_LARGEST)]


def test_a_single_replan_needs_no_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of one length: the masked rows re-plan once, shown; nothing held back, so nothing said at the end."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    with _strategy_records() as records:
        fit(CausalLMModule(lambda: build_model("llama")), "blockwise", padded_batches(4), max_steps=2)
    assert [level for level, message in records if _REPLAN.match(message)] == [logging.INFO]
    assert not [message for _, message in records if message.startswith(_LARGEST)]


def _cpu_budget_warnings(recwarn: pytest.WarningsRecorder) -> list[str]:
    return [str(w.message) for w in recwarn if "has no effect on the CPU" in str(w.message)]


def test_a_cpu_budget_the_plan_refuses_is_said_once(recwarn: pytest.WarningsRecorder) -> None:
    """The refusal alone, which says what the warning said: on the CPU, drop `vram_budget`."""
    with pytest.raises(MisconfigurationException) as refusal:
        fit(CausalLMModule(lambda: build_model("llama")), BlockwiseStrategy(vram_budget="10MB"), max_steps=1)
    message = str(refusal.value)
    assert message.startswith("`BlockwiseStrategy(vram_budget=10000000)`: at 24 tokens per micro-batch")
    assert "On the CPU the budget caps no memory" in message and "drop `vram_budget`" in message
    assert _cpu_budget_warnings(recwarn) == []


def test_control_a_cpu_budget_the_plan_takes_is_warned_once(recwarn: pytest.WarningsRecorder) -> None:
    """Control: the warning still comes, once, where the plan takes the budget."""
    fit(CausalLMModule(lambda: build_model("llama")), BlockwiseStrategy(vram_budget="1GiB"), max_steps=1)
    assert len(_cpu_budget_warnings(recwarn)) == 1


@pytest.mark.parametrize(
    ("nbytes", "gb", "gb3", "gib", "mib"),
    [
        (50_000, "0.05 MB", "0.050 MB", "0.05 MiB", "49 KiB"),  # the demo's host arena: "0.000 GB" before
        (512, "0.51 kB", "0.001 MB", "0.50 KiB", "512 B"),
        (3, "3 B", "0.003 kB", "3 B", "3 B"),
        # Control: sizes that do not round to zero, and zero itself, read as before.
        (0, "0.00 GB", "0.000 GB", "0.00 GiB", "0 MiB"),
        (1_200_000_000, "1.20 GB", "1.200 GB", "1.12 GiB", "1144 MiB"),
        (270 * 2**20, "0.28 GB", "0.283 GB", "0.26 GiB", "270 MiB"),
    ],
)
def test_no_size_prints_as_zero(nbytes: int, gb: str, gb3: str, gib: str, mib: str) -> None:
    assert (format_gb(nbytes), format_gb(nbytes, digits=3), format_gib(nbytes), format_mib(nbytes)) == (
        gb,
        gb3,
        gib,
        mib,
    )


def test_the_setup_line_of_a_tiny_model_names_its_sizes() -> None:
    with _strategy_records() as records:
        fit(CausalLMModule(lambda: build_model("llama")), "blockwise", max_steps=1)
    line = next(message for _, message in records if "host arena" in message)
    assert not re.search(r"\b0\.0+ G", line), line
    assert re.search(r"host arena \d+\.\d{3} [kM]B \(\d+\.\d{3} [kM]B of tensors\)", line), line
    # The same line's larger sizes keep their unit.
    assert re.search(r"predicted training-step peak \d+\.\d\d [kMG]B allocated", line), line
