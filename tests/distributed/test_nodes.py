"""Two nodes simulated on one machine: the documented torchrun command, 2 x 2 CPU ranks (gloo), exact against DDP.

Each simulated node has its own host name (NOTE [ Simulated hosts ] in lightning_blockwise/compat/processes.py), so
each holds its own host copy and watches its own ranks, as two machines would. The launches are module fixtures:
every rank runs all its arms in one process (`tests/helpers/nodes_worker.py`), since CI has two cores.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from lightning_blockwise.compat.processes import SIMULATED_HOST_VARIABLE
from tests.distributed.test_data_parallel import ROOT, _env, _free_port
from tests.helpers.models import RunResult, assert_equal_runs, runs_differ, save_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")

#: Ranks of the simulated launch: node 0 holds ranks 0 and 1, node 1 ranks 2 and 3 (torchrun's order).
NODES, DEVICES = 2, 2
WORLD = NODES * DEVICES


def documented_torchrun() -> list[str]:
    """The torchrun line of docs/several-gpus.md for 2 nodes x 8 GPUs, as words."""
    text = (ROOT / "docs" / "several-gpus.md").read_text()
    [line] = re.findall(r"^torchrun --nnodes 2 --nproc-per-node 8 [^\\\n]*train\.py$", text, flags=re.MULTILINE)
    return shlex.split(line)


def simulated_node_command(node: int, port: int, worker: list[str]) -> list[str]:
    """The documented command for one simulated node: 2 processes, this machine, a free port, the test's worker."""
    values = {"8": str(DEVICES), "$NODE_RANK": str(node), "$MASTER_ADDR": "127.0.0.1", "29500": str(port)}
    words = [values.get(word, word) for word in documented_torchrun()]
    assert words[0] == "torchrun" and words[-1] == "train.py", words
    return [sys.executable, "-m", "torch.distributed.run", *words[1:-1], "-m", *worker]


