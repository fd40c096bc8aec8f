"""The ``lightning-blockwise`` command: Lightning's CLI with the ``"blockwise"`` strategy registered.

Any LightningModule and LightningDataModule can be named in the config by ``class_path``;
``trainer.strategy`` takes ``blockwise`` or ``class_path: lightning_blockwise.BlockwiseStrategy``.

Example::

    lightning-blockwise fit --config configs/demo.yaml
    lightning-blockwise fit --config configs/demo.yaml --trainer.max_steps=20 --print_config
    python -m lightning_blockwise validate --config configs/demo.yaml
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType, LightningCLI

# Imported for its side effect: registering "blockwise" in Lightning's strategy registry
# before the parser resolves `trainer.strategy`.
import lightning_blockwise  # noqa: F401


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (default: ``sys.argv``), instantiate the Trainer, model and data, and run the subcommand.

    Args:
        args: Command-line arguments, a dict or a namespace; ``None`` reads ``sys.argv[1:]``.
        run: Expect a subcommand (``fit``, ``validate``, ``test``, ``predict``) and run it.
            With ``False`` the config is given without one and only instantiated, e.g. to
            inspect ``cli.trainer.strategy``.

    Returns:
        The :class:`~lightning.pytorch.cli.LightningCLI`, with ``trainer``, ``model`` and
        ``datamodule`` attributes.
    """
    return LightningCLI(
        # No classes given: the model and data are chosen by `class_path` in the config.
        subclass_mode_model=True,
        subclass_mode_data=True,
        # Each run's config goes into its log directory; rerunning a config reuses that directory.
        save_config_kwargs={"overwrite": True},
        parser_kwargs={
            "prog": "lightning-blockwise",
            "description": "Lightning's Trainer command line, with `--trainer.strategy=blockwise` available.",
        },
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-blockwise`` console script and of ``python -m lightning_blockwise``.

    Args:
        args: Command-line arguments; ``None`` reads ``sys.argv[1:]``.
    """
    # Return nothing: a console script's return value becomes the process's exit status.
    build_cli(args)
