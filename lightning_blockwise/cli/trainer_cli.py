"""The Trainer's commands (``fit``, ``validate``, ``test``, ``predict``): LightningCLI, ``"blockwise"`` registered.

:func:`~lightning_blockwise.cli.main` comes here for every command but its own, and for those only: this module
imports Lightning (NOTE [ Registration waits for Lightning ] in compat/strategy_registry.py).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from fsspec.utils import get_protocol
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

# Imported for its side effect: with Lightning imported above, registering "blockwise" in Lightning's strategy
# registry before the parser resolves `trainer.strategy`.
import lightning_blockwise  # noqa: F401
from lightning_blockwise.cli.commands import DESCRIPTION, OWN_COMMANDS
from lightning_blockwise.cli.construction_errors import constructor_error, one_line
from lightning_blockwise.cli.data_check import DataCheck
from lightning_blockwise.cli.old_class_paths import refuse_removed_class_path
from lightning_blockwise.cli.progress_bar_flag import drop_progress_bars
from lightning_blockwise.strategy.checkpoint_files import check_checkpoint_file


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (default: ``sys.argv``), instantiate the Trainer, model and data, and run the subcommand.

    A ``--ckpt_path`` that does not exist is refused before anything is built. The hyperparameters
    saved in a checkpoint fill in the model arguments that neither a config file nor the command
    line gives (NOTE [ Checkpoint hyperparameters under the command line ]).

    Args:
        args: Command-line arguments, a dict or a namespace; ``None`` reads ``sys.argv[1:]``.
        run: Expect a subcommand (``fit``, ``validate``, ``test``, ``predict``) and run it. A mistyped option
            exits with one line that names it (:func:`explain_parse_error`), not the usage.
            With ``False`` the config is given without one and only instantiated, e.g. to
            inspect ``cli.trainer.strategy``.

    Returns:
        The :class:`~lightning.pytorch.cli.LightningCLI`, with ``trainer``, ``model`` and
        ``datamodule`` attributes.

    Raises:
        MisconfigurationException: If ``--ckpt_path`` names a local path that does not exist.
    """
    # No `save_config_kwargs={"overwrite": True}`: Lightning then refuses to replace the `config.yaml` of an earlier
    # run. The CSV and TensorBoard loggers give every run a new `version_<n>` directory (`trainer.log_dir`, where the
    # config goes), resumed runs included, so only a run into a fixed directory (no logger, or a fixed version)
    # finds one there.
    return _BlockwiseCLI(
        # No classes given: the model and data are chosen by `class_path` in the config.
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={
            "prog": "lightning-blockwise",
            "description": DESCRIPTION,
        },
        parser_class=_BlockwiseParser,
        args=args,
        run=run,
    )


#: The Trainer's commands as argparse lists them in the usage line, and the list with ours (dispatched by `main`).
_TRAINER_COMMANDS = "{" + ",".join(LightningCLI.subcommands()) + "}"
_ALL_COMMANDS = _TRAINER_COMMANDS[:-1] + "".join(f",{name}" for name in OWN_COMMANDS) + "}"


class _BlockwiseParser(LightningArgumentParser):
    """Lightning's parser, whose usage line names every command and whose errors are one line, not the usage.

    jsonargparse answers a mistyped option with the whole usage (some 40 lines for ``fit``) and then a nested
    report of every type the value could have had; the line that says what is wrong comes last. Here it comes
    alone, as ``--key``: what is wrong, with "did you mean" where a known name is close.
    """

    @override
    def format_usage(self) -> str:
        return super().format_usage().replace(_TRAINER_COMMANDS, _ALL_COMMANDS, 1)

    @override
    def format_help(self) -> str:
        return super().format_help().replace(_TRAINER_COMMANDS, _ALL_COMMANDS, 1)

    @override
    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        # Where the caller asked to catch the error (or jsonargparse's debug mode), jsonargparse's own behaviour.
        if not self.exit_on_error or os.environ.get("JSONARGPARSE_DEBUG"):
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        sys.stderr.write(f"error: {explain_parse_error(message, parser)}\n")
        sys.stderr.write(f"tip: `{parser.prog.replace(' [options]', '')} --help` lists the options.\n")
        self.exit(2)


def explain_parse_error(message: str, parser: Any = None) -> str:
    """The line of a jsonargparse error ``message`` that says what is wrong, as ``--key: ...``, with "did you mean".

    Args:
        message: What jsonargparse reports, e.g. ``Parser key "model": ... Option 'lora_rank' is not accepted ...``.
        parser: The parser that failed, whose option names are suggested for an unrecognized argument.

    Returns:
        One line; the message unchanged (its lines joined) where it has none of the known shapes.
    """
    outer = re.match(r'Parser key "([^"]+)":', message)
    class_path = re.search(r"Problem with given class_path '([^']+)'", message)
    unknown = re.search(r"Option '([^']+)' is not accepted", message)
    if outer and class_path and unknown:
        key, option, name = outer.group(1), unknown.group(1), class_path.group(1)
        known = _init_arguments(name)
        near = difflib.get_close_matches(option, known, n=1)
        hint = f" Did you mean `{near[0]}`?" if near else ""
        return (
            f"`--{key}.init_args.{option}`: `{name.rsplit('.', 1)[-1]}` takes no argument `{option}`.{hint}"
            f" `--{key}.help {name}` lists the ones it takes."
        )
    # A value of the wrong type: the innermost key and what it expected (the union's other members are noise).
    keys = re.findall(r'Parser key "([^"]+)":\s*\n\s*(.+)', message)
    if outer and keys:
        inner, problem = keys[-1]
        key = outer.group(1) if inner == outer.group(1) else f"{outer.group(1)}.init_args.{inner}"
        return f"`--{key}`: {problem.strip()}"
    unrecognized = re.match(r"unrecognized arguments: (\S+)", message)
    if unrecognized and parser is not None:
        given = unrecognized.group(1).split("=", 1)[0]
        near = difflib.get_close_matches(given, [o for o in parser._option_string_actions if o.startswith("--")], n=1)
        if near:
            return f"{message.strip()}. Did you mean `{near[0]}`?"
    return " ".join(line.strip() for line in message.splitlines() if line.strip()).replace(
        _TRAINER_COMMANDS, _ALL_COMMANDS
    )


