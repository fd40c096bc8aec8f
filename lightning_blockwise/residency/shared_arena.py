"""One host copy of the frozen base per machine: processes that train the same base share its arena.

The first process to :func:`claim` a key owns it: it builds and loads its
:class:`~lightning_blockwise.residency.arena.HostArena`, then publishes it. Every other process
that claims the key attaches: it maps the owner's pages read-only instead of loading a copy::

    with claim(key) as arena_claim:
        shared = None if arena_claim.owner else arena_claim.attach(pin=True, timeout=600.0)
        if shared is None:  # the first on the machine, or the owner died before publishing
            arena = HostArena(sizes, pin=True)
            ...  # load the base into it
            arena_claim.publish(arena, {"fingerprint": fingerprint})
        else:
            arena, meta = shared  # check `meta` names the same base and layout
        ...  # train; the owner serves late-comers until the claim is released

``attach`` also returns ``None`` when no owner of this user can be reached (then ``owner`` stays ``False``):
the process loads a copy of its own and shares nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from types import TracebackType
from typing import Any

from lightning_blockwise.compat.processes import process_exists
from lightning_blockwise.residency.arena import HostArena, meminfo_bytes
from lightning_blockwise.residency.fd_socket import encode, listen, serve, socket_address
from lightning_blockwise.residency.owner_connection import (
    NO_ANSWER,
    NotAnOwnerError,
    connect_to_owner,
    receive_from_owner,
)

log = logging.getLogger(__name__)

#: How long a process tries to reach an owner of its own user on a key's address before it loads a copy of
#: its own (NOTE [ Addresses no other user can take ] in fd_socket.py): a real owner listens from the moment
#: it binds, so only an address bound by someone who never answers stays unreachable this long.
REACH_TIMEOUT_S = 10.0

#: The claims this process owns (a claim lives as long as the copy it serves).
_OWNED: weakref.WeakValueDictionary[str, ArenaClaim] = weakref.WeakValueDictionary()

# How long a peer waits before it connects again when nobody listens on the address yet.
_RETRY_INTERVAL_S = 0.02


# NOTE [ One host copy per machine ]
# Every process that trains the same base on one machine (data-parallel ranks, concurrent jobs) reads
# the same frozen bytes, 36 GB at 72B. One process loads them; the others map its pages.
#
# Why a memfd handed over a socket, not a named POSIX segment: a segment in /dev/shm outlives every
# process that used it. After a SIGKILL (the OOM killer, a scheduler's preemption) nobody unlinks it and
# its 36 GB stay in RAM until someone finds them. The arena's memfd has no name (NOTE [ Arena memory in a
# memfd ] in residency/arena.py): its pages are freed with the last fd and the last mapping, however the
# processes ended. Without a name, the fd reaches other processes over a Unix socket (`socket.send_fds`,
# SCM_RIGHTS). The socket's address is in Linux's abstract namespace, which holds no file and forgets the
# address when its process exits, and `bind` to it is atomic: binding elects the one owner of a key on
# the machine (of a network namespace: containers that do not share one each load their own copy).
#
# Waiting for the owner: it listens from the moment it binds, so peers that connect while it still loads
# wait in its backlog until `publish` serves them. If the owner dies first, their connections reset; each
# peer then tries to bind the address once, so one of them becomes the owner (and loads the base) and the
# others wait for it. A second owner lost the same way is an error: loading is failing, not racing.
#
# Read-only in peers: a peer maps the pages `PROT_READ` and page-locks them with
# `cudaHostRegisterReadOnly`, so a stray write kills that process with SIGSEGV instead of silently
# changing the weights of every job on the machine. The owner keeps the writable mapping it loaded
# through. The pages are not sealed against writes (`F_SEAL_FUTURE_WRITE` needs Linux 5.1, and processes
# of the same user can write each other's memory anyway); their size is sealed, so no peer can make the
# others' reads fault. Only processes of the same user are served, and a peer only accepts memory from one
# (`SO_PEERCRED`, both ways); the uid is in the address too, so users never contend for one, and so is a
# secret of the user's, so that no other user can take it (NOTE [ Addresses no other user can take ] in
# fd_socket.py).
#
# One writer or none: the owner's mapping is writable, and a checkpoint that carries the base would be
# written through it into every peer's weights. The owner counts the peers it served; while any of them
# lives it must not write the copy (`HostCopy.prepare_base_write` in placement.py refuses), and once none
# does it stops serving first, since the copy is about to hold another base than its key names.
#
# The owner exits first: peers keep reading their mappings (the pages live until the last mapping goes),
# but the address is gone with the owner, so a process that claims the key afterwards becomes the owner
# and loads a copy of its own. The machine holds two copies until the older peers finish.


def shmem_bytes() -> int:
    """Bytes of shared memory on the machine (``Shmem`` in ``/proc/meminfo``): where shared arenas are counted.

    Raises:
        RuntimeError: If ``/proc/meminfo`` has no ``Shmem`` line (not Linux).
    """
    shmem = meminfo_bytes("Shmem")
    if shmem is None:
        raise RuntimeError("shmem_bytes: /proc/meminfo has no `Shmem:` line; shared arenas need Linux.")
    return shmem


def owned_here(key: str) -> bool:
    """Whether this process owns ``key``'s copy now (a second load or pack of it here should not map its own)."""
    owner = _OWNED.get(key)
    return owner is not None and owner.owner and owner._listener is not None


