"""``lightning-blockwise generate``: talk to a trained adapter, the frozen base streamed as in training.

The work is :func:`lightning_blockwise.recipes.generation.generate_replies`; this module parses the
arguments, refuses bad ones on one line before any weight is read, and prints the replies. Like
``plan`` and ``export``, the command is handled before LightningCLI parses, by
:func:`~lightning_blockwise.cli.main`.

Example::

    lightning-blockwise generate /models/Qwen2.5-72B --adapter runs/adapter --prompt "Name a primary color."
    lightning-blockwise generate --ckpt runs/version_0/checkpoints/last.ckpt --vram-budget 20GiB
    lightning-blockwise generate /models/Qwen2.5-7B --adapter runs/adapter --temperature 0.7 --top-p 0.9 --seed 1
"""

from __future__ import annotations

import argparse
import inspect
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from typing_extensions import override

from lightning_blockwise.cli.base_flags import add_base_flags
from lightning_blockwise.cli.commands import GENERATE_COMMAND
from lightning_blockwise.recipes.chat import ALPACA, AUTO, chat_format
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.generation import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_NEW_TOKENS_LIMIT,
    RESET_COMMAND,
    ChatSession,
    GeneratingFineTune,
    PromptFormat,
    Reply,
    Sampling,
    generate_replies,
)
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

#: ``--chat-template`` value that sends the prompt as plain text, continued by the model.
NO_TEMPLATE = "none"
#: ``--precision`` values: Lightning's, refused on one line by the parser rather than by the Trainer, mid-run.
PRECISIONS = ("bf16-mixed", "16-mixed", "32-true", "bf16-true", "16-true", "64-true", "bf16", "16", "32", "64")
#: What ends the interactive loop, besides the end of stdin.
_QUIT = ("/quit", "/exit")


def generate_command(args: list[str] | None = None) -> list[Reply]:
    """``lightning-blockwise generate``: answer ``--prompt`` s (or an interactive loop on stdin) and print the replies.

    Args:
        args: The arguments after ``generate``; ``None`` reads ``sys.argv[2:]``.

    Returns:
        The replies, in order.

    Raises:
        SystemExit: With a one-line message starting ``lightning-blockwise generate:`` for a bad argument, a
            missing adapter, checkpoint or tokenizer (all checked before the base loads).
    """
    options = _generate_parser().parse_args(sys.argv[2:] if args is None else args)
    try:
        module_args = _module_arguments(options)
        tokenizer = _tokenizer(options.tokenizer or module_args["checkpoint"])
        chat = None if options.chat_template == NO_TEMPLATE else chat_format(tokenizer, options.chat_template)
        sampling = Sampling(options.max_new_tokens, options.temperature, options.top_p, options.top_k, options.seed)
        strategy = "auto" if options.resident else _strategy(options)
    except (ValueError, MisconfigurationException) as error:
        _fail(str(error))
    interactive = not options.prompt
    prompts = _read_stdin() if interactive else _batches(options.prompt, options.batch_size)
    session = ChatSession(
        PromptFormat(tokenizer, chat, options.system),
        prompts,
        sampling,
        on_reply=(lambda reply: print(reply.text, flush=True)) if interactive else _print_reply,
        report=lambda line: print(line, file=sys.stderr, flush=True),
        history=interactive and chat is not None,
    )
    if interactive:
        print(
            f"Type a message and Enter; {RESET_COMMAND} starts over, {_QUIT[0]} or Ctrl-D ends."
            f" Replies stop at EOS or {sampling.max_new_tokens} tokens.",
            file=sys.stderr,
        )
    try:
        return generate_replies(
            GeneratingFineTune(**module_args),
            session,
            strategy=strategy,
            accelerator="gpu" if options.device == "cuda" else "cpu",
            precision=options.precision,
            ckpt_path=options.ckpt,
            verbose=options.verbose,
        )
    except MisconfigurationException as error:
        _fail(str(error))


class _GenerateParser(argparse.ArgumentParser):
    """argparse, its errors on one line like the other errors of ``generate``."""

    @override
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"{self.prog}: {message}")


def _fail(message: str) -> NoReturn:
    # The library's messages name their own class (`CausalLMFineTune(...)`); the prefix says which command.
    raise SystemExit(f"lightning-blockwise {GENERATE_COMMAND}: {message}")


