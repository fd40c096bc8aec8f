"""A run's adapter is written once, on rank 0, with every rank in step (NOTE [ One export, every rank in step ]).

The 2-rank runs are separate processes (`tests/helpers/finetune_worker.py`), each with one thread, over gloo.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.recipes.rank_zero_export import export_on_rank_zero
from tests.helpers.finetune_worker import fit_finetune, written_adapter
from tests.helpers.ranks import assert_succeeded, run_ranks


class _Rank:
    """A strategy as one rank sees it: whether it is rank 0, and what rank 0 broadcasts."""

    def __init__(self, zero: bool, from_rank_zero: Any = None) -> None:
        self.is_global_zero = zero
        self.from_rank_zero = from_rank_zero
        self.calls: list[str] = []

    def barrier(self, name: str | None = None) -> None:
        self.calls.append("barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.calls.append("broadcast")
        return obj if self.is_global_zero else self.from_rank_zero


def test_rank_zero_writes_and_every_rank_learns_where(tmp_path: Path) -> None:
    """Rank 0 writes between the barrier and the broadcast; another rank never writes and returns rank 0's path."""
    written: list[Path] = []
    zero = _Rank(zero=True)
    assert export_on_rank_zero(zero, lambda: written.append(tmp_path) or tmp_path, "Test") == tmp_path
    assert written == [tmp_path] and zero.calls == ["barrier", "broadcast"]
    other = _Rank(zero=False, from_rank_zero=(str(tmp_path / "fallback"), None))
    assert export_on_rank_zero(other, lambda: written.append(tmp_path) or tmp_path, "Test") == tmp_path / "fallback"
    assert written == [tmp_path] and other.calls == ["barrier", "broadcast"]


def test_a_failed_export_fails_every_rank() -> None:
    """Rank 0 tells the others its error before raising it, so that none waits for an adapter that never comes."""

    def refuse() -> Path:
        raise MisconfigurationException("the target holds files that are not a previous export")

    zero = _Rank(zero=True)
    with pytest.raises(MisconfigurationException, match="not a previous export"):
        export_on_rank_zero(zero, refuse, "Test")
    assert zero.calls == ["barrier", "broadcast"]
    told = _Rank(zero=False, from_rank_zero=(None, ("the target holds files", True)))
    with pytest.raises(MisconfigurationException, match="Test: global rank 0 could not write the export: the target"):
        export_on_rank_zero(told, refuse, "Test")
    crashed = _Rank(zero=False, from_rank_zero=(None, ("disk full", False)))
    with pytest.raises(RuntimeError, match="disk full"):
        export_on_rank_zero(crashed, refuse, "Test")


def _worker(out: Path, checkpoint: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.finetune_worker", str(out), "--checkpoint", str(checkpoint), *extra]


def fit_on_two_ranks(out: Path, checkpoint: Path, *extra: str) -> list[tuple[int, str]]:
    """Fit (or resume, with ``--resume``) `CausalLMFineTune` on 2 gloo ranks; each rank's return code and output."""
    return run_ranks(_worker(out, checkpoint, "--devices", "2", *extra), world=2)


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, llama_no_attention_dropout: Path) -> Path:
    """A 2-rank fit with no `adapter_dir` (every shipped config): its output directory. The same two processes then
    resume its last checkpoint into ``<it>_resumed`` (one launch: CI has two cores, each process ~10 s of imports)."""
    out = tmp_path_factory.mktemp("two_ranks")
    resumed = out.parent / f"{out.name}_resumed"
    assert_succeeded(fit_on_two_ranks(out, llama_no_attention_dropout, "--then-resume", str(resumed)))
    return out


def test_two_ranks_write_the_adapter_one_process_trains_on_their_batches(
    two_ranks: Path, llama_no_attention_dropout: Path, tmp_path: Path
) -> None:
    """The 2-rank run's `<log_dir>/adapter` is `torch.equal` to one process's on the same global batches.

    Control: one process on rank 0's batches alone (what each rank would train without the other's gradients)
    exports another adapter.
    """
    adapter = written_adapter(two_ranks)
    fit_finetune(tmp_path / "one", llama_no_attention_dropout, devices=1)
    _assert_equal(adapter, written_adapter(tmp_path / "one"))
    fit_finetune(tmp_path / "rank_zero_data", llama_no_attention_dropout, devices=1, rank_zero_data=True)
    alone = written_adapter(tmp_path / "rank_zero_data")
    assert all(not torch.equal(tensor, alone[name]) for name, tensor in adapter.items() if "lora_B" in name)
    # Rank 0 wrote it atomically: nothing staged is left beside it.
    assert not list(two_ranks.glob("logs/version_0/.adapter*"))


def test_a_resume_on_two_ranks_writes_the_adapter(two_ranks: Path) -> None:
    """Resumed from its last checkpoint (nothing left to train), the 2-rank run exports the adapter it restored.

    NOTE [ A resume with nothing to train ] in recipes/finetune.py: the export comes from `on_fit_end` then, on every
    rank. The comparison's control is the test above's.
    """
    _assert_equal(written_adapter(two_ranks), written_adapter(two_ranks.parent / f"{two_ranks.name}_resumed"))