def claim(key: str) -> ArenaClaim:
    """Claim the host copy named ``key`` on this machine: own it (load and publish it) or attach to it.

    See NOTE [ One host copy per machine ]. Exactly one process of this user holds a key's claim as
    ``owner`` at a time.

    Args:
        key: What identifies the arena's contents (e.g. the base's fingerprint and the block layout).

    Raises:
        ValueError: If ``key`` is empty.
    """
    if not key:
        raise ValueError("shared_arena.claim: `key` is empty; name the base and layout the arena holds.")
    return ArenaClaim(key)


class ArenaClaim:
    """One process's claim on a shared host copy: the owner publishes its arena, the others attach to it.

    Use :func:`claim` to make one. Releasing the claim (:meth:`release`, or leaving its ``with``
    block) stops the owner serving; arenas already attached stay mapped.

    Attributes:
        key: The key claimed.
        address: Its abstract socket address (:func:`socket_address`).
        owner: Whether this process owns the key: it builds the arena and calls :meth:`publish`.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.address = socket_address(key)
        self._listener = self._bind()
        self.owner = self._listener is not None
        if self.owner:
            _OWNED[key] = self
        self._arena: HostArena | None = None
        self._server: threading.Thread | None = None
        # The pids of the peers served (appended by the serving thread).
        self._served: list[int] = []

    def publish(self, arena: HostArena, meta: dict[str, Any]) -> None:
        """Serve ``arena`` to every process that attaches, from a daemon thread, until :meth:`release`.

        Args:
            arena: The loaded arena; the claim keeps it alive while it serves.
            meta: What peers receive with it to check it is the base and layout they expect (JSON).

        Raises:
            RuntimeError: If this process does not own the key, or already published or released it.
            ValueError: If ``arena`` cannot be shared (no memfd), or ``meta`` is not JSON.
        """
        if not self.owner:
            raise RuntimeError(
                f"ArenaClaim.publish: this process does not hold the claim on {self.key!r}; only the owner"
                " publishes, peers call `attach`."
            )
        if self._listener is None:
            raise RuntimeError(f"ArenaClaim.publish: the claim on {self.key!r} was released; claim the key again.")
        if self._server is not None:
            raise RuntimeError(f"ArenaClaim.publish: the arena of {self.key!r} is already published.")
        if arena.fd is None:
            raise ValueError(
                "ArenaClaim.publish: this arena cannot be shared: it was allocated without `os.memfd_create`"
                " (not Linux) or mapped from another process."
            )
        header = {"sizes": [slab.numel() for slab in arena.slabs], "meta": meta}
        try:
            message = encode(header)
        except (TypeError, ValueError) as error:
            raise ValueError(f"ArenaClaim.publish: `meta` must be JSON: {error}.") from error
        self._arena = arena
        self._server = threading.Thread(
            target=serve,
            args=(self._listener, arena.fd, message, self._served.append),
            name=f"lightning-blockwise arena {self.key}",
            daemon=True,
        )
        self._server.start()

    def peers(self) -> list[int]:
        """The pids of the processes this owner served that still run (they may map its arena)."""
        return [pid for pid in dict.fromkeys(self._served) if process_exists(pid)]

    def attach(
        self, pin: bool, timeout: float, reach_timeout: float | None = None
    ) -> tuple[HostArena, dict[str, Any]] | None:
        """Map the owner's arena read-only, waiting until it is published.

        Returns ``None`` when the owner died before publishing and this claim took its place
        (``owner`` is now ``True``): build the arena and :meth:`publish` it. Returns ``None`` too, with
        ``owner`` still ``False`` and a warning logged, when no process of this user answers on the address
        within ``reach_timeout`` seconds (NOTE [ Addresses no other user can take ] in fd_socket.py): build an
        arena of this process's own and share it with no one; and when the process that answers sends no host copy.

        Args:
            pin: Page-lock the mapping for copies to a CUDA device (``cudaHostRegisterReadOnly``).
            timeout: Seconds to wait for the owner to publish (it may be loading a large base).
            reach_timeout: Seconds to wait for an owner of this user to answer at all (``None``:
                :data:`REACH_TIMEOUT_S`).

        Returns:
            The arena and the ``meta`` the owner published with it (through JSON), or ``None``.

        Raises:
            ValueError: If ``timeout`` is not positive.
            RuntimeError: If this process owns the key, two owners died before publishing, or CUDA refuses to
                page-lock the mapping.
            TimeoutError: If the owner has not published within ``timeout`` seconds.
        """
        if timeout <= 0:
            raise ValueError(f"ArenaClaim.attach(timeout={timeout}): the wait for the owner must be positive.")
        if self.owner:
            raise RuntimeError(
                f"ArenaClaim.attach: this process owns {self.key!r}; build the arena, load it and `publish` it."
            )
        reach_timeout = REACH_TIMEOUT_S if reach_timeout is None else reach_timeout
        deadline = time.monotonic() + timeout
        unreachable_after = time.monotonic() + min(timeout, reach_timeout)
        owners_lost = 0
        holder = None  # another user's process seen on the address (its backlog may be full afterwards)
        while True:
            connection, why = connect_to_owner(self.address, self.key, deadline, timeout, unreachable_after)
            holder = why if why not in (None, NO_ANSWER) else holder
            if connection is None:
                # Nobody of this user listens: the owner is gone (the address is free, take it), has bound the
                # address and not listened yet (microseconds), or someone else holds it and never answers.
                if self._take_over():
                    return None
                if time.monotonic() >= unreachable_after:
                    self._give_up(holder or why, reach_timeout)
                    return None
                time.sleep(_RETRY_INTERVAL_S)
                continue
            with connection:
                try:
                    received = receive_from_owner(connection, self.key, deadline, timeout)
                except NotAnOwnerError as error:  # refused; the copy is loaded here, as without an owner
                    log.warning(f"shared_arena: the host copy {self.key!r}: {error}")
                    return None
            # An owner of this user answered: a new owner, if this one is lost, gets the same bound to answer.
            unreachable_after = time.monotonic() + min(timeout, reach_timeout)
            if received is None:
                # NOTE [ One host copy per machine ]: the owner died before publishing.
                owners_lost += 1
                if owners_lost > 1:
                    raise RuntimeError(
                        f"shared_arena: two processes that owned the host copy {self.key!r} exited before"
                        " publishing it: loading the base fails there. Read their errors, fix the cause and run again."
                    )
                if self._take_over():
                    return None
                continue
            header, fd = received
            try:
                arena = HostArena.from_shared(fd, header["sizes"], pin=pin)
            finally:
                os.close(fd)  # the mapping holds the pages from here on
            return arena, header["meta"]

    def release(self) -> None:
        """Stop serving the arena and free the address (a later claim of the key becomes its owner)."""
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        # On Linux, shutting a listening socket down wakes the `accept` blocked in the serving thread.
        listener.shutdown(socket.SHUT_RDWR)
        if self._server is not None:
            self._server.join()
        listener.close()
        self._arena = None

    def __enter__(self) -> ArenaClaim:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.release()

    def _bind(self) -> socket.socket | None:
        """Listen on the key's address if no process does (this process becomes the owner), else ``None``."""
        return listen(self.address)

    def _take_over(self) -> bool:
        """Become the owner if the address is free (the owner is gone); whether this claim did."""
        listener = self._bind()
        if listener is None:
            return False
        self._listener = listener
        self.owner = True
        _OWNED[self.key] = self
        return True

    def _give_up(self, why: str, reach_timeout: float) -> None:
        """Say that no owner of this user answers, and that this process loads a copy of its own."""
        log.warning(
            f"shared_arena: no process of this user answers on the address of the host copy {self.key!r} within"
            f" {reach_timeout:g} s ({why}); loading a copy of this process's own, shared with no one: host RAM"
            " must hold a second copy of the base."
        )


__all__ = [
    "REACH_TIMEOUT_S",
    "ArenaClaim",
    "claim",
    "owned_here",
    "shmem_bytes",
    "socket_address",
]
