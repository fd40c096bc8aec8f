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


def _stderr(verbose: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LIGHTNING_BLOCKWISE_VERBOSE"}
    if verbose is not None:
        env["LIGHTNING_BLOCKWISE_VERBOSE"] = verbose
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.mark.parametrize("verbose", [None, "0"])
def test_the_pip_install_kernels_warning_is_left_out(verbose: str | None) -> None:
    stderr = _stderr(verbose)
    assert "pip install" not in stderr
    # Control arm: the filter drops that message only; the logger's other warnings still come through.
    assert "another bitsandbytes warning" in stderr


def test_verbose_brings_it_back() -> None:
    # Control arm: the harness sees the warning when nothing filters it.
    stderr = _stderr("1")
    assert "Failed to load CPU gemm_4bit_forward" in stderr and "another bitsandbytes warning" in stderr
