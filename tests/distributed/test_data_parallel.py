"""Data-parallel blockwise training on CPUs (gloo): exact against `strategy="ddp"`, launched like Lightning or torchrun.

Every arm runs its ranks as separate processes (`tests/helpers/ddp_worker.py`), each with one thread. CI has two
cores and each process pays ~10 s of imports, so the arms of a world size share one launch (module fixtures): its
ranks run every arm in turn, each a fresh module and Trainer over the one process group, and save each arm's run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_blockwise.planning import step_budget
from tests.helpers.budgets import budget_where, keeps_every_attention, probed_budget
from tests.helpers.models import (
    NUM_LAYERS,
    SEQ,
    RunResult,
    assert_equal_runs,
    build_model,
    runs_differ,
)
from tests.helpers.ranks import ROOT, assert_succeeded, clean_env, free_port, run_ranks

# The names tests/distributed/test_nodes.py and tests/distributed/test_gpu_data_parallel.py import from here.
_env, _free_port = clean_env, free_port
__all__ = ["ROOT", "_env", "_free_port", "_worker", "run_external"]


@pytest.fixture(scope="module")
def checkpoint(checkpoints: dict[str, Path]) -> Path:
    """The tests' tiny Llama, saved (the session's copy)."""
    return checkpoints["llama"]


def _worker(out: Path, checkpoint: Path, strategy: str, devices: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.ddp_worker", *_arm(out, checkpoint, strategy, devices, *extra)]


def _arm(out: Path, checkpoint: Path, strategy: str, devices: int, *extra: str) -> list[str]:
    """One arm's arguments of `tests/helpers/ddp_worker.py`."""
    return [str(out), "--checkpoint", str(checkpoint), "--strategy", strategy, "--devices", str(devices), *extra]


def run_external(out: Path, checkpoint: Path, strategy: str, world: int, *extra: str) -> list[RunResult]:
    """Start one process per rank with the variables torchrun sets; each rank's results."""
    assert_succeeded(run_ranks(_worker(out, checkpoint, strategy, world, *extra), world))
    return _results(out, world)


