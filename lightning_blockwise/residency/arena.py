"""The host arena: one exact-size host allocation holding every streamed block's slab.

The arena is kept on the Hugging Face model with its block layouts (``placement.HostCopy``), so
it lives exactly as long as the module, and views of it are the module's only copy of its
frozen decoder weights.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise.residency.layout import align_up

#: Host RAM the arena leaves to everything else (the process, the data pipeline, the OS).
HOST_RAM_RESERVE = 2 * 1024**3


def available_host_memory() -> int:
    """Bytes of host RAM available to new allocations (``MemAvailable``), or the physical total where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def slab_offsets(sizes: Sequence[int]) -> list[int]:
    """Where each slab of ``sizes`` starts in an arena, then the arena's total size (one more entry).

    Each slab starts aligned like the tensors inside it (see ``host.ALIGNMENT``).
    """
    offsets = [0]
    for size in sizes:
        offsets.append(align_up(offsets[-1] + size))
    return offsets


# NOTE [ Exact-size pinned memory ]
# torch's pinned allocator rounds every request up to a power of two: a 16.1 GB base
# pinned that way can take 32 GB of RAM. The arena instead allocates exactly the bytes
# the blocks need as ordinary host memory and page-locks that range with
# ``cudaHostRegister``, so copies from it are true asynchronous DMA at pinned speed
# (pageable copies run at about a third of it and serialize). The registration is undone
# when the arena is collected, which happens with the module (``placement.attach_host_copy``).
class HostArena:
    """Exact-size host memory for every streamed block, page-locked when CUDA is used.

    ``nbytes`` is what the arena allocates (and pins); ``bytes_needed`` the slabs' own sizes.
    The difference is at most ``ALIGNMENT - 1`` bytes per block.

    Args:
        sizes: Bytes of each block's slab, in block order (0 for a block that is not streamed).
        pin: Page-lock the arena for asynchronous copies to a CUDA device.
        purpose: What the memory holds, for the error.
        fix: How to need less of it, for the error.

    Raises:
        MisconfigurationException: If the arena does not fit the available host RAM, or
            page-locking is asked for without CUDA.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        pin: bool,
        purpose: str = "the frozen decoder layers",
        fix: str = "keep blocks on the GPU with `vram_budget`",
    ) -> None:
        offsets = slab_offsets(sizes)
        self.nbytes = offsets[-1]
        self.bytes_needed = sum(sizes)
        available = available_host_memory()
        if self.nbytes > available - HOST_RAM_RESERVE:
            raise MisconfigurationException(
                f"BlockwiseStrategy needs {self.nbytes / 1e9:.2f} GB of host RAM for {purpose}, but"
                f" only {available / 1e9:.2f} GB are available (keeping {HOST_RAM_RESERVE / 1e9:.1f} GB in reserve)."
                f" Free host memory, use a machine with more RAM, or {fix}."
            )
        if pin and not torch.cuda.is_available():
            raise MisconfigurationException(
                "HostArena(pin=True) page-locks memory for CUDA, but CUDA is not available."
            )
        # `device` explicitly: Lightning builds modules under `torch.device(root_device)` (`configure_model` runs
        # in the strategy's `tensor_init_context`), where a bare `torch.empty` would land on the GPU.
        self.storage = torch.empty(self.nbytes, dtype=torch.uint8, device="cpu")
        self.pinned = False
        if pin and self.nbytes:
            # NOTE [ Exact-size pinned memory ]
            err = torch.cuda.cudart().cudaHostRegister(self.storage.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed with CUDA error {int(err)}.")
            self.pinned = True
        self.slabs: list[Tensor] = [
            self.storage[start : start + size] for start, size in zip(offsets, sizes, strict=False)
        ]

    def __del__(self) -> None:
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
            self.pinned = False
