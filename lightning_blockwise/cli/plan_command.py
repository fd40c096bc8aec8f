"""``lightning-blockwise plan``: a run's block bytes, host RAM and predicted VRAM, from a checkpoint's config alone.

No weights are read: the sizes come from :mod:`lightning_blockwise.planning.sizing`. The
command is handled before LightningCLI parses (LightningCLI knows only the Trainer's
subcommands), by :func:`~lightning_blockwise.cli.main`.

Example::

    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 2048 --gpu-memory 24GiB --json
    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 16384 --gpu-memory 24GiB --offload-activations auto
    lightning-blockwise plan /models/Qwen2.5-72B --seq-len 32768 --loss-chunk-tokens 1024 --mlp-tile-tokens 4096
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

from lightning_blockwise.loss import DEFAULT_CHUNK_TOKENS
from lightning_blockwise.planning import format_gb, parse_bytes
from lightning_blockwise.planning.sizing import (
    CUDA_CONTEXT_RESERVE,
    RECOMMENDED_MLP_TILE_TOKENS,
    Recommendation,
    model_sizes,
    recommend,
)

#: The subcommand handled before LightningCLI parses (LightningCLI knows only the Trainer's).
PLAN_COMMAND = "plan"
#: ``--offload-activations``: the strategy's ``offload_activations`` for each choice.
_OFFLOAD_CHOICES = {"auto": None, "on": True, "off": False}


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
            offload_activations=_OFFLOAD_CHOICES[options.offload_activations],
            loss_chunk_tokens=options.loss_chunk_tokens,
            mlp_tile_tokens=options.mlp_tile_tokens,
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
    offload_activations: bool | None = None,
    loss_chunk_tokens: int | None = None,
    mlp_tile_tokens: int | None = None,
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
        gpu_memory: A card's memory, in bytes, to recommend a budget, block size, offload, loss and MLP tiling for.
            Without a ``vram_budget``, automatic offload also plans for it (as the strategy does for the card it runs
            on).
        offload_activations: The strategy's ``offload_activations``: ``None`` turns offload on when the step does
            not fit (the budget, else the card) without it.
        loss_chunk_tokens: Rows of logits the module's loss builds at a time
            (:func:`~lightning_blockwise.loss.chunked_causal_lm_loss`); ``None``: Hugging Face's loss.
        mlp_tile_tokens: Tokens per tile of the module's tiled MLPs (:func:`~lightning_blockwise.tiling.tile_mlps`);
            ``None``: untiled.

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
    # Without a budget, the strategy decides automatic offload against the card it runs on (`device_limit`).
    card_limit = None if gpu_memory is None else gpu_memory - CUDA_CONTEXT_RESERVE
    step_budget = sizes.step_budget(
        block_size,
        prefetch_depth,
        vram_budget,
        offload_activations,
        loss_chunk_tokens,
        mlp_tile_tokens,
        device_limit=card_limit,
    )
    try:
        step = step_budget.plan(tokens)
    except ValueError as error:
        raise MisconfigurationException(
            f"--vram-budget: {error}{_smaller_step_hint(loss_chunk_tokens, mlp_tile_tokens)}"
        ) from None
    offload_host_bytes = step.offload_host_bytes
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
        **_plan_fields(step.residency),
        "offload_activations_option": _option_name(offload_activations),
        "offload_activations": step.offload,
        "loss_chunk_tokens": loss_chunk_tokens,
        "mlp_tile_tokens": mlp_tile_tokens,
        "offload_host_bytes": offload_host_bytes,
        "host_pinned_bytes": sizes.host_bytes(block_size) + offload_host_bytes,
    }
    if gpu_memory is not None:
        advice = recommend(
            sizes, gpu_memory, tokens, prefetch_depth, offload_activations, loss_chunk_tokens, mlp_tile_tokens
        )
        report["recommendation"] = _recommendation_fields(advice, sizes.host_bytes(advice.block_size))
    return report


def _smaller_step_hint(loss_chunk_tokens: int | None, mlp_tile_tokens: int | None) -> str:
    """Where a budget is too small: the module's options that would make the step smaller, not given yet."""
    if loss_chunk_tokens is None:
        return (
            f" Or plan for the chunked loss (--loss-chunk-tokens {DEFAULT_CHUNK_TOKENS}), which never holds every"
            " token's logits."
        )
    if mlp_tile_tokens is None:
        return (
            f" Or plan for tiled MLPs (--mlp-tile-tokens {RECOMMENDED_MLP_TILE_TOKENS}), which run each layer's MLP"
            " a tile of tokens at a time."
        )
    return ""


