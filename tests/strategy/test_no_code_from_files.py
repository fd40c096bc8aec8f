"""A crafted checkpoint never runs code: every read of a user-given file is weights-only.

NOTE [ No code from checkpoint files ] in strategy/checkpoint_files.py. Each path a user hands a file to (the CLI's
``--ckpt_path``, ``Trainer.validate(ckpt_path=..., weights_only=True)`` under the strategy, ``generate --ckpt``)
gets a file whose pickle calls ``os.system``; the marker that call would write must never appear. The control
loads the same file with ``weights_only=False`` and the marker does appear, so the file is a working exploit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import build_cli
from lightning_blockwise.cli.generate_command import generate_command
from lightning_blockwise.strategy.checkpoint_files import check_checkpoint_file
from tests.helpers.models import CausalLMModule, build_model, loader, padded_batches, trainer

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


class _Exploit:
    """Unpickles as a call of ``os.system`` that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _crafted(tmp_path: Path) -> tuple[Path, Path]:
    """A ``.ckpt`` with every key Lightning and the recipe look for, and an exploit among its hyperparameters."""
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.ckpt"
    checkpoint = {
        "state_dict": {},
        "global_step": 0,
        "epoch": 0,
        "pytorch-lightning_version": "2.6.6",
        "hyper_parameters": {"checkpoint": str(tmp_path), "payload": _Exploit(marker)},
    }
    torch.save(checkpoint, path)
    assert not marker.exists()
    return path, marker


def test_control_the_crafted_file_runs_code_when_unpickled(tmp_path: Path) -> None:
    path, marker = _crafted(tmp_path)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_the_cli_refuses_it_before_reading_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, marker = _crafted(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])
    args = ["fit", "--config", str(DEMO_CONFIG), f"--trainer.default_root_dir={tmp_path}", f"--ckpt_path={path}"]
    with pytest.raises(MisconfigurationException, match=r"evil\.ckpt.*weights-only load refuses.*weights_only=False"):
        build_cli(args)
    assert not marker.exists()


@pytest.mark.parametrize("weights_only", [None, True])
def test_the_strategy_refuses_it_before_reading_it(tmp_path: Path, weights_only: bool | None) -> None:
    path, marker = _crafted(tmp_path)
    module = CausalLMModule(lambda: build_model("llama"), in_configure_model=True)
    with pytest.raises(MisconfigurationException, match=r"evil\.ckpt.*weights-only load refuses"):
        trainer(BlockwiseStrategy()).validate(
            module, loader(padded_batches(1)), ckpt_path=path, weights_only=weights_only
        )
    assert not marker.exists()


def test_the_users_explicit_trust_is_left_to_lightning(tmp_path: Path) -> None:
    """``weights_only=False`` is the user vouching for the file: the check does not refuse it, nor read it."""
    path, marker = _crafted(tmp_path)
    check_checkpoint_file(path, weights_only=False)
    assert not marker.exists()


def test_generate_refuses_it_before_reading_it(tmp_path: Path) -> None:
    path, marker = _crafted(tmp_path)
    with pytest.raises(SystemExit, match=r"--ckpt .*evil\.ckpt holds objects that a weights-only load refuses"):
        generate_command(["--ckpt", str(path), "--device", "cpu", "--prompt", "hi"])
    assert not marker.exists()