def _results(out: Path, world: int) -> list[RunResult]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _roles(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def run_arms(out: Path, world: int, arms: dict[str, list[str]]) -> Path:
    """One launch of ``world`` ranks that runs ``arms`` (name: `_arm`'s arguments) in order; arm X saved in out/X."""
    out.mkdir(parents=True)
    (out / "arms.json").write_text(json.dumps(arms))
    command = [sys.executable, "-m", "tests.helpers.ddp_worker", "--arms", str(out / "arms.json")]
    assert_succeeded(run_ranks(command, world, timeout=300 * len(arms)))
    return out


@pytest.fixture(scope="module")
def three(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 ranks: blockwise, `ddp`, blockwise unreduced (control), `ddp` with other buckets (control)."""
    out = tmp_path_factory.mktemp("three")
    arms = {
        "blockwise": _arm(out / "blockwise", checkpoint, "blockwise", 3),
        "ddp": _arm(out / "ddp", checkpoint, "ddp", 3),
        "local": _arm(out / "local", checkpoint, "blockwise", 3, "--no-reduce"),
        "other": _arm(out / "other", checkpoint, "ddp", 3, "--ddp-kwargs", '{"bucket_cap_mb": 0.0005}'),
    }
    return run_arms(out / "launch", 3, arms).parent


def _attention_budget(checkpoint: Path) -> int:
    """A budget under which a rank of a 2-rank run streams every block, each layer keeping its attention outputs.

    Planned in this process as a rank plans it: DDP's gradient buckets count as fixed bytes
    (`strategy/module_budget.py`).
    """
    budget = probed_budget(lambda: build_model("llama", checkpoint, quantized=True, lora_dropout=0.0), 2 * SEQ)
    ranks = dataclasses.replace(budget, fixed_bytes=budget.fixed_bytes + budget.trainable_bytes)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_budget, "KEPT_ATTENTION_MIN_FLOPS", 0)
        return budget_where(ranks, 2 * SEQ, keeps_every_attention(NUM_LAYERS))[0]


@pytest.fixture(scope="module")
def two(checkpoint: Path, llama_no_attention_dropout: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every 2-rank arm of this file in one launch; arm X's ranks saved in two/X."""
    out = tmp_path_factory.mktemp("two")
    epochs = ("--epochs", "2")
    # A directory for --resume: its one first-epoch checkpoint, which the arm "whole" wrote before.
    resume = ("--resume", str(out / "whole" / "checkpoints"))
    windows = ("--accumulate", "3", "--lora-dropout", "0")
    bare = llama_no_attention_dropout  # block-major accumulation refuses dropout in the decoder
    arms = {
        "blockwise": (checkpoint, "blockwise"),
        "ddp": (checkpoint, "ddp"),
        "shared": (checkpoint, "blockwise", "--load-blockwise"),
        "checked": (checkpoint, "blockwise", "--callbacks"),
        "whole": (checkpoint, "blockwise", *epochs),
        "resumed": (checkpoint, "blockwise", *epochs, *resume),
        "control": (checkpoint, "blockwise", *epochs, *resume, "--drop-rank-rng"),
        "windowed": (bare, "blockwise", "--block-major", *windows),
        "windowed_ddp": (bare, "ddp", *windows),
        "windowed_local": (bare, "blockwise", "--block-major", "--no-reduce", *windows),
        "kept_attention": (bare, "blockwise", "--kept-attention-budget", str(_attention_budget(bare)), *windows),
    }
    run_arms(
        out / "launch",
        2,
        {name: _arm(out / name, path, strategy, 2, *extra) for name, (path, strategy, *extra) in arms.items()},
    )
    return out


def test_three_ranks_exact_against_ddp(three: Path) -> None:
    """Blockwise on 3 ranks is `torch.equal` to `strategy="ddp"` on 3 ranks: losses, reduced grads, weights, Adam.

    With 3 ranks a sum's order depends on where a gradient sits in DDP's buckets (gloo and NCCL reduce chunk by
    chunk, starting at different ranks); the control shows that: DDP with other buckets computes other numbers.
    """
    blockwise, ddp = _results(three / "blockwise", 3), _results(three / "ddp", 3)
    for rank in range(3):
        assert_equal_runs(ddp[rank], blockwise[rank])
    # The ranks packed one host copy (share_host_copy=None shares among a run's ranks): one serves, two map it.
    roles = _roles(three / "blockwise", 3)
    assert sorted((role["serving"], role["read_only"]) for role in roles) == [(False, True)] * 2 + [(True, False)]
    # Reduced gradients are the same on every rank, and not any one rank's own.
    for name, grad in blockwise[0].grads[0].items():
        assert torch.equal(grad, blockwise[2].grads[0][name])
    # Control: without the reduction each rank steps on its own gradients, which differ (the ranks see other data).
    local = _results(three / "local", 3)
    assert runs_differ(ddp[0], local[0])
    assert any(not torch.equal(grad, local[1].grads[0][name]) for name, grad in local[0].grads[0].items())
    # Control: buckets of another layout sum in another order.
    other = _results(three / "other", 3)
    assert runs_differ(ddp[0], other[0])


def test_resume_on_two_ranks_is_exact(two: Path) -> None:
    """Resumed after its first epoch, a 2-rank run ends as the uninterrupted one: every rank's RNG comes back.

    The ranks draw different dropout masks (`_RankSeed`), so a resume that gave rank 1 rank 0's random numbers
    would differ: the control resumes from the same checkpoint without the per-rank states.
    """
    whole = _results(two / "whole", 2)
    first = sorted((two / "whole" / "checkpoints").glob("epoch=0*.ckpt"))
    assert len(first) == 1, list((two / "whole" / "checkpoints").iterdir())
    resumed = _results(two / "resumed", 2)
    # The resumed run's records start at the second epoch: compare them with the uninterrupted run's.
    tails = [RunResult(run.losses[4:], run.grads[2:], run.weights, run.optimizer) for run in whole]
    for rank in range(2):
        assert_equal_runs(tails[rank], resumed[rank])
    control = _results(two / "control", 2)
    # Rank 1 draws rank 0's masks from the first micro-batch on; after the first reduction both ranks differ.
    assert not torch.equal(whole[1].losses[4], control[1].losses[0])
    assert torch.equal(whole[0].losses[4], control[0].losses[0])
    assert runs_differ(tails[0], control[0]) and runs_differ(tails[1], control[1])


def test_block_major_on_two_ranks_exact_against_ddp(two: Path) -> None:
    """Block-major windows of 3 micro-batches on 2 ranks are `torch.equal` to `strategy="ddp"` with
    `accumulate_grad_batches=3`: losses, reduced grads, weights, Adam, over 3 optimizer steps on both ranks.

    NOTE [ Block-major windows on several ranks ]: DDP's reducer sees each adapter once per window, after the window's
    local sum. Control: the same block-major run without the reduction differs, and its ranks' gradients too.
    """
    windowed, ddp = _results(two / "windowed", 2), _results(two / "windowed_ddp", 2)
    for rank, record in enumerate(_roles(two / "windowed", 2)):
        assert_equal_runs(ddp[rank], windowed[rank])
        # Every optimizer step was one window whose backward fired DDP's hooks once per adapter.
        assert record["windows"] == [True] * 3
    for name, grad in windowed[0].grads[0].items():
        assert torch.equal(grad, windowed[1].grads[0][name])
    local = _results(two / "windowed_local", 2)
    assert runs_differ(ddp[0], local[0]) and runs_differ(ddp[1], local[1])
    assert any(not torch.equal(grad, local[1].grads[0][name]) for name, grad in local[0].grads[0].items())


def test_kept_attention_on_two_ranks_exact_against_ddp(two: Path) -> None:
    """Every layer keeping its attention outputs (NOTE [ Kept attention ]) on 2 ranks is `torch.equal` to
    `strategy="ddp"` (the block-major test's ddp arm: the same data, accumulation and dropout). The control of the
    reduction is that test's; the records are this one's: both ranks planned attention outputs for every layer."""
    kept, ddp = _results(two / "kept_attention", 2), _results(two / "windowed_ddp", 2)
    for rank, record in enumerate(_roles(two / "kept_attention", 2)):
        assert record["attention"] == list(range(NUM_LAYERS))
        assert_equal_runs(ddp[rank], kept[rank])
    assert all(record["attention"] == [] for record in _roles(two / "windowed", 2))  # control: none planned there


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")
def test_two_ranks_share_one_host_copy(two: Path) -> None:
    """Ranks that load with `load_blockwise` keep one host copy: one serves it, the other maps it read-only.

    And training is unchanged: exact against `strategy="ddp"` over `from_pretrained` models (the same bytes).
    """
    shared, ddp = _results(two / "shared", 2), _results(two / "ddp", 2)
    for rank in range(2):
        assert_equal_runs(ddp[rank], shared[rank])
    roles = _roles(two / "shared", 2)
    assert sorted((role["serving"], role["read_only"]) for role in roles) == [(False, True), (True, False)]
    # DDP broadcast nothing into the arena: its bytes are those loaded, in the rank that owns it too.
    assert all(role["unchanged"] for role in roles)


def test_callbacks_on_two_ranks(two: Path) -> None:
    """`ParityCheck` passes on every rank (each checks its own first micro-batch, before DDP's reduction) and leaves
    no trace; `BlockwiseProfiler` profiles every rank's own steps."""
    checked, plain = _results(two / "checked", 2), _results(two / "blockwise", 2)
    for rank in range(2):
        assert_equal_runs(plain[rank], checked[rank])
        record = json.loads((two / "checked" / f"callbacks{rank}.json").read_text())
        assert record == {"passed": True, "profiled": True}


def test_lightnings_launcher_starts_the_other_rank(checkpoint: Path, two: Path, tmp_path: Path) -> None:
    """`python script.py` with `devices=2` (no launcher variables): Lightning starts rank 1 itself, as for `ddp`.

    The run is the one torchrun-style processes give (that the comparison can fail, the controls above show).
    """
    launched = subprocess.run(
        _worker(tmp_path / "lightning", checkpoint, "blockwise", 2),
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stdout.decode()[-4000:] + launched.stderr.decode()[-4000:]
    external = _results(two / "blockwise", 2)
    for rank in range(2):
        assert_equal_runs(external[rank], torch.load(tmp_path / "lightning" / f"rank{rank}.pt", weights_only=False))
