"""What the package knows about processes on this host: whether one still runs, and how its files are named.

Killed processes leave files behind (a checkpoint's temporary file, an export's staging directory, the demo's
temporary model) and peers behind (a shared host copy's readers, a data-parallel run's ranks). Whoever comes next
tells a dead writer's leftovers from a live one's by the host and process id in their names, and a dead peer from
a live one by its process id: one naming and one liveness check for all of them.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path


def host_name() -> str:
    """This host's name as a field of a file name: only letters, digits and underscores (dots would end it)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "host"


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


__all__ = ["host_name", "process_exists", "process_running", "writer_tag"]
