"""`benchmarks/dora.py` end to end on the CPU (its tiny shape): every arm, one base, out of memory as a result."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.dora import DoraLinearLayer
from torch import nn

from benchmarks import dora
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.residency import placement

#: What every JSON line carries.
FIELDS = {
    "shape", "arm", "rank", "seq", "s_per_step", "tokens_per_s", "peak_allocated_gb", "peak_reserved_gb", "device",
    "versions", "mode", "status", "error", "cap_gib", "base", "trainable_params", "factored_modules", "build_s",
}  # fmt: skip
TINY_RUN = ["--shape", "tiny", "--seq", "16", "--steps", "1", "--cap-gib", "0", "--deterministic"]
#: Decoder layers of the tiny shape times the seven projections.
LINEARS = 2 * 7


class _Counting:
    """Wraps a callable and counts its calls (the base builder, the host arena's constructor)."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped, self.results = wrapped, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.results.append(self.wrapped(*args, **kwargs))
        return self.results[-1]


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> tuple[_Counting, _Counting]:
    builds, arenas = _Counting(dora.build_base), _Counting(placement.HostArena)
    monkeypatch.setattr(dora, "build_base", builds)
    monkeypatch.setattr(placement, "HostArena", arenas)
    return builds, arenas


def test_every_arm_and_rank_runs_on_one_base(tmp_path: Path, spies: tuple[_Counting, _Counting]) -> None:
    out = tmp_path / "dora.jsonl"
    rows = dora.main([*TINY_RUN, "--base", "device", "--ranks", "4", "8", "--out", str(out)])
    assert [(r["rank"], r["arm"]) for r in rows] == [(r, a) for r in (4, 8) for a in dora.ARMS]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
    for row in rows:
        assert FIELDS <= row.keys(), FIELDS - row.keys()
        assert row["status"] == "ok" and row["error"] is None and row["mode"] == "deterministic"
        assert row["s_per_step"] > 0 and row["tokens_per_s"] == pytest.approx(16 / row["s_per_step"])
        assert row["device"] == "cpu" and row["peak_allocated_gb"] is None and row["versions"]["peft"]
        assert row["factored_modules"] == (LINEARS if row["arm"] == "dora_factored" else 0)
    params = {(r["rank"], r["arm"]): r["trainable_params"] for r in rows}
    # DoRA adds one magnitude per output feature to LoRA's factors; the dense and factored arms train the same.
    assert params[4, "lora"] < params[4, "dora_dense"] == params[4, "dora_factored"] < params[8, "dora_dense"]
    builds, arenas = spies
    (base,) = builds.results
    assert len(arenas.results) == 1, "the base was packed into a host arena more than once"
    copy = placement.host_copy_of(base)
    assert copy is not None and copy.arena is arenas.results[0] and copy.is_bound()
    # Every arm's adapters were unloaded: the base is as built.
    assert not [name for name, _ in base.named_modules() if "lora" in name]


def test_out_of_memory_is_a_result_and_the_next_arm_runs(
    monkeypatch: pytest.MonkeyPatch, spies: tuple[_Counting, _Counting]
) -> None:
    def out_of_memory(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.26 GiB (fake)")

    # PEFT's dense norm runs out of memory; the factored norm (an instance's forward) does not call it.
    monkeypatch.setattr(DoraLinearLayer, "forward", out_of_memory)
    arms = ["--arms", "dora_dense", "dora_factored", "lora", "--targets", "q_proj", "v_proj", "down_proj"]
    dense, factored, lora = dora.main([*TINY_RUN, "--base", "device", "--ranks", "4", *arms])
    assert factored["factored_modules"] == 2 * 3 and factored["targets"] == ["q_proj", "v_proj", "down_proj"]
    assert dense["status"] == "oom" and "(fake)" in dense["error"]
    assert dense["s_per_step"] is None and dense["tokens_per_s"] is None
    assert dense["peak_scope"] == "until out of memory"
    assert factored["status"] == lora["status"] == "ok" and factored["s_per_step"] > 0 and lora["s_per_step"] > 0
    (base,) = spies[0].results
    assert not [name for name, _ in base.named_modules() if "lora" in name]


def test_arena_base_without_random_blockwise_says_what_is_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning_blockwise.loading.random_base", None)  # import fails
    with pytest.raises(SystemExit, match=r"random_blockwise.*--base device"):
        dora.main([*TINY_RUN, "--base", "arena"])


def test_arena_base_is_built_in_the_host_arena(spies: tuple[_Counting, _Counting]) -> None:
    pytest.importorskip("lightning_blockwise.loading.random_base", reason="random_blockwise is not in this tree yet")
    rows = dora.main([*TINY_RUN, "--base", "arena", "--ranks", "4", "--arms", "dora_factored"])
    assert rows[0]["status"] == "ok"
    builds, arenas = spies
    assert placement.host_copy_of(builds.results[0]) is not None
    assert not arenas.results, "the strategy repacked a base that random_blockwise had already packed"


def test_a_cap_on_a_machine_without_cuda_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(SystemExit):
        dora.main(["--shape", "tiny", "--cap-gib", "22"])
    assert "--cap-gib 0" in capsys.readouterr().err


def _magnitudes(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_magnitude_vector" in n}


def test_magnitudes_computed_elsewhere_are_peft_s() -> None:
    config = dora.tiny()

    def dora_model(seed: int, device: torch.device | None) -> nn.Module:
        torch.manual_seed(seed)
        base = random_nf4_model(config, "cpu")
        torch.manual_seed(0)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=dora.TARGETS, use_dora=True)
        if device is None:
            return get_peft_model(base, lora)
        with dora.magnitudes_on(device):
            return get_peft_model(base, lora)

    original = DoraLinearLayer.update_layer
    peft_own = _magnitudes(dora_model(0, None))
    moved = dora_model(0, torch.device("cpu"))
    assert DoraLinearLayer.update_layer is original, "the patch outlived its context"
    ours = _magnitudes(moved)
    assert ours.keys() == peft_own.keys() and len(ours) == LINEARS
    assert all(torch.equal(ours[n], peft_own[n]) for n in ours)
    assert all(p.requires_grad for n, p in moved.named_parameters() if "lora_magnitude_vector" in n)
    # Control: another base gives other magnitudes.
    other = _magnitudes(dora_model(1, torch.device("cpu")))
    assert not any(torch.equal(other[n], peft_own[n]) for n in ours)


def test_estimate_flags_points_over_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(ranks=[4, 8], arms=list(dora.ARMS), targets=dora.TARGETS, seq=16, steps=2, warmup=1)
    assert dora.estimate(dora.tiny(), args, cap=None) > 0
    assert "expect OOM" not in capsys.readouterr().out
    dora.estimate(dora.tiny(), args, cap=1)
    assert capsys.readouterr().out.count("expect OOM") == 2 * len(dora.ARMS)
