"""Every command, option and argument the README and docs/ name exists (issue 43 item 11).

Read from the Markdown's code (inline spans and fenced blocks), each checked against what it names:

- ``lightning-blockwise COMMAND`` (or ``python -m lightning_blockwise COMMAND``): COMMAND is one the CLI dispatches.
- ``--option`` after a command, in the same span or block line: an option of that command's parser
  (``plan``, ``export``, ``generate``, ``versions``); of LightningCLI for ``fit``/``validate``/``test``/``predict``
  (``--trainer.X`` a Trainer argument, ``--model.init_args.X`` a shipped module's, ``--data.init_args.X`` a
  shipped data module's, the deeper keys of callbacks, strategy and logger their classes'); of a benchmark script
  (``python -m benchmarks.NAME``, ``benchmarks/NAME.py``, ``NAME.py``, ``benchmarks.NAME``): an option string in
  its source; of ``torchrun``: its own parser's; of ``pip``, ``sbatch``, ``tensorboard``: the short lists below.
- ``--option`` in a span without a command (prose: "`--recompute-every 2`"): an option of some command above.
- ``Class(name=...)`` for the package's public classes and Lightning's ``Trainer``: ``name`` is an argument of it.

Each check has a control: a made-up option, command or argument in a page fails it. The files the pages name and
the README's option table: tests/docs/test_named_files.py.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.distributed.run import get_args_parser as torchrun_parser

import lightning_blockwise
import lightning_blockwise.callbacks as blockwise_callbacks
from lightning_blockwise.cli.commands import VERBOSE_COMMANDS, VERBOSE_FLAG
from lightning_blockwise.cli.export_command import _export_parser
from lightning_blockwise.cli.generate_command import _generate_parser
from lightning_blockwise.cli.plan_arguments import plan_parser
from lightning_blockwise.cli.plan_nodes import add_nodes_argument
from lightning_blockwise.demos.progressions import DemoDataModule
from lightning_blockwise.demos.tiny import DemoCausalLM
from lightning_blockwise.recipes.data import InstructionDataModule, SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Options of outside tools the docs use, by tool (their parsers are not importable here).
EXTERNAL = {
    "pip": {"--index-url", "--no-deps", "--upgrade", "--extra-index-url"},
    "sbatch": {"--job-name", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--mem", "--time"},
    "tensorboard": {"--logdir"},
}
#: LightningCLI's own options besides the config's keys.
LIGHTNING_CLI = {"--config", "--print_config", "--ckpt_path", "--seed_everything", "--help"}
TRAINER_COMMANDS = set(LightningCLI.subcommands())


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for option in parser._option_string_actions if option.startswith("--")}


def _parameters(*classes: type) -> set[str]:
    return {name for cls in classes for name in inspect.signature(cls).parameters}


def _source_options(path: Path) -> set[str]:
    """The option strings a script's source defines (``"--name"`` literals)."""
    return set(re.findall(r"""["'](--[a-z][a-z0-9-_]*)["']""", path.read_text()))


def _plan_options() -> set[str]:
    parser = plan_parser()
    add_nodes_argument(parser)  # as `plan` adds it (cli/plan_command.py)
    return _options(parser)


OWN_COMMANDS = {
    "plan": _plan_options(),
    "export": _options(_export_parser()),
    "generate": _options(_generate_parser()),
    "versions": _source_options(ROOT / "lightning_blockwise" / "compat" / "versions.py") | {"--help"},
}
MODELS = _parameters(CausalLMFineTune, DemoCausalLM)
DATA = _parameters(InstructionDataModule, SyntheticTokensDataModule, DemoDataModule)
_CALLBACK_CLASSES = [
    value
    for name, value in vars(blockwise_callbacks).items()
    if name in blockwise_callbacks.__all__ and inspect.isclass(value) and not issubclass(value, Exception)
]
_LIGHTNING_CALLBACKS = [
    getattr(__import__("lightning.pytorch.callbacks", fromlist=[name]), name)
    for name in ("ModelCheckpoint", "EarlyStopping", "LearningRateMonitor")
]
#: What the keys under a Trainer argument may name, by argument.
NESTED = {
    "callbacks": _parameters(*_CALLBACK_CLASSES, *_LIGHTNING_CALLBACKS),
    "strategy": _parameters(BlockwiseStrategy),
    "logger": _parameters(CSVLogger, TensorBoardLogger),
}
#: The public classes whose keyword arguments the docs name, by the name they are written with.
API = {
    **{
        name: value
        for name, value in vars(lightning_blockwise).items()
        if name in lightning_blockwise.__all__
        and callable(value)
        and not (inspect.isclass(value) and issubclass(value, Exception))
    },
    "CausalLMFineTune": CausalLMFineTune,
    "InstructionDataModule": InstructionDataModule,
    "SyntheticTokensDataModule": SyntheticTokensDataModule,
    "DemoCausalLM": DemoCausalLM,
    "Trainer": Trainer,
}


