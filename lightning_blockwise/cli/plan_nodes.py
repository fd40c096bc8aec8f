"""``lightning-blockwise plan --nodes``: what several machines add to a plan, and what stays per machine.

Per node, nothing changes: each node holds its own arena and its ranks' offloaded inputs (NOTE [ One host copy per
machine ] in residency/shared_arena.py), so host RAM is per node and VRAM per GPU as with one node. What grows with
the node count is DDP's all-reduce of the adapters' gradients, against which this module sets the base's bytes that
every GPU streams over its host link: the two traffics of a data-parallel blockwise step.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning_blockwise.planning.units import format_gb

# NOTE [ Traffic of a step on many nodes ]
# Per micro-batch every streamed block crosses its GPU's host link twice: once for the forward, once for the
# recompute in the backward (`2 x arena` with every block streamed, the default budget's case; resident blocks cross
# once, when placed). Per optimizer step DDP all-reduces the adapters' gradients once: a ring over N ranks sends and
# receives `2 (N - 1) / N x G` bytes per GPU, G the gradients' bytes (the adapters' own dtype, float32 from PEFT).
# NCCL's rings cross the nodes over the GPUs' network rails, so that is also what each GPU's rail carries between
# nodes. Block-major windows of W micro-batches stream the base once per window (`2 x arena / W` per micro-batch).
# The expected step per GPU is NOTE [ Expected step time ] in planning/longest.py with the same streamed bytes (no
# resident or kept block counted: an upper bound where a budget keeps some), at `--tflops` and `--link-gbps`, the
# latter each GPU's share of the host: the GPUs of a node read one arena, and their links together can ask more of
# the host's memory than it serves (benchmarks/host_link.py measures the share on the node). Tokens per second are
# every rank's micro-batch over that step; the all-reduce, once per optimizer step, is left out (a few percent).


def add_nodes_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--nodes`` to ``plan``'s parser."""
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="Machines of --devices GPUs each (default: 1). Host RAM stays per node (each its own arena); the report"
        " adds the adapters' all-reduce over nodes x devices ranks against the base streamed per GPU.",
    )


def check_nodes(nodes: int, whole_card_modes: bool) -> None:
    """Refuse a ``--nodes`` the plan cannot use.

    Raises:
        MisconfigurationException: If ``nodes`` is below 1, or given with ``--longest``/``--table``.
    """
    from lightning.pytorch.utilities.exceptions import MisconfigurationException  # not for `plan --help`

    if nodes < 1:
        raise MisconfigurationException(f"--nodes {nodes}: a run has at least one node; give 1 or more.")
    if nodes > 1 and whole_card_modes:
        raise MisconfigurationException(
            f"--nodes {nodes} with --longest/--table: those plan one GPU of one machine, which more nodes do not"
            " change; drop --nodes, or plan a length with --seq-len."
        )


def nodes_fields(report: dict[str, Any], nodes: int) -> dict[str, Any]:
    """The report's fields for ``nodes`` machines of ``report["devices"]`` GPUs each.

    Ranks, the all-reduce's bytes per GPU and optimizer step, the base's bytes streamed per GPU and micro-batch and
    per node, host RAM per node (NOTE [ Traffic of a step on many nodes ]).
    """
    devices = report["devices"]
    ranks = nodes * devices
    window = report.get("block_major") or 1
    gradients = report["adapter_bytes"]
    allreduce = 2 * (ranks - 1) / ranks * gradients if ranks > 1 else 0.0
    streamed = 2 * report["host_arena_bytes"] / window
    return {
        "nodes": nodes,
        "ranks": ranks,
        "allreduce_bytes_per_gpu": int(allreduce),
        "streamed_bytes_per_gpu": int(streamed),
        "streamed_bytes_per_node": int(streamed * devices),
        "host_pinned_bytes_per_node": report["host_pinned_bytes"],
    }


