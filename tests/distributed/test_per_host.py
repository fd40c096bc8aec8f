"""What is per host and what is global (NOTE [ Per host, and global ] in lightning_blockwise/strategy/rank_watchdog.py).

A simulated host (NOTE [ Simulated hosts ] in lightning_blockwise/compat/processes.py) is a name: everything per host
keys on it, so two names on one machine behave as two machines. The training runs over two simulated nodes are in
test_nodes.py; these are the per-host parts one by one, in this process (or forked from it) to stay cheap.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed
from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment
from lightning.pytorch import Trainer

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise.compat.processes import SIMULATED_HOST_VARIABLE, host_name, writer_tag
from lightning_blockwise.residency.shared_arena import claim
from lightning_blockwise.strategy.checkpoint_files import remove_stale_temporaries
from lightning_blockwise.strategy.rank_watchdog import Peer, RankWatchdog, remote_failure_message, split_by_host

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")


def _dead_pid() -> int:
    """The process id of a process that has ended and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_simulated_host_names_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    real = host_name()
    monkeypatch.setenv(SIMULATED_HOST_VARIABLE, "node-1.rack")
    assert host_name() == "node_1_rack" and writer_tag() == f"node_1_rack-{os.getpid()}"
    monkeypatch.delenv(SIMULATED_HOST_VARIABLE)
    assert host_name() == real  # control: unset, the machine's name


def test_each_host_owns_its_own_copy_of_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims of one key on two simulated hosts both own (two arenas); a second claim on one host attaches."""
    key = f"per-host test {os.getpid()}"
    monkeypatch.setenv(SIMULATED_HOST_VARIABLE, "node0")
    with claim(key) as first:
        monkeypatch.setenv(SIMULATED_HOST_VARIABLE, "node1")
        with claim(key) as other_host:
            assert first.owner and other_host.owner and first.address != other_host.address
        monkeypatch.setenv(SIMULATED_HOST_VARIABLE, "node0")
        with claim(key) as same_host:
            assert not same_host.owner and same_host.address == first.address  # control: one host, one owner


def test_leftovers_are_cleaned_on_their_own_host_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A dead writer's temporary checkpoint file is removed on its host; another host's pid means nothing here."""
    leftover = tmp_path / f".last.ckpt.node0-{_dead_pid()}.x1y2.tmp"
    leftover.write_bytes(b"partial")
    monkeypatch.setenv(SIMULATED_HOST_VARIABLE, "node1")
    assert remove_stale_temporaries(tmp_path) == [] and leftover.exists()
    monkeypatch.setenv(SIMULATED_HOST_VARIABLE, "node0")
    assert remove_stale_temporaries(tmp_path) == [leftover] and not leftover.exists()  # control: its own host


def test_a_watchdog_watches_the_ranks_of_its_host() -> None:
    everyone = [Peer(0, "node0", 10), Peer(1, "node0", 11), Peer(2, "node1", 10), Peer(3, "node1", 11)]
    watched, remote = split_by_host(everyone, everyone[2])
    assert watched == [everyone[3]] and remote == everyone[:2]  # process 10 of node0 is not this host's 10
    same = [Peer(rank, "node0", 10 + rank) for rank in range(4)]
    assert split_by_host(same, same[2]) == ([same[0], same[1], same[3]], [])  # control: one host, all watched


def test_the_message_on_a_dead_remote_rank_says_it_is_left_to_the_timeout() -> None:
    message = remote_failure_message(
        Peer(0, "node0", 10), [Peer(2, "node1", 20), Peer(3, "node1", 21)], timedelta(minutes=5), RuntimeError("x")
    )
    assert "No rank of node0 died" in message and "ranks 2, 3 on node1" in message
    assert "process group's timeout (0:05:00)" in message and "resume" in message


def _rank(rank: int, hosts: list[str], store: str, out: str) -> None:
    """A forked rank: join the group, start a watchdog; rank 1 dies, rank 0's next collective fails."""
    os.environ[SIMULATED_HOST_VARIABLE] = hosts[rank]
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    watchdog = RankWatchdog(timedelta(seconds=60), interval=3600.0)  # it must not end rank 0 first
    torch.distributed.barrier()
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank
    try:
        torch.distributed.all_reduce(torch.ones(1))
    except Exception as error:
        Path(out).write_text(f"{watchdog.remote_failure(error)}\n{watchdog.local_failure(error)}")
    os._exit(0)


@pytest.mark.parametrize("hosts", [["node0", "node1"], ["node0", "node0"]], ids=["two hosts", "one host"])
def test_a_failed_collective_names_the_remote_ranks(hosts: list[str], tmp_path: Path) -> None:
    """Rank 1 dies; rank 0's all-reduce fails (gloo sees the closed connection). With rank 1 on another host the
    message names it and the group's timeout; control: on the same host the watchdog's own message is the one."""
    out = tmp_path / "message"
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank, args=(r, hosts, str(tmp_path / "store"), str(out))) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    message, local = out.read_text().split("\n", 1)
    if hosts[1] == "node1":
        assert "No rank of node0 died" in message and "ranks 1 on node1" in message, message
        assert "process group's timeout (0:01:00)" in message
        assert local == "None"  # no rank of this host died
    else:
        assert message == "None"
        # On the same host the watchdog names the dead rank itself, though gloo's error came first (issue 41.10).
        assert local.startswith("BlockwiseStrategy: rank 1 (process") and "died during training" in local, local


@pytest.mark.parametrize(
    ("variables", "environment"),
    [
        # torchrun --nnodes 2 --nproc-per-node 2, rank 3: the second node's second process.
        (dict(TORCHELASTIC_RUN_ID="x", RANK="3", LOCAL_RANK="1", GROUP_RANK="1", WORLD_SIZE="4",
              LOCAL_WORLD_SIZE="2"), TorchElasticEnvironment),
        # srun with --nodes=2 --ntasks-per-node=2, the same process.
        (dict(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID="3", SLURM_LOCALID="1", SLURM_NODEID="1",
              SLURM_JOB_NAME="blockwise", SLURM_NODELIST="node[0-1]", SLURM_JOB_ID="1"), SLURMEnvironment),
    ],
    ids=["torchrun", "srun"],
)  # fmt: skip
def test_the_launchers_variables_give_the_ranks(
    variables: dict[str, str], environment: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented launches map to the ranks of `num_nodes=2, devices=2` through Lightning's own environments."""
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**variables, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    trainer = Trainer(strategy="blockwise", accelerator="cpu", num_nodes=2, devices=2, logger=False)
    strategy = trainer.strategy
    assert isinstance(strategy.cluster_environment, environment)
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank, strategy.world_size) == (3, 1, 1, 4)
    assert strategy.is_distributed
    # Control: node 0's second process (its variables) is another rank.
    first_node = {"RANK": "1", "GROUP_RANK": "0", "SLURM_PROCID": "1", "SLURM_NODEID": "0"}
    for name, value in first_node.items():
        if name in variables:
            monkeypatch.setenv(name, value)
    strategy = Trainer(strategy="blockwise", accelerator="cpu", num_nodes=2, devices=2, logger=False).strategy
    assert (strategy.global_rank, strategy.local_rank, strategy.node_rank) == (1, 1, 0)
