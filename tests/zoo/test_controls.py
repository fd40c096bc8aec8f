"""Control arms of the zoo: runs that must differ from the zoo's reference run, so that its equalities mean something.

The clients' own tests compare ``strategy="auto"`` against ``strategy="blockwise"``; here the same harness sees a
blockwise run without RNG replay (dropout on) and a run from another seed as different.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise.replay.rng import RngSnapshot
from tests.zoo.harness import assert_same, differences, zoo_fit
from tests.zoo.test_training_loops import PlainLoRA


def test_blockwise_without_rng_replay_differs(zoo_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    auto = zoo_fit(lambda: PlainLoRA(str(zoo_base)), "auto", tmp_path / "auto")
    blockwise = zoo_fit(lambda: PlainLoRA(str(zoo_base)), "blockwise", tmp_path / "blockwise")
    assert_same(auto, blockwise)
    # The recompute then draws other dropout masks than the forward did: gradients, and all after them, differ.
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    unreplayed = zoo_fit(lambda: PlainLoRA(str(zoo_base)), "blockwise", tmp_path / "unreplayed")
    assert {"grads", "weights", "optimizers"} <= set(differences(auto, unreplayed))


def test_another_seed_differs(zoo_base: Path, tmp_path: Path) -> None:
    auto = zoo_fit(lambda: PlainLoRA(str(zoo_base)), "auto", tmp_path / "auto")
    reseeded = zoo_fit(lambda: PlainLoRA(str(zoo_base)), "auto", tmp_path / "reseeded", seed=1)
    assert {"losses", "grads", "weights", "optimizers", "logged"} <= set(differences(auto, reseeded))
    assert "files" not in differences(auto, reseeded)  # the same names: the seed changes values, not the files