def _module_arguments(options: argparse.Namespace) -> dict[str, Any]:
    """``CausalLMFineTune``'s arguments: a ``.ckpt``'s hyperparameters, or the base and ``--adapter``."""
    if options.adapter is not None and options.ckpt is not None:
        raise ValueError("give --adapter DIR or --ckpt FILE, not both: both hold adapters.")
    arguments: dict[str, Any] = {}
    if options.ckpt is not None:
        arguments = _checkpoint_arguments(options.ckpt)
    elif options.base is None:
        raise ValueError("give the base checkpoint directory (the first argument), or --ckpt FILE of a run.")
    if options.base is not None:
        arguments["checkpoint"] = str(options.base)
    if not (Path(arguments["checkpoint"]) / "config.json").is_file():
        raise ValueError(
            f"the base {arguments['checkpoint']} holds no config.json. Give the local checkpoint directory the"
            " adapter was trained on."
        )
    if options.adapter is not None:
        if not (options.adapter / "adapter_config.json").is_file():
            raise ValueError(
                f"--adapter {options.adapter} holds no adapter_config.json. Give a PEFT adapter directory (a run's"
                " `<log_dir>/adapter`), or a run's .ckpt as --ckpt."
            )
        arguments["adapter_path"] = str(options.adapter)
    # What is not given, an --adapter's record decides (NOTE [ The training record of an adapter ]), a --ckpt's
    # hyperparameters otherwise; what is given wins, with a warning where it differs from the record.
    for name in ("compute_dtype", "quantize"):
        if getattr(options, name) is not None:
            arguments[name] = getattr(options, name)
    if options.allow_other_base:
        arguments["allow_other_base"] = True
    return arguments


def _checkpoint_arguments(path: Path) -> dict[str, Any]:
    """The ``CausalLMFineTune`` hyperparameters saved in the ``.ckpt`` at ``path``."""
    if not path.is_file():
        raise ValueError(f"--ckpt {path} does not exist. Give a .ckpt a CausalLMFineTune run saved.")
    # Weights-only, as Lightning reads a local checkpoint: unpickling anything more could run code from the file
    # (NOTE [ No code from checkpoint files ] in strategy/checkpoint_files.py). Memory-mapped: a full-state
    # checkpoint's base is not read into RAM to get at its hyperparameters.
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"--ckpt {path} holds objects that a weights-only load refuses ({str(error).strip().splitlines()[0]}):"
            " unpickling them could run code from the file, so it is not read. Give a checkpoint a CausalLMFineTune"
            " run saved, or export its adapter as a PEFT directory and give it as --adapter with the base."
        ) from None
    except (RuntimeError, OSError, EOFError) as error:
        raise ValueError(f"--ckpt {path} is not a readable checkpoint ({type(error).__name__}: {error}).") from None
    saved = (saved.get("hyper_parameters") if isinstance(saved, dict) else None) or {}
    known = set(inspect.signature(CausalLMFineTune).parameters)
    if "checkpoint" not in saved:
        raise ValueError(
            f"--ckpt {path} was not saved by a CausalLMFineTune run (its hyperparameters name no `checkpoint`)."
            " Export its adapter as a PEFT directory and give it as --adapter with the base."
        )
    return {key: value for key, value in saved.items() if key in known}


def _tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    if not Path(path).exists():  # else Hugging Face takes it for a hub repo id ("Repo id must be in the form ...")
        raise ValueError(f"--tokenizer {path} does not exist. Give the local directory of the model's tokenizer.")
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"no tokenizer could be loaded from {path} ({type(error).__name__}). Give the directory that holds the"
            " model's tokenizer as --tokenizer."
        ) from None


def _strategy(options: argparse.Namespace) -> BlockwiseStrategy:
    if options.device == "cpu" and options.vram_budget is not None:
        raise ValueError("--vram-budget caps a GPU's memory; on --device cpu the base is read from host memory.")
    try:
        return BlockwiseStrategy(block_size=options.block_size, vram_budget=options.vram_budget)
    except MisconfigurationException as error:
        # The strategy's message names its own argument; say it in this command's words.
        raise ValueError(f"--vram-budget {options.vram_budget} / --block-size {options.block_size}: {error}") from None


