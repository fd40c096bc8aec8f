"""`EpochProgressBar`: the bar a user reads says `Epoch N/M` with the run's real M, and no `v_num`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.callbacks import EpochProgressBar
from tests.helpers.models import LoggingModule, build_model, loader, padded_batches, trainer


def _bar_text(bar: TQDMProgressBar, tmp_path: Path, capsys: pytest.CaptureFixture[str], **limits: Any) -> str:
    """What the bar printed over a fit of 8 batches an epoch, 2 micro-batches a step, with a logger (so a `v_num`)."""
    fitter = trainer(
        BlockwiseStrategy(), accumulate_grad_batches=2, logger=CSVLogger(tmp_path), enable_progress_bar=True,
        callbacks=[bar], **limits,
    )  # fmt: skip
    capsys.readouterr()
    fitter.fit(LoggingModule(lambda: build_model("llama")), loader(padded_batches(8)))
    return capsys.readouterr().out


def test_the_bar_shows_epochs_from_max_steps_and_no_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # max_steps=10 bounds the run (max_epochs -1): 4 optimizer steps an epoch, so 3 epochs, the last one short.
    text = _bar_text(EpochProgressBar(), tmp_path / "ours", capsys, max_steps=10, max_epochs=-1)
    assert "Epoch 1/3" in text and "Epoch 3/3" in text and "Epoch 4" not in text
    assert "train_loss=" in text and "v_num" not in text and "/-" not in text
    # Control: Lightning's own bar in the same run shows what this one hides (the capture sees it).
    plain = _bar_text(TQDMProgressBar(), tmp_path / "plain", capsys, max_steps=10, max_epochs=-1)
    assert "v_num=" in plain and "Epoch 2" in plain and "Epoch 3/3" not in plain


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"max_steps": 10, "max_epochs": -1}, "Epoch 1/3"),  # 4 steps an epoch: 2.5 epochs, the third one short
        ({"max_steps": 8, "max_epochs": -1}, "Epoch 1/2"),
        ({"max_steps": 100, "max_epochs": 2}, "Epoch 1/2"),  # max_epochs ends the run first
        ({"max_steps": 4, "max_epochs": 5}, "Epoch 1/1"),  # max_steps ends it first
        ({"max_steps": -1, "max_epochs": 2}, "Epoch 1/2"),
        ({"max_steps": 10, "max_epochs": -1, "limit_train_batches": 4}, "Epoch 1/5"),  # 2 steps an epoch
    ],
)
def test_the_planned_epochs(limits: dict[str, int], expected: str, tmp_path: Path) -> None:
    seen: list[str] = []

    class _Spy(EpochProgressBar):
        def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
            super().on_train_epoch_start(trainer, *args)
            seen.append(self.train_progress_bar.desc)

    limits = {"limit_train_batches": 8, **limits}
    trainer(BlockwiseStrategy(), accumulate_grad_batches=2, enable_progress_bar=True, callbacks=[_Spy()], **limits).fit(
        LoggingModule(lambda: build_model("llama")), loader(padded_batches(8))
    )
    assert seen[0].startswith(expected)
