"""`lightning-blockwise plan --nodes`: the all-reduce against the base streamed per GPU, host RAM per node."""

from __future__ import annotations

import json

import pytest

from lightning_blockwise.cli import main
from lightning_blockwise.cli.plan_command import plan


def test_eight_nodes_of_eight_add_the_all_reduce_and_keep_host_ram_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    """The 64-GPU plan of docs/several-gpus.md: its numbers, and per-node host RAM as with one node (the control)."""
    common = ["--shape", "72b", "--seq-len", "4096", "--devices", "8", "--json"]
    one = plan(common)
    many = plan([*common, "--nodes", "8"])
    capsys.readouterr()
    assert many["ranks"] == 64 and one["ranks"] == 8
    assert many["host_pinned_bytes_per_node"] == one["host_pinned_bytes"] == many["host_pinned_bytes"]
    assert many["allreduce_bytes_per_gpu"] == int(2 * 63 / 64 * many["adapter_bytes"])
    assert one["allreduce_bytes_per_gpu"] == int(2 * 7 / 8 * one["adapter_bytes"])  # control: fewer ranks, less
    assert many["streamed_bytes_per_gpu"] == 2 * many["host_arena_bytes"] == one["streamed_bytes_per_gpu"]
    assert many["streamed_bytes_per_node"] == 8 * many["streamed_bytes_per_gpu"]
    # The docs' table: 842.1 MB of gradients, 1658.0 MB all-reduced, 72.45 GB streamed per GPU, 579.6 GB per node.
    assert round(many["adapter_bytes"] / 1e5) == 8421 and round(many["allreduce_bytes_per_gpu"] / 1e5) == 16580
    assert round(many["streamed_bytes_per_gpu"] / 1e7) == 7245 and round(many["streamed_bytes_per_node"] / 1e8) == 5796
    windowed = plan([*common, "--nodes", "8", "--block-major", "4"])
    capsys.readouterr()
    assert windowed["streamed_bytes_per_gpu"] == many["streamed_bytes_per_gpu"] // 4


def test_the_rows_printed_for_nodes(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")  # rich's table on one line per row
    main(["plan", "--shape", "7b", "--seq-len", "4096", "--devices", "8", "--nodes", "8"])
    out = capsys.readouterr().out
    assert "64 data-parallel ranks" in out and "ring over 64 ranks" in out and "21x the all-reduce" in out
    main(["plan", "--shape", "7b", "--seq-len", "4096"])
    assert "data-parallel ranks" not in capsys.readouterr().out  # control: one GPU, no such rows


@pytest.mark.parametrize(
    ("arguments", "message"),
    [(["--nodes", "0"], "--nodes 0: a run has at least one node"), (["--nodes", "2", "--longest"], "--longest")],
)
def test_nodes_it_cannot_plan_are_refused(arguments: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        plan(["--shape", "7b", "--card", "24GB", "--host-ram", "128GB", *arguments])
    json.dumps(plan(["--shape", "7b", "--nodes", "1", "--json"]))  # control: one node is a plan
