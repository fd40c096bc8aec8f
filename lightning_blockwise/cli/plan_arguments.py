"""The arguments of ``lightning-blockwise plan``: their parser, types and help; errors on one line.

:mod:`lightning_blockwise.cli.plan_command` runs the command with what this parses.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NoReturn

from typing_extensions import override

from lightning_blockwise.planning import parse_bytes
from lightning_blockwise.planning.recommend import check_card

#: The subcommand handled before LightningCLI parses (LightningCLI knows only the Trainer's).
PLAN_COMMAND = "plan"
#: ``--offload-activations``: the strategy's ``offload_activations`` for each choice.
OFFLOAD_CHOICES = {"auto": None, "on": True, "off": False}


class _PlanParser(argparse.ArgumentParser):
    """argparse, its errors on one line like the other errors of ``plan``."""

    @override
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one of at least 1.") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1.")
    return value


def _memory_size(text: str) -> int:
    """An argparse ``type``: a positive memory size such as ``16GiB``, in bytes."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _card_size(text: str) -> int:
    """An argparse ``type``: a card's memory such as ``24GiB``, in bytes, larger than the CUDA context takes."""
    size = _memory_size(text)
    try:
        check_card(size)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
    return size


def plan_parser() -> argparse.ArgumentParser:
    """The parser of ``lightning-blockwise plan``'s arguments; its errors exit with one line."""
    parser = _PlanParser(
        prog=f"lightning-blockwise {PLAN_COMMAND}",
        description="Predict a blockwise run's host RAM and training-step VRAM peak from a checkpoint's config"
        " (no weights are read): the frozen base as bitsandbytes NF4 with double quantization (or dense with"
        " --dense), fp32 LoRA adapters"
        " with their gradients and AdamW state, under bf16 autocast. The peak is torch's max allocated memory; the"
        " CUDA context and the caching allocator need more on the card.",
    )
    parser.add_argument("checkpoint", type=Path, help="A checkpoint directory, or the path of its config.json.")
    parser.add_argument("--seq-len", type=_positive_int, default=2048, help="Tokens per sequence (default: 2048).")
    parser.add_argument("--batch-size", type=_positive_int, default=1, help="Sequences per micro-batch (default: 1).")
    # The spelling of `CausalLMFineTune(lora_r=...)` and the configs' `lora_r`; `--lora-rank`, the first spelling,
    # stays an alias so existing commands keep working.
    parser.add_argument(
        "--lora-r",
        "--lora-rank",
        dest="lora_r",
        type=_positive_int,
        default=16,
        help="LoRA rank r, the configs' lora_r (default: 16). --lora-rank is the same option.",
    )
    parser.add_argument(
        "--targets",
        nargs="+",
        default=None,
        help="Linears with adapters (default: every linear of the decoder layers).",
    )
    parser.add_argument("--dora", action="store_true", help="DoRA adapters (adds a magnitude vector per linear).")
    parser.add_argument(
        "--dense",
        action="store_true",
        help="A dense base: no tensor quantized, all in --dtype (load_blockwise(quantize=False), the module's"
        " quantize: false; about 3.6x the host bytes of NF4). Default: NF4, tensors bitsandbytes does not quantize"
        " (norms, fused MoE experts) in --dtype.",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="Dtype of the unquantized tensors: norms, biases, LM head, every tensor with --dense (default: the"
        " config's, else bfloat16).",
    )
    parser.add_argument("--block-size", type=_positive_int, default=1, help="Decoder layers per block (default: 1).")
    parser.add_argument("--prefetch-depth", type=_positive_int, default=2, help="Blocks copied ahead (default: 2).")
    parser.add_argument(
        "--vram-budget", type=_memory_size, default=None, help="The strategy's vram_budget, e.g. 16GiB (default: none)."
    )
    parser.add_argument(
        "--gpu-memory",
        type=_card_size,
        default=None,
        help="A card's memory, e.g. 24GiB: recommend budget, block size, offload, loss and MLP tiling (default: none).",
    )
    parser.add_argument(
        "--offload-activations",
        choices=list(OFFLOAD_CHOICES),
        default="auto",
        help="The strategy's offload_activations: layer inputs wait for the backward in pinned host memory. auto"
        " turns it on when the step does not fit --vram-budget, else --gpu-memory, without it (default: auto).",
    )
    parser.add_argument(
        "--loss-chunk-tokens",
        type=_positive_int,
        default=None,
        help="Rows of logits the module's loss builds at a time (chunked_causal_lm_loss, a module's"
        " loss_chunk_tokens; default: none, Hugging Face's loss, all rows at once).",
    )
    parser.add_argument(
        "--mlp-tile-tokens",
        type=_positive_int,
        default=None,
        help="Tokens per tile of the decoder layers' MLPs (tile_mlps, a module's mlp_tile_tokens; default: none,"
        " each MLP on all tokens at once).",
    )
    parser.add_argument(
        "--block-major",
        type=_positive_int,
        default=None,
        metavar="G",
        help="Plan for block_major_accumulation=True with accumulate_grad_batches=G: G micro-batches' layer inputs"
        " are saved at once (default: off).",
    )
    parser.add_argument(
        "--devices",
        type=_positive_int,
        default=1,
        help="Data-parallel processes on this machine, one GPU each (default: 1). VRAM is per GPU; host RAM is the"
        " machine's: one shared arena, each rank's offloaded layer inputs and embedding table.",
    )
    parser.add_argument("--json", action="store_true", help="Print the report as JSON (sizes in bytes).")
    return parser


__all__ = ["OFFLOAD_CHOICES", "PLAN_COMMAND", "plan_parser"]
