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
    lightning-blockwise versions --check
"""

from __future__ import annotations

import sys
from pathlib import Path

from fsspec.utils import get_protocol
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

# Imported for its side effect: registering "blockwise" in Lightning's strategy registry
# before the parser resolves `trainer.strategy`.
import lightning_blockwise  # noqa: F401
from lightning_blockwise.cli.export_command import EXPORT_COMMAND, export_command
from lightning_blockwise.cli.plan_command import PLAN_COMMAND, plan, plan_report
from lightning_blockwise.compat.versions import VERSIONS_COMMAND, versions_command

#: What ``lightning-blockwise --help`` says: every command, LightningCLI's and the two dispatched by `main`.
DESCRIPTION = (
    "Lightning's Trainer command line with the `blockwise` strategy registered (`--trainer.strategy=blockwise`)."
    " Commands: fit, validate, test, predict (the Trainer's, below);"
    f" {PLAN_COMMAND} (predict a model's host RAM and VRAM from its config, no weights read);"
    f" {EXPORT_COMMAND} (write a trained adapter as a PEFT directory, or merged into its base, streamed layer by"
    f" layer); {VERSIONS_COMMAND} (the tested range of each dependency and what is installed; `--check` exits 1"
    " outside it). `lightning-blockwise COMMAND --help` describes each."
)


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (default: ``sys.argv``), instantiate the Trainer, model and data, and run the subcommand.

    A ``--ckpt_path`` that does not exist is refused before anything is built. The hyperparameters
    saved in a checkpoint fill in the model arguments that neither a config file nor the command
    line gives (NOTE [ Checkpoint hyperparameters under the command line ]).

    Args:
        args: Command-line arguments, a dict or a namespace; ``None`` reads ``sys.argv[1:]``.
        run: Expect a subcommand (``fit``, ``validate``, ``test``, ``predict``) and run it.
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
        args=args,
        run=run,
    )


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
        super()._parse_ckpt_path()
        if self.config is parsed:
            return  # no checkpoint, or one without hyperparameters
        subcommand = self.config.subcommand
        self._parser(subcommand).set_defaults({"model": self.config[subcommand].model.as_dict()})
        super().parse_arguments(self.parser, self._given_args)

    @override
    def before_instantiate_classes(self) -> None:
        """Refuse a ``--ckpt_path`` that does not exist before the model is built: loading a base can take minutes.

        Raises:
            MisconfigurationException: If ``--ckpt_path`` names a local path that does not exist.
        """
        if self.subcommand is None:
            return
        ckpt_path = self.config[self.subcommand].get("ckpt_path")
        if ckpt_path is None or not _is_local_path(str(ckpt_path)) or Path(ckpt_path).exists():
            return
        raise MisconfigurationException(
            f"`lightning-blockwise {self.subcommand} --ckpt_path={ckpt_path}`: the path does not exist. Give a"
            " checkpoint that a run saved, e.g. `<log_dir>/checkpoints/epoch=0-step=100.ckpt`; nothing was built or"
            " loaded."
        )


def _is_local_path(ckpt_path: str) -> bool:
    """Whether ``ckpt_path`` is a local path, not a name the Trainer resolves or a remote URL (``s3://...``)."""
    # "registry" and "registry:<model>" name a checkpoint in Lightning's model registry.
    if ckpt_path in _CKPT_PATH_NAMES or ckpt_path.lower().split(":", 1)[0] == "registry":
        return False
    return get_protocol(ckpt_path) == "file"


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-blockwise`` console script and of ``python -m lightning_blockwise``.

    Args:
        args: Command-line arguments; ``None`` reads ``sys.argv[1:]``.
    """
    argv = sys.argv[1:] if args is None else args
    # Return nothing: a console script's return value becomes the process's exit status.
    if isinstance(argv, list) and argv[:1] == [PLAN_COMMAND]:
        plan(argv[1:])
    elif isinstance(argv, list) and argv[:1] == [EXPORT_COMMAND]:
        export_command(argv[1:])
    elif isinstance(argv, list) and argv[:1] == [VERSIONS_COMMAND]:
        versions_command(argv[1:])
    else:
        build_cli(args)


__all__ = ["build_cli", "export_command", "main", "plan", "plan_report"]
