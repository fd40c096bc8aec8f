"""``lightning-blockwise export``: a trained adapter as a PEFT directory, or merged into its base as a model.

The work is :func:`lightning_blockwise.export.merge.export`; this module parses the arguments and
says what went wrong on one line. Like ``plan``, the command is handled before LightningCLI parses,
by :func:`~lightning_blockwise.cli.main`.

Example::

    lightning-blockwise export runs/version_0/checkpoints/last.ckpt /models/Qwen2.5-7B out/adapter
    lightning-blockwise export runs/adapter /models/Qwen2.5-72B out/merged --merge bf16 --device cuda
    lightning-blockwise export runs/adapter /models/Qwen2.5-72B out/merged-nf4 --merge nf4 --max-shard-size 2GB
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from typing_extensions import override

from lightning_blockwise.cli.base_flags import add_base_flags
from lightning_blockwise.cli.commands import EXPORT_COMMAND

#: ``--merge``'s choices and ``--max-shard-size``'s default: `export.merge`'s ``MERGE_CHOICES`` and
#: ``DEFAULT_MAX_SHARD_SIZE``, written here so that ``export --help`` imports no torch (tests/cli/test_startup.py checks
#: that they agree).
MERGE_CHOICES = ("none", "bf16", "fp32", "nf4")
DEFAULT_MAX_SHARD_SIZE = "5GB"


def export_command(args: list[str] | None = None) -> Path:
    """``lightning-blockwise export``: write the adapter, or the model with it merged in, and print where.

    Args:
        args: The arguments after ``export``; ``None`` reads ``sys.argv[2:]``.

    Returns:
        The directory written.

    Raises:
        SystemExit: With a one-line message starting ``lightning-blockwise export:`` for a bad argument, or an
            adapter, base or target that cannot be used (checked before any weight is read).
    """
    options = _export_parser().parse_args(sys.argv[2:] if args is None else args)
    # Once the arguments parse (NOTE [ The command starts without Lightning ] in cli/__init__.py).
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_blockwise.export.merge import export

    try:
        written = export(
            options.adapter,
            options.base,
            options.out,
            merge=options.merge,
            merge_into_original=options.merge_into_original,
            device=options.device,
            compute_dtype=options.compute_dtype,
            quantize=options.quantize,
            allow_other_base=options.allow_other_base,
            max_shard_size=options.max_shard_size,
            overwrite=options.overwrite,
            progress=not options.quiet,
            # Before the merge's first weight: the compute dtype it quantizes the base in, and whence.
            report=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except MisconfigurationException as error:
        # The library's messages already name the command.
        raise SystemExit(str(error)) from None
    print(f"lightning-blockwise export: wrote {written}")
    return written


class _ExportParser(argparse.ArgumentParser):
    """argparse, its errors on one line like the other errors of ``export``."""

    @override
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"{self.prog}: {message}")


def _export_parser() -> argparse.ArgumentParser:
    parser = _ExportParser(
        prog=f"lightning-blockwise {EXPORT_COMMAND}",
        description="Write a trained LoRA adapter as a PEFT directory, or merged into its base as a model that"
        " `AutoModelForCausalLM.from_pretrained` loads. The merge reads the base one tensor at a time: each NF4"
        " weight is quantized as training quantized it, dequantized and given the adapter's delta on --device, so"
        " neither host nor device memory ever holds the model. The output appears at once, or not at all.",
    )
    parser.add_argument(
        "adapter", type=Path, help="A PEFT adapter directory, or a .ckpt saved by a CausalLMFineTune run."
    )
    parser.add_argument("base", type=Path, help="The local checkpoint directory the adapter was trained on.")
    parser.add_argument(
        "out",
        type=Path,
        help="The directory to write: not an input, nor one that holds or lies inside one; refused if it holds"
        " files (see --overwrite).",
    )
    parser.add_argument(
        "--merge",
        choices=MERGE_CHOICES,
        default="none",
        help="none: the PEFT adapter alone. bf16, fp32: a dense model holding dequant(NF4) + delta, the function"
        " trained, in that dtype. nf4: dequant(NF4) + delta re-quantized to NF4, byte for byte what PEFT's"
        " merge_and_unload gives on the NF4 base; unadapted weights keep their training NF4 (default: none).",
    )
    parser.add_argument(
        "--merge-into-original",
        action="store_true",
        help="Add the delta to the checkpoint's original weights instead of dequant(NF4): NOT the model that was"
        " trained (it differs by the NF4 error of every linear); config.json and README.md say so.",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="Where to quantize, dequantize and add: cpu or cuda[:N]. Use the device training loaded the base on:"
        " NF4 bytes from the CPU and a GPU can differ (default: cpu).",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="The compute_dtype training loaded the base in, which decides its NF4 bytes (default: the one the"
        " adapter records, a .ckpt's or an adapter directory's lightning_blockwise.json; else bfloat16, with a"
        " warning). One that differs from the record warns: the merge is then not the model trained.",
    )
    add_base_flags(parser, "Merge into")
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"The cap on each safetensors shard, e.g. 5GB or 500MiB (default: {DEFAULT_MAX_SHARD_SIZE}).",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a previous export at OUT (atomically): an adapter, or a merged model; never other files.",
    )
    parser.add_argument("--quiet", action="store_true", help="No progress bar.")
    return parser


__all__ = ["EXPORT_COMMAND", "export_command"]
