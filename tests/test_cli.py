"""The ``lightning-blockwise`` command: config parsing, the strategy by class path and by name, entry points."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import build_cli, main

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


def _into(tmp_path: Path) -> list[str]:
    """Overrides that keep a run's files under ``tmp_path``."""
    return [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]


def test_print_config_keeps_the_strategy_class_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO_CONFIG), "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_blockwise.BlockwiseStrategy"
    assert strategy["init_args"]["block_size"] == 1
    assert config["model"]["class_path"] == "lightning_blockwise.demo.DemoCausalLM"
    assert config["trainer"]["max_steps"] == 72
    assert config["data"]["class_path"] == "lightning_blockwise.data.InstructionDataModule"


def test_demo_config_instantiates_a_blockwise_strategy(tmp_path: Path) -> None:
    cli = build_cli(["--config", str(DEMO_CONFIG), *_into(tmp_path), "--trainer.strategy.block_size=2"], run=False)
    assert isinstance(cli.trainer.strategy, BlockwiseStrategy)
    assert cli.trainer.strategy.block_size == 2


@pytest.mark.parametrize(("name", "expected"), [("blockwise", BlockwiseStrategy), ("auto", SingleDeviceStrategy)])
def test_strategy_by_name(tmp_path: Path, name: str, expected: type) -> None:
    cli = build_cli(["--config", str(DEMO_CONFIG), *_into(tmp_path), f"--trainer.strategy={name}"], run=False)
    # The control arm ("auto") must not come out blockwise, or the check proves nothing.
    assert type(cli.trainer.strategy) is expected


def test_unknown_strategy_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid strategy name"):
        build_cli(["--config", str(DEMO_CONFIG), *_into(tmp_path), "--trainer.strategy=blockwize"], run=False)


def test_console_script_points_at_main() -> None:
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "lightning-blockwise"]
    assert script.value == "lightning_blockwise.cli:main"
    assert script.load() is main


def test_python_dash_m_runs_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_blockwise", "fit", "--config", str(DEMO_CONFIG), "--print_config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["trainer"]["strategy"]["class_path"] == "lightning_blockwise.BlockwiseStrategy"
