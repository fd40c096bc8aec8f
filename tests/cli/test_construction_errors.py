"""A constructor's refusal reaches the user alone and first (cli/construction_errors.py), not under jsonargparse's
report of the ``LightningModule | None`` union that ended in "Expected a <class 'NoneType'>"."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.cli import _BlockwiseCLI, build_cli, main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ["fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--trainer.accelerator=cpu"]
QWEN = ["fit", "--config", str(ROOT / "configs" / "qwen2.5-7b.yaml"), "--trainer.accelerator=cpu"]


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


@pytest.fixture
def no_liger(monkeypatch: pytest.MonkeyPatch) -> None:
    """Liger-Kernel as if not installed: its import fails (``None`` in ``sys.modules`` makes it raise)."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)


def _cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Each mistake's arguments and the start of the line that must come out alone."""
    missing = tmp_path / "no-such-tokenizer"
    liger = [*QWEN, f"--trainer.default_root_dir={tmp_path}", "--data.init_args.tokenizer=null"]
    return {
        "tokenizer": (
            [*DEMO, f"--data.init_args.tokenizer={missing}"],
            f"error: InstructionDataModule(tokenizer='{missing}'): {missing} does not exist.",
        ),
        "liger": (
            [*liger, "--model.init_args.kernels=liger", "--model.init_args.random_init=true"],
            "error: use_liger_kernels needs Liger-Kernel, which is not installed",
        ),
    }


@pytest.mark.parametrize("case", ["tokenizer", "liger"])
def test_the_command_prints_the_refusal_alone(
    case: str, tmp_path: Path, no_liger: None, capsys: pytest.CaptureFixture[str]
) -> None:
    args, first = _cases(tmp_path)[case]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    message = str(exit_info.value.code)
    assert message.startswith(first)
    assert "\n" not in message and "NoneType" not in message and "Union" not in message
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("case", ["tokenizer", "liger"])
def test_build_cli_raises_the_constructors_exception(case: str, tmp_path: Path, no_liger: None) -> None:
    args, first = _cases(tmp_path)[case]
    with pytest.raises(MisconfigurationException) as refusal:
        build_cli(args)
    assert first.removeprefix("error: ") in str(refusal.value)
    # Raised alone: not chained to jsonargparse's report.
    assert refusal.value.__cause__ is None and refusal.value.__suppress_context__


def test_without_the_unwrapping_the_refusal_is_buried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Control arm: LightningCLI's own instantiation answers the same mistake with jsonargparse's union report, whose
    # last line is about NoneType; the tests above would see it.
    monkeypatch.setattr(_BlockwiseCLI, "instantiate_classes", LightningCLI.instantiate_classes)
    args, first = _cases(tmp_path)["tokenizer"]
    with pytest.raises(ValueError, match="Does not validate against any of the Union subtypes") as report:
        build_cli(args)
    assert str(report.value).splitlines()[0] != first.removeprefix("error: ")
    assert "Expected a <class 'NoneType'>" in str(report.value)