def _batches(prompts: list[str], batch_size: int) -> list[list[str]]:
    return [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]


def _read_stdin() -> Iterator[list[str]]:
    """One-message batches read from stdin as they come, until EOF or ``/quit``; blank lines skipped."""
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in _QUIT:
            return
        if line.strip():
            yield [line.rstrip("\n")]


def _print_reply(reply: Reply) -> None:
    end = "" if reply.stopped else " [max_new_tokens]"
    print(f">>> {reply.prompt}\n{reply.text}{end}\n", flush=True)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _generate_parser() -> argparse.ArgumentParser:
    parser = _GenerateParser(
        prog=f"lightning-blockwise {GENERATE_COMMAND}",
        description="Talk to a trained adapter: replies to --prompt (batched), or a chat on stdin when none is"
        " given. The frozen base streams through the GPU block by block as in training, so a 72B adapter runs on a"
        " 24 GB card: every new token streams the streamed part of the base once (about 0.75 s at 72B on an H100's"
        " host link, shared by the prompts of a batch); --vram-budget keeps what fits resident. The expected and"
        " the measured speed are printed on stderr. Replies stop at the end-of-sequence token or"
        " --max-new-tokens.",
    )
    parser.add_argument(
        "base",
        type=Path,
        nargs="?",
        help="The local checkpoint directory the adapter was trained on (default with --ckpt: the run's).",
    )
    source = parser.add_argument_group("adapter (one of)")
    source.add_argument("--adapter", type=Path, help="A PEFT adapter directory, e.g. a run's <log_dir>/adapter.")
    source.add_argument("--ckpt", type=Path, help="A .ckpt saved by a CausalLMFineTune run (lean: adapters only).")
    parser.add_argument(
        "--prompt",
        action="append",
        help="A user message; repeat for several, generated in batches of --batch-size. None: a chat on stdin.",
    )
    parser.add_argument("--system", help="A system message put before every conversation (chat templates only).")
    parser.add_argument(
        "--chat-template",
        default=AUTO,
        help=f"{AUTO}: the tokenizer's chat template, else the Alpaca format, as training renders rows; {ALPACA};"
        f" {NO_TEMPLATE}: the prompt as plain text, continued; or a Jinja template file (default: {AUTO}).",
    )
    parser.add_argument("--tokenizer", type=Path, help="Where the tokenizer is (default: the base checkpoint).")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"Tokens per reply at most, 1 to {MAX_NEW_TOKENS_LIMIT} (default: {DEFAULT_MAX_NEW_TOKENS}).",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; above 0: sampling, e.g. 0.7 (default: 0)."
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass, 0 to 1 (default: 1, off).")
    parser.add_argument("--top-k", type=int, default=0, help="Sample from the k likeliest tokens (default: 0, off).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampling, 0 to 2**64 - 1 (default: 0).")
    parser.add_argument(
        "--batch-size", type=_positive, default=8, help="Prompts generated at once (default: 8)."
    )  # fmt: skip
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="Where the model computes (default: cuda when available).",
    )
    parser.add_argument(
        "--vram-budget",
        help="Cap on the GPU memory, e.g. 20GiB: the blocks that fit stay resident, the rest stream (default: every"
        " block streams; unlike training, generation does not default to the card's free memory, since its KV"
        " cache is outside the step planner).",
    )
    parser.add_argument("--block-size", type=_positive, default=1, help="Decoder layers per streamed block (1).")
    parser.add_argument(
        "--resident",
        action="store_true",
        help="Load the whole base onto the device instead of streaming it (faster where it fits).",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=["bfloat16", "float16", "float32"],
        help="The compute_dtype training used (default: the .ckpt's or the adapter's record, else bfloat16).",
    )
    add_base_flags(parser, "Load")
    parser.add_argument(
        "--precision", choices=PRECISIONS, help="The Trainer's precision (default: bf16-mixed on GPU, 32-true on CPU)."
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="Show the messages left out by default, as LIGHTNING_BLOCKWISE_VERBOSE=1 does for any command: e.g."
        " Lightning's note that a --ckpt's training callbacks are not given back, which generation does not need.",
    )
    return parser


__all__ = ["GENERATE_COMMAND", "generate_command"]
