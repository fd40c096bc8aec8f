"""The ``lightning-blockwise`` command: config parsing, the strategy by class path and by name, entry points,
``--ckpt_path`` (checked early, hyperparameters under the command line) and the saved ``config.yaml``."""

from __future__ import annotations

import functools
import importlib
import re
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import build_cli, main
from lightning_blockwise.demos.tiny import DemoCausalLM

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


def _into(tmp_path: Path) -> list[str]:
    """Overrides that keep a run's files under ``tmp_path``."""
    return [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]


def _short(tmp_path: Path) -> list[str]:
    """Overrides for a run of seconds under ``tmp_path``: two steps of two rows, one validation batch, no callbacks."""
    return [
        *_into(tmp_path),
        "--trainer.max_steps=2",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.callbacks=[]",
        "--trainer.enable_progress_bar=false",
        "--data.init_args.batch_size=2",
    ]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a two-step fit of the demo, trained with non-default hyperparameters to tell them apart."""
    root = tmp_path_factory.mktemp("first_run")
    args = ["fit", "--config", str(DEMO_CONFIG), *_short(root), "--trainer.enable_checkpointing=true"]
    # Validating at step 2 is what makes the checkpoint callback save (the demo validates every 24 steps).
    args += ["--trainer.val_check_interval=2", "--model.init_args.learning_rate=0.03"]
    args += ["--model.init_args.weight_decay=0.1", "--model.init_args.lora_dropout=0.1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["lightning-blockwise"])
        build_cli(args)
    (checkpoint,) = root.rglob("*.ckpt")
    return checkpoint


def test_print_config_keeps_the_strategy_class_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO_CONFIG), "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_blockwise.BlockwiseStrategy"
    assert strategy["init_args"]["block_size"] == 1
    assert config["model"]["class_path"] == "lightning_blockwise.demos.tiny.DemoCausalLM"
    assert config["trainer"]["max_steps"] == 72
    assert config["data"]["class_path"] == "lightning_blockwise.recipes.data.InstructionDataModule"


def test_demo_config_instantiates_a_blockwise_strategy(tmp_path: Path) -> None:
    cli = build_cli(["--config", str(DEMO_CONFIG), *_into(tmp_path), "--trainer.strategy.block_size=2"], run=False)
    assert isinstance(cli.trainer.strategy, BlockwiseStrategy)
    assert cli.trainer.strategy.options.block_size == 2


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


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What of the demo model gets made: ``"init"`` per instance, ``"configure_model"`` per base built."""
    events: list[str] = []
    init, configure_model = DemoCausalLM.__init__, DemoCausalLM.configure_model

    # `wraps` keeps `__init__`'s signature visible to the CLI parser, which reads the model's arguments from it.
    @functools.wraps(init)
    def record_init(self: DemoCausalLM, *args: Any, **kwargs: Any) -> None:
        events.append("init")
        init(self, *args, **kwargs)

    @functools.wraps(configure_model)
    def record_configure(self: DemoCausalLM) -> None:
        events.append("configure_model")
        configure_model(self)

    monkeypatch.setattr(DemoCausalLM, "__init__", record_init)
    monkeypatch.setattr(DemoCausalLM, "configure_model", record_configure)
    return events


def test_demo_config_runs_twice_into_one_directory(tmp_path: Path) -> None:
    log_dirs = [Path(build_cli(["fit", "--config", str(DEMO_CONFIG), *_short(tmp_path)]).trainer.log_dir) for _ in "ab"]
    # Each run logs to a version directory of its own (`trainer.log_dir`), and its config goes there.
    assert log_dirs[0] != log_dirs[1]
    assert sorted(tmp_path.rglob("config.yaml")) == sorted(log_dir / "config.yaml" for log_dir in log_dirs)


def test_an_earlier_config_is_not_overwritten(tmp_path: Path, built: list[str]) -> None:
    # The control arm of the test above: a run into a directory that already holds a config fails, so the guard is
    # on, and it fails in the Trainer's setup, before the base is built.
    earlier = tmp_path / "config.yaml"
    earlier.write_text("an earlier run's config\n")
    args = [
        "validate",
        "--config",
        str(DEMO_CONFIG),
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
    ]
    with pytest.raises(RuntimeError, match=r"expected .*config\.yaml to NOT exist"):
        build_cli(args)
    assert earlier.read_text() == "an earlier run's config\n"
    assert built == ["init"]


