"""The arguments of ``lightning-blockwise plan``: their parser, types and help; errors on one line.

:mod:`lightning_blockwise.cli.plan_command` runs the command with what this parses.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from typing_extensions import override

from lightning_blockwise.cli.commands import PLAN_COMMAND
from lightning_blockwise.cli.plan_kernels import KERNEL_CHOICES
from lightning_blockwise.planning import card_bytes, parse_bytes
from lightning_blockwise.planning.longest import DEFAULT_LINK_GBPS, DEFAULT_TFLOPS
from lightning_blockwise.planning.shapes import DOCUMENTED_SHAPES

#: ``--table``'s lengths, in tokens (4k to 512k).
TABLE_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288)
#: ``--table``'s cards, in GiB.
TABLE_CARDS_GIB = (16, 24, 48, 80)
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


def _memory_size(text: str, parse: Callable[[str], int] = parse_bytes) -> int:
    """An argparse ``type``: a positive memory size such as ``16GiB``, in bytes (read by ``parse``)."""
    try:
        return parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _card_size(text: str) -> int:
    """An argparse ``type``: a card's memory, ``24GB`` or ``24GiB`` alike (``card_bytes``), larger than its context."""
    from lightning_blockwise.planning.recommend import check_card  # imports torch: not for `plan --help`

    size = _memory_size(text, card_bytes)
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
    parser.add_argument(
        "checkpoint",
        type=Path,
        nargs="?",
        default=None,
        help="A checkpoint directory, or the path of its config.json (or --shape instead).",
    )
    parser.add_argument(
        "--shape",
        choices=list(DOCUMENTED_SHAPES),
        default=None,
        help="Plan for a documented shape instead of a checkpoint: the Qwen2.5 7B, 32B or 72B config (the shapes"
        " benchmarks/RESULTS.md measures).",
    )
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
        "--vram-budget",
        type=_memory_size,
        default=None,
        help="A vram_budget to plan for, e.g. 16GiB (default: none; the strategy's own default, 'card', is the"
        " card's free memory at setup: see --gpu-memory).",
    )
    parser.add_argument(
        "--gpu-memory",
        "--card",
        dest="gpu_memory",
        type=_card_size,
        default=None,
        help="A card's memory, e.g. 24GiB: recommend budget, block size, offload, loss and MLP tiling (default: none)."
        " --card is the same option.",
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
        "--attention-tile-tokens",
        type=_positive_int,
        default=None,
        help="Queries per tile of the decoder layers' attention (tile_attention, a module's attention_tile_tokens;"
        " default: none, attention on all tokens at once).",
    )
    parser.add_argument(
        "--masked-attention",
        action="store_true",
        help="The rows are padded or packed (an attention_mask with padding, or position_ids that restart), so"
        " attention runs with a mask over rows of --seq-len tokens: every layer that keeps its graph holds an additive"
        " copy of it and the keys and values repeated to every head (the strategy counts them from the first such"
        " batch). Default: causal rows without padding.",
    )
    parser.add_argument(
        "--kernels",
        choices=list(KERNEL_CHOICES),
        default="auto",
        help="The layers to plan for: liger, Liger-Kernel's RMSNorm and RoPE (and its SwiGLU where the MLPs are"
        " untiled), which keep no fp32 copies of the norms' inputs; none, the model's own. auto: what"
        " CausalLMFineTune(kernels='auto') takes on a CUDA card, liger where Liger-Kernel is installed on this"
        " machine, else none (default: auto). Architectures Liger does not know get their own.",
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
    _longest_arguments(parser)
    parser.add_argument("--json", action="store_true", help="Print the report as JSON (sizes in bytes).")
    return parser


def _longest_arguments(parser: argparse.ArgumentParser) -> None:
    """``--longest`` and ``--table``: the longest context a card and a host train, and the grid of lengths x cards."""
    parser.add_argument(
        "--longest",
        action="store_true",
        help="Answer the longest context (tokens, batch 1, a multiple of 1024) that trains on --card with --host-ram,"
        " what stops a longer one, its expected step time, and the settings to copy.",
    )
    parser.add_argument(
        "--table",
        action="store_true",
        help="Print a markdown table of lengths (--lengths) x cards (--cards): the expected step time where it fits,"
        " else the memory that binds (card, host, pinned); and each card's longest context.",
    )
    parser.add_argument(
        "--host-ram",
        type=_memory_size,
        default=None,
        help="The host's RAM for --longest and --table, e.g. 128GB (default: this machine's).",
    )
    parser.add_argument(
        "--pinned-limit",
        type=_memory_size,
        default=None,
        help="The most host memory that may be page-locked (a container's or `ulimit -l`'s limit; default: none).",
    )
    parser.add_argument(
        "--tflops",
        type=_positive_float,
        default=DEFAULT_TFLOPS,
        help="The card's sustained bf16 matmul rate in TFLOP/s, for the expected step time (default:"
        f" {DEFAULT_TFLOPS:g}, a 24 GB RTX 4090-class card; an H100 ran 32k-131k-token steps at an effective"
        " 420-470). Compute: (6 x matmul weights x tokens + 9 x tokens^2 x attention width x layers) / rate, 11 with"
        " --attention-tile-tokens (each tile's forward runs again); the step time is the larger of that and the host"
        " link's copies.",
    )
    parser.add_argument(
        "--link-gbps",
        type=_positive_float,
        default=DEFAULT_LINK_GBPS,
        help=f"The host link's rate in GB/s (default: {DEFAULT_LINK_GBPS:g}, PCIe 4.0 x16; an H100's PCIe 5 link"
        " measured 54.5). Copies: the streamed blocks twice per step (three times with --recompute-every) and the"
        " offloaded layer inputs out and back. With --devices N, each GPU's share of its host's link.",
    )
    parser.add_argument(
        "--recompute-every",
        type=_positive_int,
        default=None,
        metavar="K",
        help="Plan for a second-level recompute that keeps every K-th layer's input (host bytes of the inputs / K,"
        " K - 1 inputs more on the card, a third weight pass and forward per step; default: off).",
    )
    parser.add_argument(
        "--lengths",
        type=_positive_int,
        nargs="+",
        default=list(TABLE_LENGTHS),
        help="--table's lengths in tokens (default: 4k to 512k).",
    )
    parser.add_argument(
        "--cards",
        type=_positive_int,
        nargs="+",
        default=list(TABLE_CARDS_GIB),
        metavar="GIB",
        help="--table's cards in GiB (default: 16 24 48 80).",
    )


def _positive_float(text: str) -> float:
    """An argparse ``type``: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give one above 0.") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number above 0.")
    return value


__all__ = ["OFFLOAD_CHOICES", "PLAN_COMMAND", "plan_parser"]