def _cli_option_exists(option: str) -> bool:
    """Whether LightningCLI (``lightning-blockwise fit``) takes ``option`` (``--trainer.devices``, ...)."""
    if option in LIGHTNING_CLI:
        return True
    keys = [key for key in option[2:].rstrip("+").split(".") if key != "init_args"]
    group, rest = keys[0], keys[1:]
    if group == "trainer":
        if not rest or rest[0] not in _parameters(Trainer):
            return False
        return len(rest) == 1 or (rest[0] in NESTED and rest[1] in NESTED[rest[0]])
    if group in ("model", "data"):
        # `--model CLASS` names the class (subclass mode); `--model.init_args.X` one of its arguments.
        return not rest or (len(rest) == 1 and rest[0] in (MODELS if group == "model" else DATA))
    return False


@dataclass(frozen=True)
class Named:
    """An option (or command) a page names, with the command it follows (``None``: none in its span)."""

    page: str
    line: int
    command: str | None
    option: str


#: What starts a command in a span: ours, a benchmark script, or an outside tool.
_COMMAND = re.compile(
    r"(?:lightning-blockwise|-m lightning_blockwise)\s+(?P<own>[a-z_-]+)"
    r"|(?:python3? -m )?benchmarks[./](?P<bench>[a-z_]+)(?:\.py)?"
    r"|(?<![\w/.-])(?P<script>[a-z_]+)\.py\b"
    r"|(?<![\w-])(?P<tool>torchrun|pip|sbatch|#SBATCH|tensorboard)\b"
)
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_.-]*[a-z0-9_+]|--[a-z])")


