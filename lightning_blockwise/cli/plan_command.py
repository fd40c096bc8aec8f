"""``lightning-blockwise plan``: a run's block bytes, host RAM and predicted VRAM, from a checkpoint's config alone.

No weights are read: the sizes come from :mod:`lightning_blockwise.planning.sizing`. The
command is handled before LightningCLI parses (LightningCLI knows only the Trainer's
subcommands), by :func:`~lightning_blockwise.cli.main`.

Example::

    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 2048 --gpu-memory 24GiB --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_blockwise.planning import format_gb, parse_bytes
from lightning_blockwise.planning.sizing import model_sizes, recommend

#: The subcommand handled before LightningCLI parses (LightningCLI knows only the Trainer's).
PLAN_COMMAND = "plan"


def plan(args: list[str] | None = None) -> dict[str, Any]:
    """``lightning-blockwise plan``: print a model's block bytes, host RAM and predicted VRAM, from its config alone.

    Args:
        args: The arguments after ``plan``; ``None`` reads ``sys.argv[2:]``.

    Returns:
        The report that ``--json`` prints (sizes in bytes).

    Raises:
        SystemExit: With a one-line message starting ``lightning-blockwise plan:`` for a bad argument (checked
            before the config is read), a checkpoint that does not exist, or a plan that cannot work.
    """
    options = _plan_parser().parse_args(sys.argv[2:] if args is None else args)
    try:
        report = plan_report(
            _load_config(options.checkpoint),
            tokens=options.seq_len * options.batch_size,
            lora_rank=options.lora_rank,
            targets=options.targets,
            dora=options.dora,
            dtype=options.dtype,
            block_size=options.block_size,
            prefetch_depth=options.prefetch_depth,
            vram_budget=options.vram_budget,
            gpu_memory=options.gpu_memory,
        )
    except MisconfigurationException as error:
        raise SystemExit(f"lightning-blockwise plan: {error}") from None
    if options.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return report


def plan_report(
    config: Any,
    tokens: int,
    lora_rank: int = 16,
    targets: list[str] | None = None,
    dora: bool = False,
    dtype: str | None = None,
    block_size: int = 1,
    prefetch_depth: int = 2,
    vram_budget: int | None = None,
    gpu_memory: int | None = None,
) -> dict[str, Any]:
    """The numbers ``plan`` prints, for a model config (see :mod:`lightning_blockwise.planning.sizing`).

    Args:
        config: The model's ``PretrainedConfig``.
        tokens: Tokens per micro-batch (batch size x sequence length).
        lora_rank: LoRA rank.
        targets: Linears with adapters; ``None``: every linear of the decoder layers.
        dora: DoRA instead of LoRA.
        dtype: Dtype of the unquantized tensors (``"bfloat16"``, ...); ``None``: the config's.
        block_size: Decoder layers per block.
        prefetch_depth: Blocks copied ahead of the one in use.
        vram_budget: The ``vram_budget`` to plan for, in bytes.
        gpu_memory: A card's memory, in bytes, to recommend a budget and block size for.

    Raises:
        MisconfigurationException: If ``targets`` names a linear the decoder layers do not have, ``block_size`` is
            out of range or ``vram_budget`` below the minimum.
    """
    try:
        sizes = model_sizes(
            config,
            dtype=None if dtype is None else getattr(torch, dtype),
            lora_rank=lora_rank,
            targets=targets,
            dora=dora,
        )
    except ValueError as error:
        # How `model_sizes` refuses targets the layers lack, and transformers a config it cannot build: the
        # message stands alone.
        raise MisconfigurationException(str(error)) from None
    if block_size > sizes.num_layers:
        raise MisconfigurationException(
            f"--block-size {block_size} is more than the {sizes.num_layers} decoder layers of this"
            f" {sizes.model_type} model; pick 1 to {sizes.num_layers}."
        )
    try:
        residency = sizes.residency(tokens, block_size, prefetch_depth, vram_budget)
    except ValueError as error:
        raise MisconfigurationException(f"--vram-budget: {error}") from None
    report: dict[str, Any] = {
        "model_type": sizes.model_type,
        "num_layers": sizes.num_layers,
        "tokens": tokens,
        "block_size": block_size,
        "prefetch_depth": prefetch_depth,
        "block_bytes": sizes.block_bytes(block_size),
        "host_arena_bytes": sizes.host_bytes(block_size),
        "host_embedding_bytes": sizes.host_embedding_bytes,
        "device_frozen_bytes": sizes.device_bytes,
        "adapter_bytes": sizes.trainable_bytes,
        "vram_budget": vram_budget,
        **_plan_fields(residency),
    }
    if gpu_memory is not None:
        advice = recommend(sizes, gpu_memory, tokens, prefetch_depth)
        report["recommendation"] = {
            "gpu_memory": gpu_memory,
            "fits": advice.plan is not None,
            "vram_budget": advice.budget,
            "vram_budget_text": f"{advice.budget / 2**30:.1f}GiB",
            "block_size": advice.block_size,
            "minimum_bytes": advice.minimum,
            **(_plan_fields(advice.plan) if advice.plan is not None else {}),
        }
    return report


def _plan_fields(residency: Any) -> dict[str, Any]:
    return {
        "predicted_peak_bytes": residency.predicted_peak,
        "minimum_bytes": residency.minimum,
        "resident_blocks": len(residency.resident),
        "num_slots": residency.num_slots,
        "slot_bytes": residency.slot_bytes,
    }


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


def _plan_parser() -> argparse.ArgumentParser:
    parser = _PlanParser(
        prog=f"lightning-blockwise {PLAN_COMMAND}",
        description="Predict a blockwise run's host RAM and training-step VRAM peak from a checkpoint's config"
        " (no weights are read): the frozen base as bitsandbytes NF4 with double quantization, fp32 LoRA adapters"
        " with their gradients and AdamW state, under bf16 autocast. The peak is torch's max allocated memory; the"
        " CUDA context and the caching allocator need more on the card.",
    )
    parser.add_argument("checkpoint", type=Path, help="A checkpoint directory, or the path of its config.json.")
    parser.add_argument("--seq-len", type=_positive_int, default=2048, help="Tokens per sequence (default: 2048).")
    parser.add_argument("--batch-size", type=_positive_int, default=1, help="Sequences per micro-batch (default: 1).")
    parser.add_argument("--lora-rank", type=_positive_int, default=16, help="LoRA rank r (default: 16).")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=None,
        help="Linears with adapters (default: every linear of the decoder layers).",
    )
    parser.add_argument("--dora", action="store_true", help="DoRA adapters (adds a magnitude vector per linear).")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default=None,
        help="Dtype of the unquantized tensors: norms, biases, LM head (default: the config's, else bfloat16).",
    )
    parser.add_argument("--block-size", type=_positive_int, default=1, help="Decoder layers per block (default: 1).")
    parser.add_argument("--prefetch-depth", type=_positive_int, default=2, help="Blocks copied ahead (default: 2).")
    parser.add_argument(
        "--vram-budget", type=_memory_size, default=None, help="The strategy's vram_budget, e.g. 16GiB (default: none)."
    )
    parser.add_argument(
        "--gpu-memory",
        type=_memory_size,
        default=None,
        help="A card's memory, e.g. 24GiB: recommend budget and block size.",
    )
    parser.add_argument("--json", action="store_true", help="Print the report as JSON (sizes in bytes).")
    return parser


def _load_config(path: Path) -> Any:
    """A checkpoint's config, from its directory or its ``config.json``, never from the network."""
    from transformers import AutoConfig

    if not path.exists():
        raise SystemExit(
            f"lightning-blockwise plan: {path} does not exist. Give a local checkpoint directory or its config.json."
        )
    return AutoConfig.from_pretrained(path, local_files_only=True)


