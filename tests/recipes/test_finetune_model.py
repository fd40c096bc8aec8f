"""The recipe's base: ``CausalLMFineTune`` loads it shared as ``BlockwiseStrategy(share_host_copy=...)`` says."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.finetune_model import load_base
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.finetune_worker import written_adapter
from tests.recipes.test_rank_zero_export import fit_on_two_ranks

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")


def _serves(checkpoint: Path, share_host_copy: bool | None) -> bool:
    base = load_base(
        str(checkpoint), "auto", "float32", True, False, BlockwiseStrategy(share_host_copy=share_host_copy)
    )
    copy = host_copy_of(base)
    assert copy is not None
    serving = copy.serving is not None
    del base, copy
    gc.collect()  # the copy stops serving with the model
    return serving


def test_the_loader_shares_as_the_strategy_says(checkpoints: dict[str, Path]) -> None:
    """`share_host_copy=False` packs a copy of this process's own, as does the default in a run of one process.

    Control: `share_host_copy=True` loads it shared (it serves other processes of this user that load the base).
    """
    assert not _serves(checkpoints["llama"], False)
    assert not _serves(checkpoints["llama"], None)
    assert _serves(checkpoints["llama"], True)


def test_two_ranks_resume_a_checkpoint_with_the_base_when_they_do_not_share(
    llama_no_attention_dropout: Path, tmp_path: Path
) -> None:
    """`save_frozen_base=True` and `share_host_copy=False` on 2 ranks: each rank has its own copy to write the
    checkpoint's base into, so the run resumes from its own checkpoint and writes its adapter again.

    Control: the same checkpoint resumed with the default (`None`: the ranks share one copy) is refused on both
    with the cause, the sharing of this run's 2 ranks, and the option that changes it.
    """
    full = ("--save-frozen-base", "--share-host-copy")
    fit = fit_on_two_ranks(tmp_path / "fit", llama_no_attention_dropout, *full, "false")
    assert [code for code, _ in fit] == [0, 0], fit[0][1][-3000:] + fit[1][1][-3000:]
    last = str(tmp_path / "fit" / "checkpoints" / "last.ckpt")
    resumed = fit_on_two_ranks(tmp_path / "resumed", llama_no_attention_dropout, *full, "false", "--resume", last)
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    adapter, again = written_adapter(tmp_path / "fit"), written_adapter(tmp_path / "resumed")
    assert adapter.keys() == again.keys() and all(again[name].equal(tensor) for name, tensor in adapter.items())
    shared = fit_on_two_ranks(tmp_path / "shared", llama_no_attention_dropout, *full, "none", "--resume", last)
    # The rank that maps the other's copy refuses at once; the one that serves it refuses while its peer still runs
    # (once the peer has exited it may load the base, and then fails at its next collective).
    assert all(code != 0 for code, _ in shared)
    told = [" ".join(output.split()) for _, output in shared if "carries the frozen base" in output]
    assert told, shared[0][1][-3000:] + shared[1][1][-3000:]
    for text in told:
        assert "this checkpoint carries the frozen base (it was saved with `save_frozen_base=True`)" in text
        assert "`BlockwiseStrategy(share_host_copy=None)` (default) shares one copy among this run's 2 ranks" in text
        assert "Pass `BlockwiseStrategy(share_host_copy=False)`" in text