def _code(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code) for every fenced block line (continuations joined) and every inline span."""
    fenced, pending = False, ""
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            fenced = not fenced
            continue
        if fenced:
            pending += line.rstrip("\\") + " "
            if not line.rstrip().endswith("\\"):
                yield number, pending
                pending = ""
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span


def named(page: Path) -> Iterator[Named]:
    """The commands and options ``page`` names in its code, each with the command it follows."""
    for number, code in _code(page.read_text()):
        code = re.sub(r"#(?!SBATCH).*$", "", code)  # a shell comment names nothing to run
        starts = [(match.start(), match) for match in _COMMAND.finditer(code)]
        for match in _OPTION.finditer(code):
            before = [m for start, m in starts if start < match.start()]
            command = None
            if before:
                last = before[-1]
                kind = last.lastgroup
                command = f"{kind}:{last.group(kind)}"
            yield Named(page.name, number, command, match.group(1))
        for _, match in starts:
            if match.lastgroup == "own":
                yield Named(page.name, number, "own", match.group("own"))


def _benchmark(name: str) -> Path | None:
    for folder in ("benchmarks", "tools", "examples"):
        if (ROOT / folder / f"{name}.py").is_file():
            return ROOT / folder / f"{name}.py"
    return None


ALL_OWN = set().union(*OWN_COMMANDS.values()) | LIGHTNING_CLI
OUTSIDE_TOOLS = set().union(*EXTERNAL.values()) | _options(torchrun_parser())


def problem(item: Named) -> str | None:
    """What is wrong with a named option or command, or ``None``."""
    if item.command == "own":
        known = TRAINER_COMMANDS | set(OWN_COMMANDS)
        return None if item.option in known else f"`lightning-blockwise {item.option}` is no command ({sorted(known)})"
    option = item.option.split("=", 1)[0]
    if item.command is None:
        if option in ALL_OWN or _cli_option_exists(option) or option in OUTSIDE_TOOLS:
            return None
        scripts = [path for path in (ROOT / "benchmarks").glob("*.py") if option in _source_options(path)]
        return None if scripts else f"`{option}` is an option of no command"
    kind, _, name = item.command.partition(":")
    if kind == "own":
        if name in TRAINER_COMMANDS:
            ours = name in VERBOSE_COMMANDS and option == VERBOSE_FLAG  # taken out before LightningCLI parses
            return None if ours or _cli_option_exists(option) else f"`lightning-blockwise {name}` takes no `{option}`"
        if name not in OWN_COMMANDS:
            return None  # the command itself is reported
        return None if option in OWN_COMMANDS[name] else f"`lightning-blockwise {name}` takes no `{option}`"
    if kind in ("bench", "script"):
        script = _benchmark(name)
        if script is None:
            return f"`{name}.py` is no script of benchmarks/, tools/ or examples/"
        return None if option in _source_options(script) else f"`{script.relative_to(ROOT)}` takes no `{option}`"
    if name == "torchrun":
        return None if option in _options(torchrun_parser()) else f"`torchrun` takes no `{option}`"
    tool = "sbatch" if name == "#SBATCH" else name
    return None if option in EXTERNAL[tool] else f"`{tool}` takes no `{option}` (add it to EXTERNAL if it does)"


#: A call with no call inside it: ``Name(args)``.
_INNERMOST_CALL = re.compile(r"\b(?P<name>[A-Za-z_][A-Za-z0-9_]*)\((?P<args>[^()]*)\)")


def _snippets(text: str) -> Iterator[tuple[int, str]]:
    """(line number, code) for every fenced block, whole (a call spans lines), and every inline span."""
    fenced: list[str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(r"^\s*(```|~~~)", line):
            if fenced is None:
                fenced, start = [], number + 1
            else:
                yield start, "\n".join(fenced)
                fenced = None
        elif fenced is not None:
            fenced.append(line)
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield number, span


def api_problems(page: Path) -> list[str]:
    """``Name(arg=...)`` in ``page``'s code where ``Name`` is ours (or ``Trainer``) and takes no ``arg``."""
    found = []
    for number, code in _snippets(page.read_text()):
        while match := _INNERMOST_CALL.search(code):
            cls = API.get(match.group("name"))
            if cls is not None:
                accepted = _parameters(cls)
                for name in re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)\s*=(?!=)", match.group("args")):
                    if name not in accepted:
                        found.append(f"{page.name}:{number}: `{match.group('name')}` takes no `{name}`")
            # The call, checked, stands for a value in the call around it.
            code = code[: match.start()] + "_" + code[match.end() :]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_command_and_option_a_page_names_exists(page: Path) -> None:
    wrong = [f"{item.page}:{item.line}: {problem(item)}" for item in named(page) if problem(item)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_keyword_argument_a_page_names_exists(page: Path) -> None:
    wrong = api_problems(page)
    assert not wrong, "\n".join(wrong)


def test_control_made_up_names_fail(tmp_path: Path) -> None:
    page = tmp_path / "made-up.md"
    page.write_text(
        "Run `lightning-blockwise plan CKPT --seq-len 512 --seq-lenn 9` or `lightning-blockwise trian`.\n\n"
        "```bash\nlightning-blockwise fit --config c.yaml --trainer.max_step=3 --model.init_args.lora_rank=4 \\\n"
        "    --data.init_args.path=d --trainer.callbacks.save_lastt=true\n"
        "python -m benchmarks.peers --arms x --no-such-flag\n"
        "torchrun --nproc-per-node 2 --nproc-pernode 2 t.py\n```\n\n"
        "Prose: `--recompute-every 2` and `--made-up-option`; `BlockwiseStrategy(block_size=2, blok_size=3)`,"
        ' `Trainer(strategy="blockwise", devices=1, devises=2)`.\n'
    )
    wrong = sorted({problem(item) for item in named(page)} - {None})
    assert wrong == sorted(
        [
            "`lightning-blockwise plan` takes no `--seq-lenn`",
            "`lightning-blockwise trian` is no command (['export', 'fit', 'generate', 'plan', 'predict', 'test',"
            " 'validate', 'versions'])",
            "`lightning-blockwise fit` takes no `--trainer.max_step`",
            "`lightning-blockwise fit` takes no `--model.init_args.lora_rank`",
            "`lightning-blockwise fit` takes no `--trainer.callbacks.save_lastt`",
            "`benchmarks/peers.py` takes no `--no-such-flag`",
            "`torchrun` takes no `--nproc-pernode`",
            "`--made-up-option` is an option of no command",
        ]
    ), wrong
    assert api_problems(page) == [
        "made-up.md:10: `BlockwiseStrategy` takes no `blok_size`",
        "made-up.md:10: `Trainer` takes no `devises`",
    ]