def test_resume_writes_its_config_into_a_new_version(first_run: Path) -> None:
    root, first_log_dir = first_run.parents[3], first_run.parents[1]
    first_config = (first_log_dir / "config.yaml").read_text()
    args = ["fit", "--config", str(DEMO_CONFIG), *_short(root), f"--ckpt_path={first_run}"]
    cli = build_cli([*args, "--trainer.max_steps=3"])
    assert cli.trainer.ckpt_path == str(first_run) and cli.trainer.global_step == 3
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir.parent == first_log_dir.parent and log_dir != first_log_dir
    assert yaml.safe_load((log_dir / "config.yaml").read_text())["ckpt_path"] == str(first_run)
    assert (first_log_dir / "config.yaml").read_text() == first_config


def test_command_line_wins_over_checkpoint_hyperparameters(first_run: Path, tmp_path: Path) -> None:
    # The checkpoint was trained with learning_rate 0.03, weight_decay 0.1 and lora_dropout 0.1. This config leaves
    # lora_dropout out (the class default is 0.05) and gives weight_decay 0.0; the command line gives learning_rate.
    config = yaml.safe_load(DEMO_CONFIG.read_text())
    del config["model"]["init_args"]["lora_dropout"]
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(config))
    args = ["validate", "--config", str(tmp_path / "demo.yaml"), *_short(tmp_path)]
    args += [f"--ckpt_path={first_run}", "--model.init_args.learning_rate=0.5"]
    # An argument that appends: parsed again over the checkpoint, it must still append once.
    cli = build_cli([*args, "--trainer.callbacks+=lightning.pytorch.callbacks.LearningRateMonitor"])
    hparams = cli.model.hparams
    assert hparams.learning_rate == 0.5  # the command line over the checkpoint
    assert hparams.weight_decay == 0.0  # the config file over the checkpoint
    assert hparams.lora_dropout == 0.1  # the checkpoint over the class default: its hyperparameters are read
    assert sum(isinstance(callback, LearningRateMonitor) for callback in cli.trainer.callbacks) == 1
    saved = yaml.safe_load((Path(cli.trainer.log_dir) / "config.yaml").read_text())["model"]["init_args"]
    assert (saved["learning_rate"], saved["weight_decay"], saved["lora_dropout"]) == (0.5, 0.0, 0.1)


@pytest.mark.parametrize("subcommand", ["fit", "validate", "test", "predict"])
def test_missing_ckpt_path_is_refused_before_the_model_is_built(
    tmp_path: Path, built: list[str], subcommand: str
) -> None:
    missing = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    args = [subcommand, "--config", str(DEMO_CONFIG), *_into(tmp_path), f"--ckpt_path={missing}"]
    with pytest.raises(MisconfigurationException, match=re.escape(f"--ckpt_path={missing}`: the path does not exist")):
        build_cli(args)
    assert built == []
    # Control arm: the recorder sees a model that is made.
    build_cli(["--config", str(DEMO_CONFIG), *_into(tmp_path)], run=False)
    assert built == ["init"]


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_config_comments_name_files_and_classes_that_exist(config: Path) -> None:
    """The configs' comments name today's module paths, and no longer say the strategy trains on one device only."""
    text = config.read_text(encoding="utf-8")
    for path in re.findall(r"\b((?:lightning_blockwise|benchmarks|data)/[\w/]+\.py)\b", text):
        assert (ROOT / path).is_file(), f"{config.name} names {path}, which does not exist"
    for dotted in re.findall(r"\b(lightning_blockwise(?:\.\w+)+)", text):
        module, _, name = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), name), f"{config.name} names {dotted}"
    assert "exactly one" not in text


