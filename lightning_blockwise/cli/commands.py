"""The commands of ``lightning-blockwise`` and its overview (``--help``), without importing Lightning.

The Trainer's commands are LightningCLI's; ours (``plan``, ``export``, ``generate``, ``versions``) are dispatched by
:func:`~lightning_blockwise.cli.main` before LightningCLI parses. ``lightning-blockwise --help`` prints the overview
below rather than LightningCLI's, which needs Lightning and torch imported first (seconds, for a list of commands).
"""

from __future__ import annotations

import argparse

from lightning_blockwise.compat.versions import VERSIONS_COMMAND

#: Our subcommands, handled before LightningCLI parses (LightningCLI knows only the Trainer's).
PLAN_COMMAND = "plan"
EXPORT_COMMAND = "export"
GENERATE_COMMAND = "generate"
#: ``LightningCLI.subcommands()``, each with what it does (tests/cli/test_startup.py checks the names against
#: Lightning's).
TRAINER_COMMANDS = {
    "fit": "Train the model (`Trainer.fit`); `--verbose` shows every message.",
    "validate": "One evaluation epoch over the validation set (`Trainer.validate`).",
    "test": "One evaluation epoch over the test set (`Trainer.test`).",
    "predict": "Run the model over the predict data (`Trainer.predict`).",
}
#: The Trainer's commands that take our ``--verbose`` (every message, as ``LIGHTNING_BLOCKWISE_VERBOSE=1``);
#: ``validate`` and ``test`` have Lightning's own (NOTE [ --verbose on the Trainer's commands ] in cli/__init__.py).
VERBOSE_COMMANDS = ("fit", "predict")
VERBOSE_FLAG = "--verbose"
#: Our commands, each with what it does.
OWN_COMMANDS = {
    PLAN_COMMAND: "Predict a model's host RAM and VRAM from its config, no weights read.",
    EXPORT_COMMAND: "Write a trained adapter as a PEFT directory, or merged into its base, streamed layer by layer.",
    GENERATE_COMMAND: "Talk to a trained adapter, the base streamed as in training.",
    VERSIONS_COMMAND: "The tested range of each dependency and what is installed; `--check` exits 1 outside it.",
}

#: What ``lightning-blockwise --help`` says above the commands; LightningCLI's parser says it too.
DESCRIPTION = (
    "Lightning's Trainer command line with the `blockwise` strategy registered (`--trainer.strategy=blockwise`)."
    f" Commands: {', '.join(TRAINER_COMMANDS)} (the Trainer's); "
    + "; ".join(f"{name} ({what[0].lower()}{what[1:-1]})" for name, what in OWN_COMMANDS.items())
    + ". `lightning-blockwise COMMAND --help` describes each."
)


def overview() -> argparse.ArgumentParser:
    """The parser whose help is ``lightning-blockwise --help``: the commands, and the options before one."""
    commands = "{" + ",".join([*TRAINER_COMMANDS, *OWN_COMMANDS]) + "}"
    # LightningCLI's usage line, with our commands (cli/trainer_cli.py's parser says the same).
    usage = f"%(prog)s [-c CONFIG] {commands} ..."
    parser = argparse.ArgumentParser(prog="lightning-blockwise", usage=usage, description=DESCRIPTION)
    parser.add_argument("-c", "--config", help="Path to a configuration file in json or yaml format.")
    parser.add_argument(
        "--print_config",
        nargs="?",
        metavar="=flags",
        help="Print the configuration after applying all other arguments and exit (the Trainer's commands).",
    )
    subparsers = parser.add_subparsers(title="commands", metavar=commands)
    for name, what in {**TRAINER_COMMANDS, **OWN_COMMANDS}.items():
        subparsers.add_parser(name, help=what)
    return parser


__all__ = [
    "DESCRIPTION",
    "EXPORT_COMMAND",
    "GENERATE_COMMAND",
    "OWN_COMMANDS",
    "PLAN_COMMAND",
    "TRAINER_COMMANDS",
    "VERBOSE_COMMANDS",
    "VERBOSE_FLAG",
    "VERSIONS_COMMAND",
    "overview",
]
