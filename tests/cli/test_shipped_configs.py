"""Every shipped config as ``lightning-blockwise fit`` builds it, up to the moment fit would load the base.

The model configs name checkpoints nobody has here (``/models/Qwen2.5-7B``): each runs with a made-up model
(a two-layer ``config.json``, ``random_init``) and the byte-level tokenizer over the shipped data, and
``Trainer.fit`` is replaced by a recorder, so no weight is read. What is checked is what a newcomer met: the
progress bar (``cli/progress_bar_flag.py``) and ``val_check_interval`` against the data (``cli/data_check.py``).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.callbacks import EpochProgressBar
from lightning_blockwise.callbacks.progress_bar import epoch_description
from lightning_blockwise.cli import _BlockwiseCLI, build_cli
from lightning_blockwise.cli.data_check import DataCheck, check_val_check_interval, training_batches
from lightning_blockwise.demos.tiny import DemoCausalLM

ROOT = Path(__file__).resolve().parents[2]
#: The six model configs, each 1000 optimizer steps of 16 micro-batches of one row.
MODEL_CONFIGS = ["gemma-3-27b", "llama-3.1-8b", "qwen2.5-32b", "qwen2.5-72b", "qwen2.5-7b", "qwen3-32b"]
#: The shipped data's training rows (data/instructions.jsonl less its 10% held out), one batch each at batch_size 1.
SHIPPED_TRAIN_ROWS = 378


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


@pytest.fixture(scope="module")
def made_up_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint directory with a two-layer ``config.json`` and no weights: ``random_init`` builds it."""
    path = tmp_path_factory.mktemp("made-up")
    config = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    config.save_pretrained(path)
    return path


@pytest.fixture
def fit_not_run(monkeypatch: pytest.MonkeyPatch) -> list[Trainer]:
    """``Trainer.fit`` replaced by a recorder: the CLI builds everything and runs ``before_fit``, nothing more."""
    calls: list[Trainer] = []
    monkeypatch.setattr(Trainer, "fit", lambda self, *args, **kwargs: calls.append(self))
    return calls


def _fit(config: str, made_up: Path, tmp_path: Path, *overrides: str) -> Any:
    """``lightning-blockwise fit --config configs/<config>.yaml`` on the CPU, a made-up model and the shipped data."""
    args = ["fit", "--config", str(ROOT / "configs" / f"{config}.yaml"), "--trainer.accelerator=cpu"]
    args += [f"--trainer.default_root_dir={tmp_path}", "--data.init_args.tokenizer=null"]
    if config != "demo":
        args += [f"--model.init_args.checkpoint={made_up}", "--model.init_args.random_init=true"]
    return build_cli([*args, *overrides])


@pytest.mark.parametrize(("config", "epochs"), [*((name, 42) for name in MODEL_CONFIGS), ("demo", 3)])
def test_every_config_shows_its_progress_bar_and_fits_its_data(
    config: str, epochs: int, made_up_checkpoint: Path, tmp_path: Path, fit_not_run: list[Trainer]
) -> None:
    cli = _fit(config, made_up_checkpoint, tmp_path)
    assert fit_not_run == [cli.trainer]
    # The config's own bar, not Lightning's default one (which read `Epoch 0/-2 ... v_num`).
    bars = [callback for callback in cli.trainer.callbacks if type(callback).__name__.endswith("ProgressBar")]
    assert [type(bar) for bar in bars] == [EpochProgressBar]
    assert any(isinstance(callback, DataCheck) for callback in cli.trainer.callbacks)
    cli.datamodule.setup("fit")
    batches = training_batches(cli.trainer, cli.datamodule)
    assert batches == -(-SHIPPED_TRAIN_ROWS // cli.datamodule.hparams.batch_size)
    check_val_check_interval(cli.trainer, cli.datamodule)
    # What the bar prints at the first epoch, with the loader's length the fit loop will find.
    cli.trainer.fit_loop.max_batches = batches
    assert epoch_description(cli.trainer) == f"Epoch 1/{epochs}"


def test_the_flag_still_leaves_the_bar_out(
    made_up_checkpoint: Path, tmp_path: Path, fit_not_run: list[Trainer]
) -> None:
    # Control arm of the test above: the same config with the flag given loses the bar, so the test can see it go.
    cli = _fit("qwen2.5-7b", made_up_checkpoint, tmp_path, "--trainer.enable_progress_bar=false")
    assert not any(isinstance(callback, EpochProgressBar) for callback in cli.trainer.callbacks)
    assert not cli.trainer.progress_bar_callback


def test_an_interval_longer_than_the_data_is_refused(
    made_up_checkpoint: Path, tmp_path: Path, fit_not_run: list[Trainer]
) -> None:
    # Control arm: the value the model configs shipped with (800 batches) against the shipped data's 378.
    cli = _fit("qwen2.5-7b", made_up_checkpoint, tmp_path, "--trainer.val_check_interval=800")
    cli.datamodule.setup("fit")
    with pytest.raises(MisconfigurationException, match=r"val_check_interval=800`.* 378 training batches.*=1\.0"):
        check_val_check_interval(cli.trainer, cli.datamodule)


@pytest.mark.parametrize("interval", ["378", "0.5"])
def test_intervals_within_the_data_pass(
    interval: str, made_up_checkpoint: Path, tmp_path: Path, fit_not_run: list[Trainer]
) -> None:
    cli = _fit("qwen2.5-7b", made_up_checkpoint, tmp_path, f"--trainer.val_check_interval={interval}")
    cli.datamodule.setup("fit")
    check_val_check_interval(cli.trainer, cli.datamodule)


@pytest.fixture
def configured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One entry per base the demo model builds (``configure_model``): where the weights would be read."""
    events: list[str] = []
    configure_model = DemoCausalLM.configure_model

    @functools.wraps(configure_model)
    def record(self: DemoCausalLM) -> None:
        events.append("configure_model")
        configure_model(self)

    monkeypatch.setattr(DemoCausalLM, "configure_model", record)
    return events


@pytest.mark.parametrize("checked", [True, False])
def test_the_refusal_comes_before_the_base_loads(
    checked: bool, configured: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not checked:
        # Control arm: without the CLI's check, Lightning refuses the same interval only after the base is built.
        monkeypatch.setattr(_BlockwiseCLI, "before_fit", lambda self: None)
    overrides = ["--trainer.val_check_interval=1000", "--trainer.logger=false", "--trainer.callbacks=[]"]
    with pytest.raises((MisconfigurationException, ValueError), match="1000") as refusal:
        _fit("demo", tmp_path, tmp_path, *overrides)
    assert ("Nothing was loaded" in str(refusal.value)) is checked
    assert configured == ([] if checked else ["configure_model"])


@pytest.mark.parametrize("config", ["qwen2.5-7b", "smollm2-135m"])
def test_a_model_config_that_leaves_quantize_unset_builds_an_nf4_base(
    config: str, made_up_checkpoint: Path, tmp_path: Path, fit_not_run: list[Trainer]
) -> None:
    """The model configs leave `quantize` (and the smollm2 one `adapter_path`) unset: the module resolves it to NF4,
    and its hyperparameters say so, also under LightningCLI, which hands `save_hyperparameters` the config's values."""
    cli = _fit(config, made_up_checkpoint, tmp_path)
    # Control: what the CLI gave the module is None; without the resolution the loader refused it at the first step.
    assert cli.config.fit.model.init_args.quantize is None
    assert cli.model.hparams.quantize is True and cli.model.hparams.compute_dtype in ("bfloat16", "float32")
    cli.model.configure_model()
    assert any(type(module).__name__ == "Linear4bit" for module in cli.model.modules())
