"""``lightning-blockwise plan``'s output: the report's fields for ``--json``, and the tables printed without it.

:mod:`~lightning_blockwise.cli.plan_arguments` parses the arguments, :mod:`~lightning_blockwise.cli.plan_command`
computes the numbers; this module only lays them out.
"""

from __future__ import annotations

from typing import Any

from lightning_blockwise.cli.plan_nodes import nodes_rows
from lightning_blockwise.planning.recommend import CUDA_CONTEXT_RESERVE, Recommendation
from lightning_blockwise.planning.units import format_card, format_gb


def kernels_setting(advice: Recommendation) -> str | None:
    """``CausalLMFineTune``'s ``kernels`` to set for a plan: ``"liger"`` where it counts Liger's RMSNorm, else ``None``.

    A run without Liger's kernels needs more memory than such a plan, and ``kernels="liger"`` refuses to start without
    Liger-Kernel where ``"auto"`` would go on without it (NOTE [ The kernels plan counts ] in plan_kernels.py).
    """
    return "liger" if advice.fused_norm else None


def recommendation_fields(advice: Recommendation, host_arena_bytes: int, devices: int = 1) -> dict[str, Any]:
    """The ``recommendation`` of the report, with the settings to copy into a config (host RAM for ``devices``)."""
    budget_text = f"{advice.budget / 2**30:.1f}GiB"
    strategy = {"vram_budget": budget_text, "block_size": advice.block_size}
    if advice.offload_activations:
        strategy["offload_activations"] = True
    module_options = {
        "loss_chunk_tokens": advice.loss_chunk_tokens,
        "mlp_tile_tokens": advice.mlp_tile_tokens,
        "attention_tile_tokens": advice.attention_tile_tokens,
        "kernels": kernels_setting(advice),
    }
    model = {name: value for name, value in module_options.items() if value is not None}
    return {
        "gpu_memory": advice.gpu_memory,
        "fits": advice.plan is not None,
        "vram_budget": advice.budget,
        "vram_budget_text": budget_text,
        "block_size": advice.block_size,
        "minimum_bytes": advice.minimum,
        **(plan_fields(advice.plan) if advice.plan is not None else {}),
        "offload_activations": advice.offload_activations,
        "loss_chunk_tokens": advice.loss_chunk_tokens,
        "mlp_tile_tokens": advice.mlp_tile_tokens,
        "attention_tile_tokens": advice.attention_tile_tokens,
        "fused_norm": advice.fused_norm,
        "fused_mlp": advice.fused_mlp,
        "offload_host_bytes": advice.offload_host_bytes * devices,
        "host_pinned_bytes": host_arena_bytes + advice.offload_host_bytes * devices,
        # `trainer.strategy.init_args` and `model.init_args` of a config (configs/*.yaml).
        "strategy_settings": strategy,
        "model_settings": model,
    }


def plan_fields(residency: Any) -> dict[str, Any]:
    """The report's fields of a residency plan: predicted peak, minimum budget, resident blocks, slots."""
    return {
        "predicted_peak_bytes": residency.predicted_peak,
        "predicted_reserved_bytes": residency.predicted_reserved,
        "minimum_bytes": residency.minimum,
        "resident_blocks": len(residency.resident),
        "kept_blocks": len(residency.kept),
        "attention_blocks": len(residency.attention),
        "num_slots": residency.num_slots,
        "slot_bytes": residency.slot_bytes,
    }


def _attention_kept(fields: dict[str, Any], end: str) -> str:
    """How many recomputed blocks keep their attention outputs (NOTE [ Kept attention ]), where any do."""
    blocks = fields.get("attention_blocks", 0)
    return f" {blocks} recomputed ones keeping their attention outputs{end}" if blocks else ""


def _window_text(block_major: int | None) -> str:
    if not block_major or block_major == 1:
        return ""
    return f", block-major windows of {block_major} (their layer inputs saved at once; nothing kept or offloaded)"