def _init_arguments(class_path: str) -> list[str]:
    """The constructor's argument names of the class at ``class_path``, or none where it does not import."""
    module, _, name = class_path.rpartition(".")
    try:
        parameters = inspect.signature(getattr(importlib.import_module(module), name)).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


#: `ckpt_path` values that the Trainer resolves itself, from its checkpoint callbacks or SLURM, rather than paths.
_CKPT_PATH_NAMES = ("best", "last", "hpc")


class _BlockwiseCLI(LightningCLI):
    """LightningCLI that refuses a missing ``--ckpt_path`` early and lets the command line win over a checkpoint."""

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        # Kept to parse again over a checkpoint's hyperparameters (NOTE [ Checkpoint hyperparameters under the
        # command line ]).
        self._given_args = args
        super().parse_arguments(parser, args)

    # NOTE [ Checkpoint hyperparameters under the command line ]
    # Given `--ckpt_path`, Lightning 2.6 (`LightningCLI._parse_ckpt_path`) reads the checkpoint's `hyper_parameters`
    # and merges them over the parsed config, so they override what the command line gives as well:
    # `fit --ckpt_path last.ckpt --model.init_args.learning_rate=1e-4` would resume at the checkpoint's rate.
    # Here the model config Lightning merged becomes the default of `model` and the arguments are parsed again,
    # from the start, so the order is jsonargparse's own with the checkpoint in the place of the defaults:
    # class defaults < checkpoint < config files < command-line flags. Each argument is applied once (a
    # `--trainer.callbacks+=...` appends one callback, not two). `tests/cli/test_cli.py` pins this behaviour, so a
    # Lightning release that renames the private hook fails there rather than silently.
    @override
    def _parse_ckpt_path(self) -> None:
        parsed = self.config
        ckpt_path = self.config[self.config.subcommand].get("ckpt_path") if self.config.get("subcommand") else None
        if ckpt_path and _is_local_path(str(ckpt_path)) and Path(ckpt_path).is_file():
            # An empty, truncated or foreign file is named with its problem here, before any model work.
            check_checkpoint_file(ckpt_path)
            refuse_removed_class_path(ckpt_path)
        super()._parse_ckpt_path()
        if self.config is parsed:
            return  # no checkpoint, or one without hyperparameters
        subcommand = self.config.subcommand
        self._parser(subcommand).set_defaults({"model": self.config[subcommand].model.as_dict()})
        super().parse_arguments(self.parser, self._given_args)

    @override
    def before_instantiate_classes(self) -> None:
        """Refuse a ``--ckpt_path`` that does not exist before the model is built: loading a base can take minutes.

        Also leaves out a config's progress-bar callback under ``--trainer.enable_progress_bar=false``
        (:func:`~lightning_blockwise.cli.progress_bar_flag.drop_progress_bars`).

        Raises:
            MisconfigurationException: If ``--ckpt_path`` names a local path that does not exist.
        """
        if self.subcommand is None:
            return
        drop_progress_bars(self.config[self.subcommand].trainer)
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if ckpt_path is None or not _is_local_path(str(ckpt_path)) or Path(ckpt_path).exists():
            return
        raise MisconfigurationException(
            f"`lightning-blockwise {self.subcommand} --ckpt_path={ckpt_path}`: the path does not exist. Give a"
            " checkpoint that a run saved, e.g. `<log_dir>/checkpoints/epoch=0-step=100.ckpt`; nothing was built or"
            " loaded."
        )

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:
            cause = constructor_error(error)
            if cause is None:
                raise
            # The constructor's own words, without jsonargparse's report of the union around them.
            raise cause from None

    @override
    def before_fit(self) -> None:
        """Check the config against its data once the data is set up, before the base loads (:class:`DataCheck`)."""
        self.trainer.callbacks.append(DataCheck())


def _is_local_path(ckpt_path: str) -> bool:
    """Whether ``ckpt_path`` is a local path, not a name the Trainer resolves or a remote URL (``s3://...``)."""
    # "registry" and "registry:<model>" name a checkpoint in Lightning's model registry.
    if ckpt_path in _CKPT_PATH_NAMES or ckpt_path.lower().split(":", 1)[0] == "registry":
        return False
    return get_protocol(ckpt_path) == "file"


def run_trainer_cli(args: ArgsType = None) -> None:
    """Run a Trainer command (:func:`build_cli`); a user's mistake exits with its one line, not a traceback.

    Args:
        args: Command-line arguments; ``None`` reads ``sys.argv[1:]``.
    """
    try:
        build_cli(args)
    except MisconfigurationException as error:
        # A user's mistake, worded with its fix (the refusals' convention): one line, not a traceback.
        raise SystemExit(one_line(error)) from None


__all__ = ["build_cli", "explain_parse_error", "run_trainer_cli"]
