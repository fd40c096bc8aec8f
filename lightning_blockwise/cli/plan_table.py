"""``lightning-blockwise plan --longest`` and ``--table``'s output: the answer, the settings to copy, the grid.

:mod:`~lightning_blockwise.cli.plan_longest` computes the fits; this module lays them out, as text and as the
fields ``--json`` prints.
"""

from __future__ import annotations

from typing import Any

from lightning_blockwise.cli.plan_longest import ContextFit, Machine
from lightning_blockwise.cli.plan_render import kernels_setting
from lightning_blockwise.planning.units import format_card, format_gb

#: What each memory's name means where a length does not fit.
_WHY = {
    "card": "the card: even every block streamed, with offload, the chunked loss and tiled MLPs, is over its budget",
    "host": "the host RAM: the pinned arena, the offloaded layer inputs and the embedding table",
    "pinned": "the page-locked limit: the arena and the offloaded layer inputs",
}


def settings(fit: ContextFit) -> dict[str, dict[str, Any]]:
    """The settings of a fit as a config's sections spell them: strategy, module and data ``init_args``."""
    advice = fit.advice
    strategy: dict[str, Any] = {"vram_budget": f"{advice.budget / 2**30:.1f}GiB", "block_size": advice.block_size}
    if advice.offload_activations:
        strategy["offload_activations"] = True
    strategy["budget_tokens"] = fit.tokens
    model = {
        name: value
        for name, value in (
            ("loss_chunk_tokens", advice.loss_chunk_tokens),
            ("mlp_tile_tokens", advice.mlp_tile_tokens),
            ("attention_tile_tokens", advice.attention_tile_tokens),
            ("kernels", kernels_setting(advice)),
        )
        if value is not None
    }
    return {"strategy": strategy, "model": model, "data": {"max_length": fit.tokens, "batch_size": 1}}


def python_snippet(fit: ContextFit) -> str:
    """The settings as Python to paste: the strategy's arguments, the recipe module's, the data module's."""
    chosen = settings(fit)

    def arguments(values: dict[str, Any]) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in values.items())

    model = arguments(chosen["model"])
    return "\n".join(
        [
            "from lightning_blockwise import BlockwiseStrategy",
            "from lightning_blockwise.recipes.data import InstructionDataModule",
            "from lightning_blockwise.recipes.finetune import CausalLMFineTune",
            "",
            f"strategy = BlockwiseStrategy({arguments(chosen['strategy'])})",
            f"model = CausalLMFineTune(checkpoint=..., {model})"
            if model
            else "model = CausalLMFineTune(checkpoint=...)",
            f"data = InstructionDataModule(..., {arguments(chosen['data'])})",
        ]
    )


def yaml_keys(fit: ContextFit) -> str:
    """The settings as the YAML keys of a config (configs/*.yaml)."""
    chosen = settings(fit)
    lines = []
    for section, path in (("strategy", "trainer:\n  strategy:\n    init_args:"), ("model", "model:\n  init_args:"),
                          ("data", "data:\n  init_args:")):  # fmt: skip
        if not chosen[section]:
            continue
        indent = " " * (path.count("\n") * 2 + 2)
        lines.append(path)
        lines.extend(f"{indent}{name}: {_yaml(value)}" for name, value in chosen[section].items())
    return "\n".join(lines)


def fit_fields(fit: ContextFit | None) -> dict[str, Any] | None:
    """A fit as ``--json`` prints it (sizes in bytes, times in seconds)."""
    if fit is None:
        return None
    advice = fit.advice
    fields: dict[str, Any] = {
        "tokens": fit.tokens,
        "fits": fit.fits,
        "binds": list(fit.binds),
        "vram_budget": advice.budget,
        "predicted_peak_bytes": advice.plan.predicted_peak if advice.plan else None,
        "predicted_reserved_bytes": advice.plan.predicted_reserved if advice.plan else None,
        "minimum_bytes": advice.minimum,
        "block_size": advice.block_size,
        "offload_activations": advice.offload_activations,
        "loss_chunk_tokens": advice.loss_chunk_tokens,
        "mlp_tile_tokens": advice.mlp_tile_tokens,
        "attention_tile_tokens": advice.attention_tile_tokens,
        "fused_norm": advice.fused_norm,
        "fused_mlp": advice.fused_mlp,
        "host_pinned_bytes": fit.pinned_bytes,
        "host_bytes": fit.host_bytes,
    }
    if fit.time is not None:
        fields.update(step_seconds=fit.time.seconds, compute_seconds=fit.time.compute, link_seconds=fit.time.link)
    if fit.fits:
        fields["settings"] = settings(fit)
    return fields


