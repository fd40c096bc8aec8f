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
    ]


__all__ = ["add_nodes_argument", "check_nodes", "nodes_fields", "nodes_rows"]
