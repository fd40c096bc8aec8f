"""``lightning-blockwise plan --longest`` / ``--table``: the arguments checked, the answers computed and printed.

:mod:`~lightning_blockwise.cli.plan_longest` computes the fits, :mod:`~lightning_blockwise.cli.plan_table` lays them
out; :func:`~lightning_blockwise.cli.plan_command.plan` hands over here when either flag is given.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from lightning_blockwise.cli.plan_arguments import OFFLOAD_CHOICES
from lightning_blockwise.cli.plan_kernels import modelled_kernels
from lightning_blockwise.cli.plan_longest import Machine, context_table, longest_context
from lightning_blockwise.cli.plan_table import fit_fields, longest_text, table_markdown
from lightning_blockwise.planning.recommend import SMALLEST_CARD
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.planning.step_kernels import StepKernels
from lightning_blockwise.residency.arena import meminfo_bytes


def longest_report(config: Any, options: argparse.Namespace) -> dict[str, Any]:
    """Answer ``--longest`` and/or ``--table`` for ``config``, print the answer, and return what ``--json`` prints.

    Raises:
        SystemExit: With a one-line message for arguments these modes do not take or lack.
    """
    _refuse(options)
    host_ram = options.host_ram or _this_host_ram()
    kernels = modelled_kernels(options.kernels, str(config.model_type), options.mlp_tile_tokens is not None)
    machine = Machine(
        card=options.gpu_memory or SMALLEST_CARD,
        host_ram=host_ram,
        pinned_limit=options.pinned_limit,
        tflops=options.tflops,
        link_gbps=options.link_gbps,
        recompute_every=options.recompute_every,
        prefetch_depth=options.prefetch_depth,
        offload=OFFLOAD_CHOICES[options.offload_activations],
        kernels=StepKernels(
            loss_chunk_tokens=options.loss_chunk_tokens,
            mlp_tile_tokens=options.mlp_tile_tokens,
            attention_tile_tokens=options.attention_tile_tokens,
            fused_norm=kernels.liger,
            fused_mlp=kernels.fused_mlp,
        ),
    )
    try:
        sizes = model_sizes(
            config,
            dtype=None if options.dtype is None else getattr(torch, options.dtype),
            lora_rank=options.lora_r,
            targets=options.targets,
            dora=options.dora,
            quantize=not options.dense,
        )
    except ValueError as error:
        raise SystemExit(f"lightning-blockwise plan: {error}") from None
    name = options.shape or str(getattr(config, "name_or_path", "") or sizes.model_type)
    report: dict[str, Any] = {"model": name, "host_ram": host_ram, "pinned_limit": options.pinned_limit,
                              "tflops": options.tflops, "link_gbps": options.link_gbps,
                              "recompute_every": options.recompute_every, "kernels_option": options.kernels,
                              "kernels": "liger" if kernels.liger else "none",
                              "kernels_reason": kernels.reason}  # fmt: skip
    texts = []
    if options.longest:
        longest, after = longest_context(sizes, machine)
        report.update(gpu_memory=machine.card, longest=fit_fields(longest), next=fit_fields(after))
        texts.append(longest_text(longest, after, machine, name))
    if options.table:
        table = context_table(sizes, machine, tuple(options.lengths), tuple(options.cards))
        report["table"] = {
            f"{gib}GiB": {
                "cells": [fit_fields(fit) for fit in table["cells"][gib]],
                "longest": fit_fields(table["longest"][gib][0]),
                "next": fit_fields(table["longest"][gib][1]),
            }
            for gib in table["cards_gib"]
        }
        texts.append(table_markdown(table, machine, name))
    if options.kernels != "none":
        # NOTE [ The kernels plan counts ]: `--kernels none` prints what plan printed before the option.
        texts.append(f"kernels: {kernels.reason}")
    print(json.dumps(report, indent=2) if options.json else "\n\n".join(texts))
    return report


def _refuse(options: argparse.Namespace) -> None:
    """The arguments ``--longest`` and ``--table`` lack or do not take, each refused in one line."""
    flag = "--longest" if options.longest else "--table"
    if options.longest and options.gpu_memory is None:
        raise SystemExit("lightning-blockwise plan: --longest needs the card: give --card, e.g. --card 24GB.")
    if options.vram_budget is not None:
        raise SystemExit(
            f"lightning-blockwise plan: {flag} plans the card's own budget (the card less its CUDA context); drop"
            f" --vram-budget {options.vram_budget}, or give --card."
        )
    if options.devices != 1 or options.block_major is not None:
        raise SystemExit(
            f"lightning-blockwise plan: {flag} plans one GPU without block-major windows; drop --devices and"
            " --block-major, or plan a given length with --seq-len."
        )
    if options.masked_attention:
        raise SystemExit(
            f"lightning-blockwise plan: {flag} plans one row of each length without padding; a mask over one long row"
            " takes row x row x 2 bytes in every layer that keeps its graph. Drop --masked-attention, or plan a given"
            " length with --seq-len and --batch-size."
        )
    if any(gib * 2**30 < SMALLEST_CARD for gib in options.cards):
        raise SystemExit(
            f"lightning-blockwise plan: --cards {' '.join(map(str, options.cards))}: a card needs at least"
            f" {SMALLEST_CARD / 2**30:g} GiB (the CUDA context takes 1 GiB); give sizes in GiB, e.g. 16 24 48 80."
        )


def _this_host_ram() -> int:
    """This machine's physical RAM (``MemTotal``), the default host."""
    total = meminfo_bytes("MemTotal")
    if total is None:
        raise SystemExit("lightning-blockwise plan: cannot read this machine's RAM; give --host-ram, e.g. 128GB.")
    return total


__all__ = ["longest_report"]