def test_usage_line_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "usage: lightning-blockwise [-c CONFIG] {fit,validate,test,predict,plan,export,generate,versions} ..." in (
        capsys.readouterr().out
    )
    # Without a command the error names them all too.
    with pytest.raises(SystemExit):
        main([])
    assert "{fit,validate,test,predict,plan,export,generate,versions}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (
            "--model.init_args.lora_rank=8",
            "`--model.init_args.lora_rank`: `DemoCausalLM` takes no argument `lora_rank`. Did you mean `lora_r`?",
        ),
        ("--data.init_args.batchsize=3", "Did you mean `batch_size`?"),
        ("--trainer.strategy.init_args.blok_size=2", "`BlockwiseStrategy` takes no argument `blok_size`. Did you"),
        ("--trainer.max_steps=abc", "`--trainer.max_steps`: Expected a <class 'int'>. Got value: abc"),
        ("--model.init_args.lora_r=abc", "`--model.init_args.lora_r`: Expected a <class 'int'>"),
        ("--trainer.max_stepz=1", "unrecognized arguments: --trainer.max_stepz=1. Did you mean `--trainer.max_steps`?"),
        # Controls: no near name, no suggestion.
        ("--model.init_args.zzzqqq=1", "`DemoCausalLM` takes no argument `zzzqqq`. `--model.help"),
        ("--qqqzzz=1", "unrecognized arguments: --qqqzzz=1\n"),
    ],
)
def test_a_bad_option_is_one_line(option: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The line that says what is wrong, not the usage and the union's every member (~60 lines)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(DEMO_CONFIG), option])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(("error:", "tip:", "usage:", " "))]
    assert lines[0].startswith("error: ") and expected in err
    assert lines[1:] == ["tip: `lightning-blockwise fit --help` lists the options."]
    if "zzz" in option:
        assert "Did you mean" not in err


def test_a_bad_option_keeps_jsonargparse_behaviour_where_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`exit_on_error=False` (or jsonargparse's debug mode) still raises, for callers that catch it."""
    from lightning_blockwise.cli import _BlockwiseParser

    parser = _BlockwiseParser(exit_on_error=False)
    parser.add_argument("--steps", type=int)
    with pytest.raises(Exception, match="steps"):
        parser.parse_args(["--steps=abc"])


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for command in ("fit", "validate", "test", "predict", "plan", "export"):
        assert re.search(rf"\b{command}\b", text), command
    # Each command it lists answers `--help` with its own usage: the list is of commands that exist.
    for command, usage in (("plan", "plan"), ("export", "export"), ("fit", "[options] fit")):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: lightning-blockwise {usage} ")


BAD_FILES = {
    "empty": (lambda path: path.write_bytes(b""), "is empty"),
    "truncated": (lambda path: path.write_bytes(b"PK\x03\x04 cut short"), "is not a complete `torch.save` file"),
    "foreign": (lambda path: torch.save({"weights": torch.zeros(2)}, path), "is not a Lightning checkpoint"),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_bad_ckpt_path_file_is_refused_before_the_model_is_made(
    tmp_path: Path,
    built: list[str],
    kind: str,
) -> None:
    write, problem = BAD_FILES[kind]
    path = tmp_path / "last.ckpt"
    write(path)
    with pytest.raises(MisconfigurationException, match=re.escape(f"`ckpt_path` {str(path)!r}") + ".*" + problem):
        build_cli(["fit", "--config", str(DEMO_CONFIG), *_into(tmp_path), f"--ckpt_path={path}"])
    assert built == [], "refused while parsing, before the model (and its base) is made"


@pytest.fixture(scope="module", autouse=True)
def dash_m() -> Iterator[subprocess.Popen[str]]:
    """`python -m lightning_blockwise fit --print_config`, started with this file's first test and read by its last
    (autouse): its ~10 s of imports run on CI's second core while the file's other tests run in this process."""
    command = [sys.executable, "-m", "lightning_blockwise", "fit", "--config", str(DEMO_CONFIG), "--print_config"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    yield process
    if process.poll() is None:  # the test that reads it was not selected, or failed before
        process.kill()
    process.communicate()


def test_python_dash_m_runs_the_cli(dash_m: subprocess.Popen[str]) -> None:
    stdout, stderr = dash_m.communicate(timeout=300)
    assert dash_m.returncode == 0, stderr
    assert yaml.safe_load(stdout)["trainer"]["strategy"]["class_path"] == "lightning_blockwise.BlockwiseStrategy"
