"""Starting the ranks of a data-parallel test run as separate processes, with the variables torchrun sets.

The one launcher of the multi-process tests (tests/distributed, tests/recipes): each process starts with one thread
and the repository importable, its rank in ``RANK``/``LOCAL_RANK``, all of them at one free rendezvous port.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nothing listens on now, for a run's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(**variables: str) -> dict[str, str]:
    """This environment without a launcher's rank variables, one thread per process, the repository importable."""
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(variables)
    return env


def start_ranks(command: Sequence[str], world: int) -> list[subprocess.Popen[bytes]]:
    """Start ``command`` once per rank of a ``world``-process run on this machine, as torchrun would; don't wait."""
    port = str(free_port())
    return [
        subprocess.Popen(
            list(command),
            cwd=ROOT,
            env=clean_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE=str(world),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]


def run_ranks(command: Sequence[str], world: int, timeout: float = 300) -> list[tuple[int, str]]:
    """Run ``command`` once per rank of a ``world``-process run; each rank's return code and output, in rank order."""
    processes = start_ranks(command, world)
    outputs = [process.communicate(timeout=timeout)[0].decode() for process in processes]
    return [(process.returncode, output) for process, output in zip(processes, outputs, strict=True)]


def assert_succeeded(ranks: list[tuple[int, str]]) -> None:
    """Every rank exited with 0; else the failing rank's last output."""
    for rank, (code, output) in enumerate(ranks):
        assert code == 0, f"rank {rank} exited with {code}:\n{output[-4000:]}"
