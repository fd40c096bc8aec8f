"""Messages of outside libraries that tell our users nothing, left out unless ``LIGHTNING_BLOCKWISE_VERBOSE=1``.

Imported first by ``lightning_blockwise/__init__.py``, before anything imports bitsandbytes, because the
messages come at import time.
"""

from __future__ import annotations

import logging
import os

#: The environment variable that brings every message back (any value but "", "0").
VERBOSE_ENV = "LIGHTNING_BLOCKWISE_VERBOSE"

# NOTE [ The bitsandbytes "pip install kernels" warning ]
# bitsandbytes 0.50, imported on a CPU with AVX512-BF16, tries to download a gemm kernel from the Hugging Face hub
# through the optional `kernels` package and, failing, warns "Failed to load CPU gemm_4bit_forward from
# kernels-community ... Please make sure you already `pip install kernels`" on every command. Nothing here runs
# that kernel: the package keeps 4-bit weights trainable on the CPU with its own guard
# (compat/bitsandbytes/cpu_kernel.py), and nothing is downloaded anyway. So the warning is dropped.
_BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
_BITSANDBYTES_CPU_KERNEL = "Failed to load CPU gemm_4bit_forward from kernels-community"


class _DropMessage(logging.Filter):
    """Drop the records whose message starts with ``prefix``; every other record passes."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_FILTER = _DropMessage(_BITSANDBYTES_CPU_KERNEL)


def is_verbose() -> bool:
    """Whether the user asked for every message (``LIGHTNING_BLOCKWISE_VERBOSE=1``)."""
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def quiet_outside_libraries() -> None:
    """Install the filters (once; a second call changes nothing), or none when :func:`is_verbose`."""
    logger = logging.getLogger(_BITSANDBYTES_CPU_LOGGER)
    if is_verbose():
        logger.removeFilter(_FILTER)
    elif _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


def be_verbose() -> None:
    """Every message back, in this process and those it starts (``--verbose``): set the variable, drop the filters."""
    os.environ[VERBOSE_ENV] = "1"
    quiet_outside_libraries()


quiet_outside_libraries()

__all__ = ["VERBOSE_ENV", "be_verbose", "is_verbose", "quiet_outside_libraries"]
