"""Which processes still run, and the host-pid field their leftovers are named with."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from lightning_blockwise.compat.processes import host_name, process_exists, process_running, writer_tag


def test_a_zombie_exists_but_does_not_run() -> None:
    """A killed child not yet reaped is a zombie: it still exists (its files may be open), but it runs no more."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_exists(child.pid) and process_running(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_running(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not process_running(child.pid) and process_exists(child.pid), "a zombie until reaped"
    finally:
        child.wait()
    assert not process_exists(child.pid) and not process_running(child.pid)


def test_this_process_runs_and_its_tag_names_it() -> None:
    assert process_exists(os.getpid()) and process_running(os.getpid())
    assert re.fullmatch(r"[A-Za-z0-9_]+", host_name())
    assert writer_tag() == f"{host_name()}-{os.getpid()}"