def longest_text(longest: ContextFit | None, after: ContextFit, machine: Machine, model: str) -> str:
    """The answer of ``--longest``: the length, what stops a longer one, what it needs, and the settings to copy."""
    where = f"a {format_card(machine.card)} and {machine.host_ram / 2**30:g} GiB of host RAM"
    stop = " and ".join(after.binds) or "nothing"
    if longest is None:
        return (
            f"{model} does not train even {after.tokens:,} tokens on {where}: too small is "
            + "; and ".join(_WHY[name] for name in after.binds)
            + f" ({_needs(after, machine)})."
        )
    advice = longest.advice
    assert advice.plan is not None and longest.time is not None
    time = longest.time
    lines = [
        f"longest context of {model} on {where}: {longest.tokens:,} tokens (batch 1)",
        f"  {after.tokens:,} tokens do not fit: {stop} binds ({_needs(after, machine)})",
        f"  card: predicted peak {format_gb(advice.plan.predicted_peak)} allocated,"
        f" {format_gb(advice.plan.predicted_reserved)} with the allocator's headroom, under a vram_budget of"
        f" {advice.budget / 2**30:.1f} GiB",
        f"  host: {format_gb(longest.pinned_bytes)} pinned (arena and offloaded layer inputs),"
        f" {format_gb(longest.host_bytes)} in all with the embedding table and a reserve",
        f"  expected step: {time.seconds:.1f} s, {time.bound}-bound (compute {time.compute:.1f} s at"
        f" {machine.tflops:g} TFLOP/s, host link {time.link:.1f} s at {machine.link_gbps:g} GB/s)",
        "",
        "settings, Python:",
        *("  " + line for line in python_snippet(longest).splitlines()),
        "",
        "settings, YAML (a config's keys):",
        *("  " + line for line in yaml_keys(longest).splitlines()),
    ]
    return "\n".join(lines)


def table_markdown(table: dict[str, Any], machine: Machine, model: str) -> str:
    """``--table``: lengths down, cards across; each cell the expected step time where it fits, else what binds."""
    cards = table["cards_gib"]
    header = [f"{model}, host {machine.host_ram / 2**30:g} GiB", *(f"{gib} GiB card" for gib in cards)]
    rows = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for index, tokens in enumerate(table["lengths"]):
        cells = [_cell(table["cells"][gib][index]) for gib in cards]
        rows.append(f"| {_tokens(tokens)} | " + " | ".join(cells) + " |")
    longest = []
    for gib in cards:
        fit, after = table["longest"][gib]
        longest.append(
            f"**{_tokens(fit.tokens)}** ({'/'.join(after.binds)})" if fit else f"none ({'/'.join(after.binds)})"
        )
    rows.append("| longest | " + " | ".join(longest) + " |")
    return "\n".join(rows)


def _cell(fit: ContextFit) -> str:
    if not fit.fits:
        return "no: " + "/".join(fit.binds)
    assert fit.time is not None
    return f"{fit.time.seconds:.3g} s"


def _tokens(tokens: int) -> str:
    """``4096`` as ``4k``, ``122880`` as ``120k``: tokens in units of 1024."""
    return f"{tokens / 1024:g}k" if tokens % 1024 == 0 else f"{tokens:,}"


def _needs(fit: ContextFit, machine: Machine) -> str:
    """What a length that does not fit needs, against what the machine has, for each memory that binds."""
    parts = []
    if "card" in fit.binds:
        parts.append(f"a budget of {format_gb(fit.advice.minimum)} against the card's {format_gb(fit.advice.budget)}")
    if "host" in fit.binds:
        parts.append(f"{format_gb(fit.host_bytes)} of host RAM against {format_gb(machine.host_ram)}")
    if "pinned" in fit.binds and machine.pinned_limit is not None:
        parts.append(f"{format_gb(fit.pinned_bytes)} pinned against a limit of {format_gb(machine.pinned_limit)}")
    return "; ".join(parts)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


__all__ = ["fit_fields", "longest_text", "python_snippet", "settings", "table_markdown", "yaml_keys"]