def _option_name(offload_activations: bool | None) -> str:
    return next(name for name, value in _OFFLOAD_CHOICES.items() if value is offload_activations)


def _recommendation_fields(advice: Recommendation, host_arena_bytes: int) -> dict[str, Any]:
    """The ``recommendation`` of the report, with the settings to copy into a config."""
    budget_text = f"{advice.budget / 2**30:.1f}GiB"
    strategy = {"vram_budget": budget_text, "block_size": advice.block_size}
    if advice.offload_activations:
        strategy["offload_activations"] = True
    module_options = {"loss_chunk_tokens": advice.loss_chunk_tokens, "mlp_tile_tokens": advice.mlp_tile_tokens}
    model = {name: value for name, value in module_options.items() if value is not None}
    return {
        "gpu_memory": advice.gpu_memory,
        "fits": advice.plan is not None,
        "vram_budget": advice.budget,
        "vram_budget_text": budget_text,
        "block_size": advice.block_size,
        "minimum_bytes": advice.minimum,
        **(_plan_fields(advice.plan) if advice.plan is not None else {}),
        "offload_activations": advice.offload_activations,
        "loss_chunk_tokens": advice.loss_chunk_tokens,
        "mlp_tile_tokens": advice.mlp_tile_tokens,
        "offload_host_bytes": advice.offload_host_bytes,
        "host_pinned_bytes": host_arena_bytes + advice.offload_host_bytes,
        # `trainer.strategy.init_args` and `model.init_args` of a config (configs/*.yaml).
        "strategy_settings": strategy,
        "model_settings": model,
    }


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
        help="A card's memory, e.g. 24GiB: recommend budget, block size, offload, loss and MLP tiling (default: none).",
    )
    parser.add_argument(
        "--offload-activations",
        choices=list(_OFFLOAD_CHOICES),
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
        ("layer inputs", _inputs_text(report)),
        ("loss", _loss_text(report["loss_chunk_tokens"], report["tokens"])),
        ("MLP", _mlp_text(report["mlp_tile_tokens"], report["tokens"])),
        ("host RAM, pinned arena", format_gb(report["host_arena_bytes"])),
        ("host RAM, offloaded layer inputs", format_gb(report["offload_host_bytes"]) + " pinned"),
        ("host RAM, pinned in all", format_gb(report["host_pinned_bytes"])),
        ("host RAM, embedding table", format_gb(report["host_embedding_bytes"]) + " (not pinned)"),
        ("VRAM, frozen head/norms/tables", format_gb(report["device_frozen_bytes"])),
        ("VRAM, adapters (x4 with grads and AdamW)", format_gb(report["adapter_bytes"])),
        (
            "VRAM, predicted peak",
            f"{format_gb(report['predicted_peak_bytes'])} ({report['resident_blocks']} blocks resident,"
            f" {report['num_slots']} slots of {report['slot_bytes'] / 1e6:.1f} MB){_over_the_card(report)}",
        ),
        ("smallest vram_budget", format_gb(report["minimum_bytes"])),
    ]
    advice = report.get("recommendation")
    if advice is not None:
        rows.extend(_recommendation_rows(advice, report))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        width = max(len(name) for name, _ in rows)
        print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
        return
    table = Table(title="lightning-blockwise plan (predicted, NF4 + double quant)")
    table.add_column("quantity")
    table.add_column("value", overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _over_the_card(report: dict[str, Any]) -> str:
    """A warning where the step as given does not fit the ``--gpu-memory`` card (its recommendation says what does)."""
    advice = report.get("recommendation")
    if advice is None or report["vram_budget"] is not None:
        return ""
    usable = advice["gpu_memory"] - CUDA_CONTEXT_RESERVE
    if report["predicted_peak_bytes"] <= usable:
        return ""
    return f"; more than the {format_gb(usable)} the card leaves, see its recommendation below"


def _inputs_text(report: dict[str, Any]) -> str:
    option = report["offload_activations_option"]
    if not report["offload_activations"]:
        return f"kept on the device until the backward (offload_activations: {option})"
    if option == "on":
        return "offloaded to pinned host memory (offload_activations: on)"
    return "offloaded to pinned host memory (offload_activations: auto; the step does not fit without)"


def _loss_text(loss_chunk_tokens: int | None, tokens: int) -> str:
    if loss_chunk_tokens is None:
        return f"Hugging Face's: the logits of all {tokens} tokens at once"
    return f"chunked: {loss_chunk_tokens} rows of logits at a time"


def _mlp_text(mlp_tile_tokens: int | None, tokens: int) -> str:
    if mlp_tile_tokens is None:
        return f"untiled: each layer's MLP on all {tokens} tokens at once"
    return f"tiled: each layer's MLP on {mlp_tile_tokens} tokens at a time"


def _recommendation_rows(advice: dict[str, Any], report: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of a card's recommendation: settings to copy, what they predict, what they cost on the host."""
    card = f"on a {advice['gpu_memory'] / 2**30:g} GiB card"
    chunk = advice["loss_chunk_tokens"]
    tile = advice["mlp_tile_tokens"]
    if not advice["fits"]:
        tried = [
            "offload_activations: true" if advice["offload_activations"] else "",
            "" if chunk is None else f"a loss of {chunk}-row chunks",
            "" if tile is None else f"MLPs tiled by {tile} tokens",
        ]
        even = _and(list(filter(None, tried)))
        return [
            (
                card,
                f"does not fit{f' even with {even}' if even else ''}: needs a budget of"
                f" {format_gb(advice['minimum_bytes'])}, the card allows {format_gb(advice['vram_budget'])};"
                " shorten --seq-len or --batch-size, or lower --prefetch-depth",
            )
        ]
    settings = ", ".join(f"{name}: {_yaml(value)}" for name, value in advice["strategy_settings"].items())
    rows = [
        (
            card,
            f"{settings}: predicted peak {format_gb(advice['predicted_peak_bytes'])},"
            f" {advice['resident_blocks']} blocks resident",
        )
    ]
    if advice["offload_activations"]:
        rows.append(
            (
                f"{card}, host RAM",
                f"{format_gb(advice['host_pinned_bytes'])} pinned: the arena and"
                f" {format_gb(advice['offload_host_bytes'])} of offloaded layer inputs",
            )
        )
    if chunk is not None:
        # Said only where the recommendation chose the chunked loss, not where the user gave it.
        why = (
            f": Hugging Face's loss over all {report['tokens']} tokens does not fit"
            if report["loss_chunk_tokens"] is None
            else ""
        )
        rows.append(
            (
                f"{card}, loss",
                f"use chunked_causal_lm_loss(..., chunk_tokens={chunk}) / CausalLMFineTune(loss_chunk_tokens={chunk})"
                + why,
            )
        )
    if tile is not None:
        # Why, as for the loss, only where the recommendation chose the tiling: it is the last resort, it costs time.
        why = (
            ": nothing untiled fits; each MLP's forward runs again per tile (slower steps)"
            if report["mlp_tile_tokens"] is None
            else ""
        )
        rows.append(
            (
                f"{card}, MLP",
                f"use tile_mlps(model, {tile}) / CausalLMFineTune(mlp_tile_tokens={tile})" + why,
            )
        )
    return rows


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(items[:-1]), *items[-1:]]))


def _yaml(value: Any) -> str:
    """A setting as a YAML config spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)
