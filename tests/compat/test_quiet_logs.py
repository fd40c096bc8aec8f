"""Outside libraries' messages that tell our users nothing are left out (compat/quiet_logs.py), back when verbose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

#: What bitsandbytes warns at import on a CPU with AVX512-BF16 (this machine may have none: the record is logged by
#: hand, on its logger, after `import lightning_blockwise`), then another warning of the same logger.
_SCRIPT = """
import logging
import lightning_blockwise
logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
logger.warning(
    "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install"
    " kernels` and the kernels >= 0.11.1", "No module named 'kernels'"
)
logger.warning("another bitsandbytes warning")
"""


#: The settings of LIGHTNING_BLOCKWISE_VERBOSE the tests run the script under (None: unset).
_SETTINGS = (None, "0", "1")


@pytest.fixture(scope="module")
def stderr() -> dict[str | None, str]:
    """The script's stderr under each setting; the processes run at once (each is one import of ~10 s, and CI has two
    cores while the test process waits)."""
    processes = {}
    for verbose in _SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_BLOCKWISE_VERBOSE"}
        if verbose is not None:
            env["LIGHTNING_BLOCKWISE_VERBOSE"] = verbose
        processes[verbose] = subprocess.Popen(
            [sys.executable, "-c", _SCRIPT], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
    errors = {verbose: process.communicate(timeout=600)[1] for verbose, process in processes.items()}
    for verbose, process in processes.items():
        assert process.returncode == 0, errors[verbose]
    return errors


@pytest.mark.parametrize("verbose", [None, "0"])
def test_the_pip_install_kernels_warning_is_left_out(stderr: dict[str | None, str], verbose: str | None) -> None:
    assert "pip install" not in stderr[verbose]
    # Control arm: the filter drops that message only; the logger's other warnings still come through.
    assert "another bitsandbytes warning" in stderr[verbose]


def test_verbose_brings_it_back(stderr: dict[str | None, str]) -> None:
    # Control arm: the harness sees the warning when nothing filters it.
    assert "Failed to load CPU gemm_4bit_forward" in stderr["1"] and "another bitsandbytes warning" in stderr["1"]