def print_report(report: dict[str, Any]) -> None:
    """The report as tables (rich's when installed)."""
    sizes = report["block_bytes"]
    distinct = sorted(set(sizes), reverse=True)
    blocks = ", ".join(f"{sizes.count(n)} x {n / 1e6:.1f} MB" for n in distinct)
    rows = [
        ("model", f"{report['model_type']}, {report['num_layers']} decoder layers"),
        ("base", "NF4 + double quant" if report.get("base", "nf4") == "nf4" else "dense, every tensor unquantized"),
        ("step", f"{report['tokens']} tokens per micro-batch{_window_text(report.get('block_major'))}"),
        ("devices", _devices_text(report)),
        *nodes_rows(report),
        ("blocks", f"{len(sizes)} of {report['block_size']} layers: {blocks} ({sizes[0]:,} bytes each)"),
        ("layer inputs", _inputs_text(report)),
        ("loss", _loss_text(report["loss_chunk_tokens"], report["tokens"])),
        ("MLP", _mlp_text(report["mlp_tile_tokens"], report["tokens"])),
        ("attention", _attention_text(report.get("attention_tile_tokens"), report["tokens"], report.get("masked_row"))),
        *_kernels_rows(report),
        ("host RAM, pinned arena", format_gb(report["host_arena_bytes"])),
        ("host RAM, offloaded layer inputs", format_gb(report["offload_host_bytes"]) + " pinned"),
        ("host RAM, pinned in all", format_gb(report["host_pinned_bytes"])),
        ("host RAM, embedding table", format_gb(report["host_embedding_bytes"]) + " (not pinned)"),
        ("VRAM, frozen head/norms/tables", format_gb(report["device_frozen_bytes"])),
        ("VRAM, adapters (x4 with grads and AdamW)", format_gb(report["adapter_bytes"])),
        *_bucket_rows(report),
        (
            "VRAM, predicted peak",
            f"{format_gb(report['predicted_peak_bytes'])} allocated ({report['resident_blocks']} blocks resident,"
            f" {report['kept_blocks']} of them keeping their activations,{_attention_kept(report, ',')}"
            f" {report['num_slots']} slots of {report['slot_bytes'] / 1e6:.1f} MB){_over_the_card(report)}",
        ),
        (
            "VRAM, with the allocator's headroom",
            f"{format_gb(report['predicted_reserved_bytes'])} (the budget it needs)",
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
    table = Table(title="lightning-blockwise plan (predicted)")
    table.add_column("quantity")
    table.add_column("value", overflow="fold")
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)


def _devices_text(report: dict[str, Any]) -> str:
    """Whose memory the figures are: one GPU's and the machine's host RAM."""
    devices = report.get("devices", 1)
    if devices == 1:
        return "1 GPU"
    return (
        f"{devices} GPUs, one data-parallel rank each: VRAM figures are per GPU; host RAM is the machine's (one"
        f" shared arena, {devices} ranks' offloaded inputs and embedding tables)"
    )


def _kernels_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """What the plan counts of Liger's kernels and why; none under ``--kernels none`` (the report before the option)."""
    if report.get("kernels_option", "none") == "none":
        return []
    return [("kernels", report["kernels_reason"])]


def _bucket_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """DDP's gradient buckets, on each GPU of a data-parallel run."""
    if not report.get("ddp_bucket_bytes"):
        return []
    return [("VRAM, DDP gradient buckets (per GPU)", format_gb(report["ddp_bucket_bytes"]))]


def _over_the_card(report: dict[str, Any]) -> str:
    """A warning where the step as given does not fit the ``--gpu-memory`` card (its recommendation says what does)."""
    advice = report.get("recommendation")
    if advice is None or report["vram_budget"] is not None:
        return ""
    usable = advice["gpu_memory"] - CUDA_CONTEXT_RESERVE
    if report["predicted_reserved_bytes"] <= usable:
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


def _attention_text(attention_tile_tokens: int | None, tokens: int, masked_row: int | None = None) -> str:
    if masked_row is not None:  # plan refuses it with tiled attention
        return f"with a mask over rows of {masked_row} tokens (padded or packed; --masked-attention)"
    if attention_tile_tokens is None or attention_tile_tokens >= tokens:
        return f"untiled: each layer's attention on all {tokens} queries at once"
    return f"tiled: each layer's attention on {attention_tile_tokens} queries at a time"


def _recommendation_rows(advice: dict[str, Any], report: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows of a card's recommendation: settings to copy, what they predict, what they cost on the host."""
    card = f"on a {advice['gpu_memory'] / 2**30:g} GiB card"
    # The first row names the size planned for in both units: `--card 24GB` and `24GiB` are the same card.
    sized = f"on a {format_card(advice['gpu_memory'])}"
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
                sized,
                f"does not fit{f' even with {even}' if even else ''}: needs a budget of"
                f" {format_gb(advice['minimum_bytes'])}, the card allows {format_gb(advice['vram_budget'])};"
                " shorten --seq-len or --batch-size, or lower --prefetch-depth",
            )
        ]
    settings = ", ".join(f"{name}: {_yaml(value)}" for name, value in advice["strategy_settings"].items())
    rows = [
        (
            sized,
            f"{settings}: predicted peak {format_gb(advice['predicted_peak_bytes'])} allocated"
            f" ({format_gb(advice['predicted_reserved_bytes'])} with the allocator's headroom),"
            f" {advice['resident_blocks']} blocks resident, {advice['kept_blocks']} keeping their activations"
            + _attention_kept(advice, "").replace(" ", ", ", 1),
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
    kernels = advice["model_settings"].get("kernels")
    if kernels is not None:
        rows.append(
            (
                f"{card}, kernels",
                f"use CausalLMFineTune(kernels={kernels!r}): the plan counts Liger-Kernel's RMSNorm, and 'auto' goes on"
                " without it where Liger-Kernel is not installed",
            )
        )
    return rows


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(filter(None, [", ".join(items[:-1]), *items[-1:]]))


def _yaml(value: Any) -> str:
    """A setting as a YAML config spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)
