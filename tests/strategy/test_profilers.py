"""Lightning's profilers under `strategy="blockwise"`: training exact against `strategy="auto"`, and a report written.

`PyTorchProfiler` records each module's name through a forward pre-hook and a forward hook that return their input
and output unchanged; they observe (NOTE [ Forward hooks inside a rematerialized layer ] in replay/hooks.py; issue 42,
item 3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.profilers import AdvancedProfiler, Profiler, PyTorchProfiler, SimpleProfiler
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise.replay import hooks
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import CausalLMModule, RunResult, assert_equal_runs, build_model, fit, runs_differ

PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}


def _fit(kind: str, strategy: str, root: Path) -> tuple[RunResult, str, int]:
    """Two optimizer steps under ``PROFILERS[kind]``: the run, the text of its report, and the PyTorch profiler's
    records of decoder layer 1's MLP (0 for the others)."""
    profiler: Profiler = PROFILERS[kind](dirpath=root, filename="report")
    result = fit(CausalLMModule(lambda: build_model("llama")), strategy, max_steps=2, profiler=profiler)
    (report,) = root.glob("*report*.txt")
    events = getattr(profiler, "function_events", None) or []
    mlp = sum(1 for e in events if e.name.startswith("[pl][module]") and e.name.endswith("layers.1.mlp"))
    return result, report.read_text(), mlp


@pytest.mark.parametrize("kind", sorted(PROFILERS))
def test_profilers_train_exactly_and_report(kind: str, tmp_path: Path) -> None:
    expected, _, resident_records = _fit(kind, "auto", tmp_path / "auto")
    run, report, records = _fit(kind, "blockwise", tmp_path / "blockwise")
    assert_equal_runs(expected, run)
    assert "Profiler Report" in report and len(report.splitlines()) > 5
    # The PyTorch profiler records a module inside a rematerialized layer once per profiled micro-batch, as under
    # auto (none in the recompute).
    assert records == resident_records and (records > 0) == (kind == "pytorch")


def test_control_pytorch_profiler_refused_when_every_returned_value_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As before issue 42: the profiler's first hook inside a layer (the input norm's pre-hook) was refused."""
    monkeypatch.setattr(hooks, "_returned_as_given", lambda result, given, pre: False)
    with pytest.raises(MisconfigurationException, match=r"RegisterRecordFunction\._start_recording_forward"):
        _fit("pytorch", "blockwise", tmp_path)


def test_control_a_profiled_run_that_computes_otherwise_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison under a profiler can fail: without the recompute's RNG replay the run differs."""
    expected, _, _ = _fit("simple", "auto", tmp_path / "auto")
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    run, _, _ = _fit("simple", "blockwise", tmp_path / "blockwise")
    assert runs_differ(expected, run)
