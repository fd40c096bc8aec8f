"""The ``lightning-blockwise`` command: Lightning's CLI with the ``"blockwise"`` strategy, ``plan`` and ``export``.

Any LightningModule and LightningDataModule can be named in the config by ``class_path``;
``trainer.strategy`` takes ``blockwise`` or ``class_path: lightning_blockwise.BlockwiseStrategy``.
``plan`` predicts a run's host RAM and VRAM from a checkpoint's ``config.json`` alone; ``export``
writes a trained adapter, or merges it into its base.

Example::

    lightning-blockwise fit --config configs/demo.yaml
    lightning-blockwise fit --config configs/demo.yaml --trainer.max_steps=20 --print_config
    python -m lightning_blockwise validate --config configs/demo.yaml
    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 2048 --gpu-memory 24GiB
    lightning-blockwise export runs/adapter /models/Qwen2.5-7B out/merged --merge bf16
    lightning-blockwise generate /models/Qwen2.5-7B --adapter runs/adapter --prompt "Name a primary color."
    lightning-blockwise versions --check
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from lightning_blockwise.cli.commands import (
    DESCRIPTION,
    EXPORT_COMMAND,
    GENERATE_COMMAND,
    PLAN_COMMAND,
    VERBOSE_COMMANDS,
    VERBOSE_FLAG,
    VERSIONS_COMMAND,
    overview,
)
from lightning_blockwise.cli.export_command import export_command
from lightning_blockwise.compat.quiet_logs import be_verbose
from lightning_blockwise.compat.versions import versions_command

if TYPE_CHECKING:
    from lightning_blockwise.cli.plan_command import plan, plan_report
    from lightning_blockwise.cli.trainer_cli import build_cli

# NOTE [ The command starts without Lightning ]
# Lightning, torch and transformers take seconds to import (tens on a loaded machine), and `--help`, `versions` or
# `plan --help` need none of them: each command imports what it needs once it is chosen, the Trainer's commands
# Lightning through `cli/trainer_cli.py`. tests/cli/test_startup.py runs each in a fresh process and reads
# `sys.modules`.
#: The names this package gives, and the module each is imported from at first use (PEP 562 ``__getattr__``).
_LAZY = {
    "build_cli": "lightning_blockwise.cli.trainer_cli",
    "explain_parse_error": "lightning_blockwise.cli.trainer_cli",
    "_BlockwiseCLI": "lightning_blockwise.cli.trainer_cli",
    "_BlockwiseParser": "lightning_blockwise.cli.trainer_cli",
    "plan": "lightning_blockwise.cli.plan_command",
    "plan_report": "lightning_blockwise.cli.plan_command",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def main(args: Any = None) -> None:
    """Entry point of the ``lightning-blockwise`` console script and of ``python -m lightning_blockwise``.

    Args:
        args: Command-line arguments; ``None`` reads ``sys.argv[1:]``.
    """
    argv = sys.argv[1:] if args is None else args
    command = argv[0] if isinstance(argv, list) and argv else None
    if command in VERBOSE_COMMANDS and VERBOSE_FLAG in argv:
        # NOTE [ --verbose on the Trainer's commands ]: ours on `fit` and `predict`, whose Lightning methods take no
        # `verbose`; `validate` and `test` keep Lightning's own `--verbose` (print the metrics), and
        # LIGHTNING_BLOCKWISE_VERBOSE=1 serves every command. The variable reaches the ranks a launcher starts.
        argv = args = [arg for arg in argv if arg != VERBOSE_FLAG]
        be_verbose()
    # Return nothing: a console script's return value becomes the process's exit status.
    if command == PLAN_COMMAND:
        from lightning_blockwise.cli.plan_command import plan

        plan(argv[1:])
    elif command == EXPORT_COMMAND:
        export_command(argv[1:])
    elif command == GENERATE_COMMAND:
        from lightning_blockwise.cli.generate_command import generate_command

        generate_command(argv[1:])
    elif command == VERSIONS_COMMAND:
        versions_command(argv[1:])
    elif argv in (["-h"], ["--help"]):
        overview().parse_args(argv)  # prints the overview and exits 0, as LightningCLI's `--help` did
    else:
        from lightning_blockwise.cli.trainer_cli import run_trainer_cli

        run_trainer_cli(args)


__all__ = ["DESCRIPTION", "build_cli", "export_command", "main", "plan", "plan_report"]
