"""What the package knows about processes on this host: whether one still runs, and how its files are named.

Killed processes leave files behind (a checkpoint's temporary file, an export's staging directory, the demo's
temporary model) and peers behind (a shared host copy's readers, a data-parallel run's ranks). Whoever comes next
tells a dead writer's leftovers from a live one's by the host and process id in their names, and a dead peer from
a live one by its process id: one naming and one liveness check for all of them.

What is per host (a shared host copy, the rank watchdog, leftovers) is keyed by :func:`host_name`; tests simulate
several nodes on one machine by giving each "node" its own name (:data:`SIMULATED_HOST_VARIABLE`).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

#: The environment variable that makes a process take itself for one on another host: its value is the host's name.
#: For tests only (tests/distributed/test_nodes.py): see NOTE [ Simulated hosts ].
SIMULATED_HOST_VARIABLE = "LIGHTNING_BLOCKWISE_SIMULATED_HOST"

# NOTE [ Simulated hosts ]
# Two nodes of a multi-node run differ in everything a host owns: the abstract socket namespace where a shared host
# copy is found (NOTE [ One host copy per machine ] in residency/shared_arena.py), the process ids a rank watchdog
# can check (NOTE [ A dead rank ends the run ] in strategy/rank_watchdog.py), the leftovers a process may clean up.
# CI has one machine: it launches two "nodes" on it, each with its own `LIGHTNING_BLOCKWISE_SIMULATED_HOST`, and
# everything per host keys on `host_name()`, which returns that name. So each simulated node packs and serves its
# own copy (two arenas, as two machines would hold), watches only its own ranks and cleans only its own files. On a
# real cluster the variable is unset and `host_name()` is the machine's name; processes of one machine that set
# different names (which nothing but a test should do) simply share nothing.


def host_name() -> str:
    """This host's name as a field of a file name: only letters, digits and underscores (dots would end it).

    The machine's name, or the simulated host's where :data:`SIMULATED_HOST_VARIABLE` is set (NOTE [ Simulated
    hosts ]).
    """
    name = os.environ.get(SIMULATED_HOST_VARIABLE) or socket.gethostname()
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "host"


def writer_tag() -> str:
    """``<host>-<pid>`` of this process, the field by which its leftovers are found again (:func:`process_exists`)."""
    return f"{host_name()}-{os.getpid()}"


def process_exists(pid: int) -> bool:
    """Whether process ``pid`` exists on this host, another user's or a zombie included.

    A zombie may not have dropped its mappings and files yet, so whoever cleans up after a process waits for it to
    be gone entirely.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is no zombie (killed, not yet reaped by its parent).

    A data-parallel rank killed by a signal stays a zombie while its parent, another rank blocked in a collective,
    cannot reap it; for the ranks that wait on it, it is dead.
    """
    try:
        # The state is the field after the command name, which is in parentheses and may hold spaces.
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return process_exists(pid)  # no /proc to read: at least whether it exists


__all__ = ["SIMULATED_HOST_VARIABLE", "host_name", "process_exists", "process_running", "writer_tag"]
