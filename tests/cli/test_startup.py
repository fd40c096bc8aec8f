"""The command starts without Lightning, torch or transformers where it does not need them, and `import
lightning_blockwise` still registers "blockwise" for the Trainer that the user imports, in either order
(NOTE [ The command starts without Lightning ] in cli/__init__.py, NOTE [ Registration waits for Lightning ] in
compat/strategy_registry.py).

Each case runs in a fresh process and reads `sys.modules`: a module's presence holds on a loaded machine, where a time
limit would not. Measured with `python -X importtime -m lightning_blockwise ...` on the 2-core development machine
under the load of six other test runs (import time summed over the top-level imports, before the lazy package ->
after): `--help` 47.2 s -> 0.64 s, `plan --help` 44.9 -> 1.06 s, `versions` 36.2 -> 0.71 s, `versions --help` 36.3 ->
0.64 s, `export --help` 40.3 -> 0.59 s. `generate --help` (43 s) and `plan` itself still import them.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_blockwise.cli.commands import TRAINER_COMMANDS
from lightning_blockwise.cli.export_command import DEFAULT_MAX_SHARD_SIZE, MERGE_CHOICES

#: The modules that take seconds to import.
HEAVY = ("lightning", "pytorch_lightning", "torch", "transformers", "bitsandbytes", "peft")

#: Runs the command line in this process, then prints which of `HEAVY` it imported (`--help` exits: caught).
_RUN_COMMAND = """
import sys
from lightning_blockwise.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    assert exit.code in (None, 0), exit.code
print("HEAVY:", *sorted(name for name in {heavy} if name in sys.modules))
"""

#: The commands that must start light, and (control) one that must import Lightning.
COMMANDS = {
    "--help": ["--help"],
    "plan --help": ["plan", "--help"],
    "versions": ["versions"],
    "versions --help": ["versions", "--help"],
    "export --help": ["export", "--help"],
    "control: fit --help": ["fit", "--help"],
}


def _python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def command_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every command of `COMMANDS` in its own fresh process, two at a time (CI has two cores)."""
    code = _RUN_COMMAND.format(heavy=HEAVY)
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda args: _python(code, *args), COMMANDS.values())
        return dict(zip(COMMANDS, done, strict=True))


def _heavy_imported(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("HEAVY:")]
    return line.split()[1:]


@pytest.mark.parametrize("command", [c for c in COMMANDS if not c.startswith("control")])
def test_the_command_starts_without_lightning_torch_or_transformers(command_runs: dict, command: str) -> None:
    done = command_runs[command]
    assert _heavy_imported(done) == []
    assert "usage: lightning-blockwise" in done.stdout or command == "versions"


def test_control_a_trainer_command_imports_lightning(command_runs: dict) -> None:
    """Control: the harness sees Lightning where a command imports it (`fit --help` builds LightningCLI's parser)."""
    assert {"lightning", "torch"} <= set(_heavy_imported(command_runs["control: fit --help"]))


def test_the_overview_names_every_command_lightning_has() -> None:
    """`--help` lists the Trainer's commands without asking Lightning; they must be Lightning's."""
    assert tuple(TRAINER_COMMANDS) == tuple(LightningCLI.subcommands())


def test_export_help_says_what_the_merge_takes() -> None:
    """`export --help` writes `--merge`'s choices and the shard cap without importing the merge (torch)."""
    from lightning_blockwise.export import merge

    assert (MERGE_CHOICES, DEFAULT_MAX_SHARD_SIZE) == (merge.MERGE_CHOICES, merge.DEFAULT_MAX_SHARD_SIZE)


_IMPORT = "import lightning_blockwise\nimport sys\n"
_TRAINER = """
trainer = L.Trainer(strategy="blockwise", accelerator="cpu", logger=False, enable_progress_bar=False)
print("STRATEGY:", type(trainer.strategy).__module__, type(trainer.strategy).__name__)
"""
#: Each order of `import lightning_blockwise` and Lightning's import, and a control without ours.
REGISTRATION = {
    "ours, then lightning.pytorch": _IMPORT + "import lightning.pytorch as L\n" + _TRAINER,
    "lightning.pytorch, then ours": "import lightning.pytorch as L\n" + _IMPORT + _TRAINER,
    "ours, then lightning": _IMPORT + "import lightning as L\n" + _TRAINER,
    "ours, then pytorch_lightning": _IMPORT + "import pytorch_lightning as L\n" + _TRAINER,
    "pytorch_lightning, then ours": "import pytorch_lightning as L\n" + _IMPORT + _TRAINER,
    # A module of ours imports Lightning halfway through its own import: the registry holds a builder until the
    # strategy's module has loaded.
    "ours halfway": _IMPORT + "import lightning_blockwise.residency.arena\nimport lightning.pytorch as L\n" + _TRAINER,
    "control: no import of ours": "import lightning.pytorch as L\n" + _TRAINER,
}


@pytest.fixture(scope="module")
def registration_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    with ThreadPoolExecutor(2) as pool:
        return dict(zip(REGISTRATION, pool.map(_python, REGISTRATION.values()), strict=True))


@pytest.mark.parametrize("order", [o for o in REGISTRATION if not o.startswith("control")])
def test_a_trainer_finds_blockwise_in_any_import_order(registration_runs: dict, order: str) -> None:
    done = registration_runs[order]
    assert done.returncode == 0, done.stderr[-3000:]
    twin = ".pl" if "pytorch_lightning" in order else ""
    assert f"STRATEGY: lightning_blockwise{twin}.strategy.blockwise BlockwiseStrategy" in done.stdout


def test_control_without_our_import_the_trainer_refuses_the_name(registration_runs: dict) -> None:
    done = registration_runs["control: no import of ours"]
    assert done.returncode != 0
    assert "blockwise" in done.stderr and "STRATEGY:" not in done.stdout


def test_import_lightning_blockwise_imports_no_lightning() -> None:
    """The package's names load at first use; a wrong name says which module lacks it."""
    code = f"""
import sys
import lightning_blockwise
assert not [m for m in {HEAVY} if m in sys.modules], sorted(sys.modules)
assert "BlockwiseStrategy" in dir(lightning_blockwise) and "BlockwiseStrategy" in lightning_blockwise.__all__
try:
    lightning_blockwise.NoSuchName
except AttributeError as error:
    print("ERROR:", error)
from lightning_blockwise import ParityCheck
from lightning.pytorch.callbacks import Callback
print("CALLBACK:", issubclass(ParityCheck, Callback))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ERROR: module 'lightning_blockwise' has no attribute 'NoSuchName'" in done.stdout
    assert "CALLBACK: True" in done.stdout