def _records(out: Path, arm: str, world: int) -> tuple[list[RunResult], list[dict]]:
    results = [torch.load(out / arm / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    return results, [json.loads((out / arm / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def four(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The documented torchrun command, once per simulated node: `ddp`, `blockwise` (with checkpoints), the
    no-reduce control, the resumes on four processes (blockwise, its control, `ddp`), and the all-reduce's sums.
    Node 0's output is kept in ``output.txt``."""
    out = tmp_path_factory.mktemp("four")
    arms = ["ddp", "blockwise", "local", "resumed", "resumed_without_rank_rng", "ddp_resumed", "sums"]
    worker = ["tests.helpers.nodes_worker", str(out), "--checkpoint", str(checkpoint), "--nodes", str(NODES)]
    worker += ["--devices", str(DEVICES), "--arms", *arms]
    port = _free_port()
    nodes = [
        subprocess.Popen(
            simulated_node_command(node, port, worker),
            cwd=ROOT,
            env=_env(**{SIMULATED_HOST_VARIABLE: f"node{node}"}),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for node in range(NODES)
    ]
    outputs = [node.communicate(timeout=600)[0].decode() for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-6000:]
    (out / "output.txt").write_text(outputs[0])
    return out


@pytest.fixture(scope="module")
def two(checkpoint: Path, four: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four-process run's first checkpoint resumed on one node of two processes (started as torchrun would),
    the global batch kept (4 micro-batches per step instead of 2): blockwise, `ddp` (resumed as the strategy resumes,
    and as Lightning alone does), and blockwise unreduced.
    Rank 0's output is kept in ``output.txt``."""
    out = tmp_path_factory.mktemp("two")
    worker = [sys.executable, "-m", "tests.helpers.nodes_worker", str(out), "--checkpoint", str(checkpoint)]
    worker += ["--nodes", "1", "--devices", "2", "--accumulate", "4", "--resume-from", str(four)]
    worker += ["--arms", "resumed_here", "ddp_resumed_here", "ddp_plain_resumed_here", "local_resumed_here"]
    port = str(_free_port())
    ranks = [
        subprocess.Popen(
            worker,
            cwd=ROOT,
            env=_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE="2",
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=600)[0].decode() for rank in ranks]
    for rank, output in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, output[-6000:]
    (out / "output.txt").write_text(outputs[0])
    return out


def test_the_documented_command_trains_two_nodes_exactly_as_ddp(four: Path) -> None:
    """Every rank of the 2 x 2 launch: losses, reduced gradients, adapters and Adam state `torch.equal` to `ddp`'s.

    Control: the same launch whose DDP reduces nothing differs, and its ranks' gradients differ from each other.
    """
    ddp, _ = _records(four, "ddp", WORLD)
    blockwise, records = _records(four, "blockwise", WORLD)
    for rank in range(WORLD):
        assert_equal_runs(ddp[rank], blockwise[rank])
        assert records[rank]["node_rank"] == rank // DEVICES and records[rank]["local_rank"] == rank % DEVICES
    for name, grad in blockwise[0].grads[0].items():
        assert torch.equal(grad, blockwise[WORLD - 1].grads[0][name]), "the ranks of both nodes step on one sum"
    local, _ = _records(four, "local", WORLD)  # one epoch: 2 optimizer steps
    assert any(not torch.equal(grad, local[0].grads[0][name]) for name, grad in ddp[0].grads[0].items())
    assert not torch.equal(ddp[0].losses[2], local[0].losses[2]), "after the first step the runs part"
    assert any(not torch.equal(grad, local[WORLD - 1].grads[0][name]) for name, grad in local[0].grads[0].items())


def test_each_simulated_node_holds_its_own_host_copy(four: Path) -> None:
    """Two arenas, one per node: each node's local rank 0 packs and serves it, its other rank maps it read-only.

    The arena is told by the inode of the memfd mapped under its bytes: equal on a node's two ranks, different
    across the nodes (the control that two copies are told apart is the second node's other inode).
    """
    _, records = _records(four, "blockwise", WORLD)
    assert [record["host"] for record in records] == ["node0", "node0", "node1", "node1"]
    assert [(record["serving"], record["read_only"]) for record in records] == [(True, False), (False, True)] * NODES
    inodes = [record["arena_inode"] for record in records]
    assert None not in inodes and inodes[0] == inodes[1] and inodes[2] == inodes[3] and inodes[0] != inodes[2]


def test_each_watchdog_watches_its_own_node(four: Path) -> None:
    """Per host, not per global rank: a rank watches its node's other rank and leaves the other node's two."""
    _, records = _records(four, "blockwise", WORLD)
    for rank, record in enumerate(records):
        node = range(rank // DEVICES * DEVICES, (rank // DEVICES + 1) * DEVICES)
        assert record["watchdog"] == {
            "watched": [r for r in node if r != rank],
            "remote": [r for r in range(WORLD) if r not in node],
        }


def test_a_four_process_checkpoint_resumes_on_four(four: Path) -> None:
    """Resumed after the first epoch on the same 2 x 2 layout, every rank's first optimizer step trains on the
    uninterrupted run's weights, Adam state, data and random numbers: its micro-batches' losses are `torch.equal`.

    Control: without each rank's random-number states (dropout is on) those losses differ on the ranks other than 0.
    """
    whole, _ = _records(four, "blockwise", WORLD)
    resumed, _ = _records(four, "resumed", WORLD)
    control, _ = _records(four, "resumed_without_rank_rng", WORLD)
    for rank in range(WORLD):
        assert all(torch.equal(a, b) for a, b in zip(whole[rank].losses[4:6], resumed[rank].losses[:2], strict=True))
        differ = any(
            not torch.equal(a, b) for a, b in zip(whole[rank].losses[4:6], control[rank].losses[:2], strict=True)
        )
        assert differ == (rank != 0)


def test_a_four_process_resume_is_ddps_resume_to_the_last_bit(four: Path) -> None:
    """Resumed from the same checkpoint, blockwise trains as `strategy="ddp"` does (each rank's random-number states
    and the data order put back for both): losses, reduced gradients, adapters and Adam state `torch.equal` on every
    rank.

    Neither resume is the uninterrupted run to the last bit, and that is DDP's own (NOTE [ A resume on three ranks or
    more ] in strategy/data_parallel.py): resumed, DDP's first step has the uninterrupted run's losses and reduces
    other sums. Control: the blockwise resume without the ranks' random-number states differs from DDP's.
    """
    ddp, _ = _records(four, "ddp", WORLD)
    ddp_resumed, _ = _records(four, "ddp_resumed", WORLD)
    resumed, _ = _records(four, "resumed", WORLD)
    control, _ = _records(four, "resumed_without_rank_rng", WORLD)
    for rank in range(WORLD):
        assert_equal_runs(ddp_resumed[rank], resumed[rank])
        assert runs_differ(ddp_resumed[rank], control[rank])
        assert all(torch.equal(a, b) for a, b in zip(ddp[rank].losses[4:6], ddp_resumed[rank].losses[:2], strict=True))
        grads, uninterrupted = ddp_resumed[rank].grads[0], ddp[rank].grads[2]
        assert any(not torch.equal(grad, uninterrupted[name]) for name, grad in grads.items()), "DDP's own difference"


def test_a_sum_over_four_ranks_depends_on_where_the_buffer_holds_it(four: Path) -> None:
    """Why a resumed DDP reduces other sums: the same values all-reduced at other places of the buffer sum in another
    order over four ranks (gloo's ring), and so differ in the last bits; over two ranks `a + b == b + a`."""
    sums = [json.loads((four / "sums" / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    assert all(record["all"] > 0 for record in sums)
    assert [record.get("pair") for record in sums] == [0, 0, None, None]


def test_a_four_process_checkpoint_resumes_on_two(four: Path, two: Path) -> None:
    """On one node of two processes, the global batch stated (4 micro-batches a step): each optimizer step sees the
    sequences it saw on four processes (the `DistributedSampler`'s order), DDP sums the two ranks' gradients, and
    blockwise trains `torch.equal` to `strategy="ddp"` resumed the same way (losses, gradients, adapters, Adam state;
    DDP's data order and random-number states put back as the strategy puts them, `_ResumeAsTheStrategy` in
    tests/helpers/nodes_worker.py: resumed by Lightning alone, `ddp` trains the first epoch's sequences again).

    It is not the four-process run continued (two ranks add up the micro-batches in another order, and four ranks'
    random streams cannot become two), and the strategy says so as the run resumes, naming the fix: resume on as many
    processes as wrote the checkpoint (the four-process resumes, which are exact, do not hear it). Control: the same
    resume whose DDP reduces nothing steps each rank on its own gradients, and differs from DDP's.
    """
    blockwise, records = _records(two, "resumed_here", 2)
    ddp, _ = _records(two, "ddp_resumed_here", 2)
    local, _ = _records(two, "local_resumed_here", 2)
    for rank in range(2):
        assert_equal_runs(ddp[rank], blockwise[rank])
        assert runs_differ(ddp[rank], local[rank])
    for name, grad in blockwise[0].grads[0].items():
        assert torch.equal(grad, blockwise[1].grads[0][name])
    assert any(not torch.equal(grad, local[1].grads[0][name]) for name, grad in local[0].grads[0].items())
    _, written = _records(four, "blockwise", WORLD)
    # Per optimizer step of the second epoch, the sequences of all ranks: 4 ranks x 2 micro-batches, 2 x 4 here.
    on_four = [Counter(h for r in written for h in r["batches"][4 + 2 * step : 6 + 2 * step]) for step in range(2)]
    on_two = [Counter(h for r in records for h in r["batches"][4 * step : 4 + 4 * step]) for step in range(2)]
    assert on_four == on_two and all(sum(step.values()) == 8 for step in on_two)
    _, plain = _records(two, "ddp_plain_resumed_here", 2)
    on_four_first = [Counter(h for r in written for h in r["batches"][2 * step : 2 + 2 * step]) for step in range(2)]
    on_two_plain = [Counter(h for r in plain for h in r["batches"][4 * step : 4 + 4 * step]) for step in range(2)]
    assert on_two_plain == on_four_first != on_four, "Lightning alone trains the first epoch's sequences again"
    said = "written by 4 process(es) and resumes on 2"
    assert said in (two / "output.txt").read_text() and "Resume with 4 process(es)" in (two / "output.txt").read_text()
    assert "written by 4 process(es)" not in (four / "output.txt").read_text()
