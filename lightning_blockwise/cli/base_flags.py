"""The flags that override an adapter's training record (NF4 or dense base, another base): `export` and `generate`."""

from __future__ import annotations

import argparse


def add_base_flags(parser: argparse.ArgumentParser, act: str) -> None:
    """Add ``--dense-base`` / ``--nf4-base`` (``quantize``: False, True, None for the record), ``--allow-other-base``.

    Args:
        parser: The command's parser.
        act: What the command does with the base, as a verb phrase: ``"Merge into"``, ``"Load"``.
    """
    formats = parser.add_mutually_exclusive_group()
    default = "default: the format the adapter or .ckpt records, else NF4; one that differs from the record warns"
    formats.add_argument(
        "--dense-base",
        dest="quantize",
        action="store_const",
        const=False,
        help=f"{act} the dense base (the checkpoint's weights in the compute dtype), as"
        f" `CausalLMFineTune(quantize=False)` trained ({default}).",
    )
    formats.add_argument(
        "--nf4-base",
        dest="quantize",
        action="store_const",
        const=True,
        help=f"{act} the NF4-quantized base, as `CausalLMFineTune()` trains by default ({default}).",
    )
    parser.add_argument(
        "--allow-other-base",
        action="store_true",
        help="Go on over a base whose config or weights differ from the one the adapter or .ckpt records, with a"
        " warning (default: refused: the result would not be the model trained).",
    )


__all__ = ["add_base_flags"]