def throughput_fields(report: dict[str, Any], config: Any, tflops: float, link_gbps: float) -> dict[str, Any]:
    """The expected step per GPU and the tokens per second of all ranks (NOTE [ Traffic of a step on many nodes ]).

    Args:
        report: ``plan``'s report with :func:`nodes_fields`'s fields.
        config: The model's config.
        tflops: Each card's sustained bf16 matmul rate, in TFLOP/s.
        link_gbps: Each GPU's share of its host's link and memory, in GB/s.
    """
    from lightning_blockwise.cli.plan_longest import attention_size, config_matmul_params, recomputed_params
    from lightning_blockwise.planning.longest import StepCost, step_time

    layers, tokens, tile = report["num_layers"], report["tokens"], report.get("attention_tile_tokens")
    cost = StepCost(
        matmul_params=config_matmul_params(config, layers),
        num_layers=layers,
        attention_size=attention_size(config),
        arena_bytes=report["host_arena_bytes"] // (report.get("block_major") or 1),
        offloaded_bytes=report["offload_host_bytes"] // report["devices"],
        recomputed_params=recomputed_params(
            config, layers, report["mlp_tile_tokens"] is not None, report["loss_chunk_tokens"] is not None
        ),
        tiled_attention=tile is not None and tile < tokens,
    )
    time = step_time(cost, tokens, tflops, link_gbps)
    return {
        "tflops": tflops,
        "link_gbps_per_gpu": link_gbps,
        "step_flops": cost.flops(tokens),
        "compute_seconds": time.compute,
        "link_seconds": time.link,
        "step_seconds": time.seconds,
        "bound": time.bound,
        "tokens_per_second": report["ranks"] * tokens / time.seconds,
    }


def nodes_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed rows of :func:`nodes_fields`; none for a report of one machine of one GPU."""
    if report.get("ranks", 1) == 1:
        return []
    allreduce, streamed = report["allreduce_bytes_per_gpu"], report["streamed_bytes_per_gpu"]
    ratio = f"{streamed / allreduce:,.0f}x the all-reduce" if allreduce else "no all-reduce"
    return [
        (
            "nodes",
            f"{report['nodes']} x {report['devices']} GPUs = {report['ranks']} data-parallel ranks; host RAM above is"
            " per node (each node its own arena and its ranks' offloaded inputs)",
        ),
        (
            "all-reduce per optimizer step",
            f"{allreduce / 1e6:.1f} MB sent per GPU (ring over {report['ranks']} ranks: 2 x"
            f" {report['ranks'] - 1}/{report['ranks']} of {report['adapter_bytes'] / 1e6:.1f} MB of adapter gradients)",
        ),
        (
            "base streamed per micro-batch",
            f"{format_gb(streamed)} per GPU over its host link (forward + recompute, every block streamed), "
            f"{format_gb(report['streamed_bytes_per_node'])} per node: {ratio}",
        ),
        *_throughput_rows(report),
    ]


def _throughput_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The printed rows of :func:`throughput_fields`, where the report has them."""
    if "step_seconds" not in report:
        return []
    return [
        (
            "expected step per GPU",
            f"{report['step_seconds']:.2f} s per micro-batch, {report['bound']}-bound: compute"
            f" {report['compute_seconds']:.2f} s ({report['step_flops'] / 1e15:.2f} PFLOP at {report['tflops']:g}"
            f" TFLOP/s, --tflops), copies {report['link_seconds']:.2f} s (at {report['link_gbps_per_gpu']:g} GB/s per"
            " GPU, --link-gbps: each GPU's share of the host)",
        ),
        (
            "expected tokens/s",
            f"{report['tokens_per_second']:,.0f} over {report['ranks']} ranks"
            f" ({report['tokens_per_second'] / report['ranks']:,.0f} per GPU; the all-reduce left out)",
        ),
    ]


__all__ = ["add_nodes_argument", "check_nodes", "nodes_fields", "nodes_rows", "throughput_fields"]
