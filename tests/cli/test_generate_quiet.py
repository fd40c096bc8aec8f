"""`lightning-blockwise generate --ckpt` is quiet about the run's callbacks by default, complete with `--verbose`.

Issue 43 item 12: Lightning's "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint need to
be provided ..." came on every call with a training run's `.ckpt`; generation restores its adapters only.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli.generate_command import generate_command
from lightning_blockwise.compat.quiet_logs import VERBOSE_ENV
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from tests.helpers.chat import save_chat_checkpoint

#: Lightning's warning (lightning/pytorch/trainer/call.py, `_call_callbacks_on_load_checkpoint`).
_CALLBACKS_WARNING = "Be aware that when using `ckpt_path`, callbacks used to create the checkpoint"
_CPU = ["--device", "cpu", "--compute-dtype", "float32", "--max-new-tokens", "2", "--prompt", "hi"]


@pytest.fixture(scope="module")
def run_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `.ckpt` of a CausalLMFineTune run with a checkpoint callback (whose state the file records)."""
    root = tmp_path_factory.mktemp("quiet")
    module = CausalLMFineTune(str(save_chat_checkpoint(root / "base")), lora_r=4, compute_dtype="float32",
                              warmup_steps=1)  # fmt: skip
    pl.seed_everything(0, verbose=False)
    fitter = pl.Trainer(
        strategy=BlockwiseStrategy(), accelerator="cpu", max_steps=1, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
    )  # fmt: skip
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=259, num_samples=2, batch_size=2))
    ckpt = root / "run.ckpt"
    fitter.save_checkpoint(ckpt)
    return ckpt


def _callback_warnings(recwarn: pytest.WarningsRecorder) -> int:
    return sum(_CALLBACKS_WARNING in str(w.message) for w in recwarn)


def test_generate_from_a_ckpt_is_quiet_about_its_callbacks(
    run_ckpt: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    generate_command(["--ckpt", str(run_ckpt), *_CPU])
    generate_command(["--ckpt", str(run_ckpt), *_CPU])
    assert _callback_warnings(recwarn) == 0


@pytest.mark.parametrize("how", ["--verbose", VERBOSE_ENV])
def test_control_verbose_shows_it(
    run_ckpt: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder, how: str
) -> None:
    """Control: the flag, or the environment switch every command reads, brings the warning back, once a call."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    if how == VERBOSE_ENV:
        monkeypatch.setenv(VERBOSE_ENV, "1")
    flag = ["--verbose"] if how == "--verbose" else []
    generate_command(["--ckpt", str(run_ckpt), *_CPU, *flag])
    assert _callback_warnings(recwarn) == 1