def _print_report(report: dict[str, Any]) -> None:
    """The report as tables (rich's when installed)."""
    sizes = report["block_bytes"]
    distinct = sorted(set(sizes), reverse=True)
    blocks = ", ".join(f"{sizes.count(n)} x {n / 1e6:.1f} MB" for n in distinct)
    rows = [
        ("model", f"{report['model_type']}, {report['num_layers']} decoder layers"),
        ("step", f"{report['tokens']} tokens per micro-batch"),
        ("blocks", f"{len(sizes)} of {report['block_size']} layers: {blocks} ({sizes[0]:,} bytes each)"),
        ("host RAM, pinned arena", format_gb(report["host_arena_bytes"])),
        ("host RAM, embedding table", format_gb(report["host_embedding_bytes"])),
        ("VRAM, frozen head/norms/tables", format_gb(report["device_frozen_bytes"])),
        ("VRAM, adapters (x4 with grads and AdamW)", format_gb(report["adapter_bytes"])),
        (
            "VRAM, predicted peak",
            f"{format_gb(report['predicted_peak_bytes'])} ({report['resident_blocks']} blocks resident,"
            f" {report['num_slots']} slots of {report['slot_bytes'] / 1e6:.1f} MB)",
        ),
        ("smallest vram_budget", format_gb(report["minimum_bytes"])),
    ]
    advice = report.get("recommendation")
    if advice is not None:
        card = f"{advice['gpu_memory'] / 2**30:g} GiB"
        if advice["fits"]:
            rows.append(
                (
                    f"on a {card} card",
                    f"vram_budget: {advice['vram_budget_text']}, block_size: {advice['block_size']}:"
                    f" predicted peak {format_gb(advice['predicted_peak_bytes'])},"
                    f" {advice['resident_blocks']} blocks resident",
                )
            )
        else:
            rows.append(
                (
                    f"on a {card} card",
                    f"does not fit: needs a budget of {format_gb(advice['minimum_bytes'])}, the card allows"
                    f" {format_gb(advice['vram_budget'])}; shorten --seq-len or --batch-size,"
                    " or lower --prefetch-depth",
                )
            )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(name) for name, _ in rows)
        print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
        return
    table = Table(title="lightning-blockwise plan (predicted, NF4 + double quant)")
    table.add_column("quantity")
    table.add_column("value")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
