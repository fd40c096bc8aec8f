"""The host arena: one exact-size host allocation holding every streamed block's slab.

The arena is kept on the Hugging Face model with its block layouts (``placement.HostCopy``), so
it lives exactly as long as the module, and views of it are the module's only copy of its
frozen decoder weights. On Linux its bytes live in an anonymous memfd, so another process on the
machine can map the same pages (``shared_arena``).
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Sequence

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise.residency.layout import align_up

#: Host RAM the arena leaves to everything else (the process, the data pipeline, the OS).
HOST_RAM_RESERVE = 2 * 1024**3

#: ``cudaHostRegisterReadOnly``: the pages are only read by the device (a peer's read-only mapping needs it).
CUDA_HOST_REGISTER_READ_ONLY = 0x08

#: The name of every arena's memfd, as ``/proc/<pid>/maps`` shows it (``/memfd:<name> (deleted)``).
MEMFD_NAME = "lightning-blockwise-arena"


def meminfo_bytes(field: str) -> int | None:
    """Bytes of ``field`` in ``/proc/meminfo`` (e.g. ``"MemAvailable"``, ``"Shmem"``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024
    except OSError:
        pass
    return None


def available_host_memory() -> int:
    """Bytes of host RAM available to new allocations (``MemAvailable``), or the physical total where unknown."""
    available = meminfo_bytes("MemAvailable")
    if available is not None:
        return available
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


# NOTE [ Arena memory in a memfd ]
# On Linux the arena's bytes are an anonymous memfd mapped ``MAP_SHARED`` instead of process-private
# memory, so that ``shared_arena`` can hand the same pages to other processes on the machine (its NOTE
# [ One host copy per machine ]). The pages belong to no file system: they are freed when the last fd
# and the last mapping of them are gone, whatever killed the processes. They count as ``Shmem`` in
# ``/proc/meminfo``. The size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``) right away: a process that
# received the fd could otherwise truncate it, and every process reading the mapping would die of SIGBUS.
#
# Lifetime: ``torch.frombuffer`` keeps a reference to the ``mmap`` object, not a buffer export, so
# ``mmap.close()`` would succeed while tensors still view the pages and unmap them under their feet. The
# arena never closes the mapping: it goes away with the ``mmap`` object, once the last tensor viewing it
# is collected. The arena closes only its fd (in ``__del__``), which does not touch the mapping.
#
# A forked child (e.g. a DataLoader worker) shares the pages instead of getting copy-on-write copies of
# them; such children never touch the arena, so nothing changes for them.
class HostArena:
    """Exact-size host memory for every streamed block, page-locked when CUDA is used.

    ``nbytes`` is what the arena allocates (and pins); ``bytes_needed`` the slabs' own sizes.
    The difference is at most ``ALIGNMENT - 1`` bytes per block. On Linux the bytes live in an
    anonymous memfd (``fd``) that ``shared_arena`` can hand to other processes; where
    ``os.memfd_create`` does not exist they are ordinary process memory, ``fd`` is ``None`` and the
    arena cannot be shared. An arena mapped from another process (:meth:`from_shared`) is read-only.

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
        nbytes = slab_offsets(sizes)[-1]
        available = available_host_memory()
        if nbytes > available - HOST_RAM_RESERVE:
            raise MisconfigurationException(
                f"BlockwiseStrategy needs {nbytes / 1e9:.2f} GB of host RAM for {purpose}, but"
                f" only {available / 1e9:.2f} GB are available (keeping {HOST_RAM_RESERVE / 1e9:.1f} GB in reserve)."
                f" Free host memory, use a machine with more RAM, or {fix}."
            )
        _check_pin(pin, "HostArena(pin=True)")
        fd = _memfd(nbytes)
        if fd is None:
            # `device` explicitly: Lightning builds modules under `torch.device(root_device)` (`configure_model`
            # runs in the strategy's `tensor_init_context`), where a bare `torch.empty` would land on the GPU.
            storage = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
        else:
            try:
                storage = _map(fd, nbytes, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
        self._adopt(storage, fd, sizes, pin=pin, read_only=False)

    @classmethod
    def from_shared(cls, fd: int, sizes: Sequence[int], pin: bool) -> HostArena:
        """Map another process's arena, read-only: the same pages, no copy.

        ``fd`` stays the caller's to close; the mapping keeps the pages alive without it. Writing to
        the arena's tensors kills the process with SIGSEGV. The returned arena has no ``fd``: it is
        not handed on.

        Args:
            fd: The memfd of the other process's arena (received from ``shared_arena``).
            sizes: The slab sizes that arena was built with.
            pin: Page-lock the mapping for asynchronous copies to a CUDA device (read-only registration).

        Raises:
            ValueError: If the memfd's size is not the size of ``sizes``' arena.
            MisconfigurationException: If page-locking is asked for without CUDA.
            RuntimeError: If CUDA refuses to page-lock the mapping.
        """
        nbytes = slab_offsets(sizes)[-1]
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(
                f"HostArena.from_shared: the shared arena holds {size} bytes, but slabs of {list(sizes)} take"
                f" {nbytes}; pass the slab sizes the owner built it with."
            )
        _check_pin(pin, "HostArena.from_shared(pin=True)")
        arena = cls.__new__(cls)
        arena._adopt(_map(fd, nbytes, mmap.PROT_READ), None, sizes, pin=pin, read_only=True)
        return arena

    def _adopt(self, storage: Tensor, fd: int | None, sizes: Sequence[int], pin: bool, read_only: bool) -> None:
        """Take ``storage`` as the arena's bytes: page-lock it if ``pin`` and cut it into slabs."""
        offsets = slab_offsets(sizes)
        self.nbytes = offsets[-1]
        self.bytes_needed = sum(sizes)
        self.storage = storage
        self.fd = fd
        self.read_only = read_only
        self.pinned = False
        if pin and self.nbytes:
            # NOTE [ Exact-size pinned memory ]
            flags = CUDA_HOST_REGISTER_READ_ONLY if read_only else 0
            err = torch.cuda.cudart().cudaHostRegister(self.storage.data_ptr(), self.nbytes, flags)
            if int(err) != 0:
                hint = (
                    " A read-only mapping needs `cudaHostRegisterReadOnly`: check the device's"
                    " `cudaDevAttrHostRegisterReadOnlySupported`, or load a copy in this process (no shared arena)."
                    if read_only
                    else ""
                )
                raise RuntimeError(
                    f"cudaHostRegister of {self.nbytes} bytes (flags {flags:#x}) failed:"
                    f" {torch.cuda.CudaError(int(err))}.{hint}"
                )
            self.pinned = True
        self.slabs: list[Tensor] = [
            self.storage[start : start + size] for start, size in zip(offsets, sizes, strict=False)
        ]

    def __del__(self) -> None:
        if getattr(self, "pinned", False):
            torch.cuda.cudart().cudaHostUnregister(self.storage.data_ptr())
            self.pinned = False
        # NOTE [ Arena memory in a memfd ]: closing the fd leaves the mapping (and so every view) intact.
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)
            self.fd = None


def _check_pin(pin: bool, call: str) -> None:
    if pin and not torch.cuda.is_available():
        raise MisconfigurationException(f"{call} page-locks memory for CUDA, but CUDA is not available.")


def _memfd(nbytes: int) -> int | None:
    """A sealed-size anonymous memfd of ``nbytes`` (NOTE [ Arena memory in a memfd ]), or ``None`` off Linux."""
    if not hasattr(os, "memfd_create"):
        return None
    import fcntl  # here, not at the top: Windows has no fcntl, and this line runs on Linux only

    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(fd: int, nbytes: int, prot: int) -> Tensor:
    """The ``uint8`` tensor over a shared mapping of ``fd`` (NOTE [ Arena memory in a memfd ])."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device="cpu")  # mmap refuses an empty mapping
    mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    with warnings.catch_warnings():
        # torch warns that it cannot make a read-only tensor: the pages' protection is what enforces it here.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8)
