"""A peer's connection to the owner of a shared host copy: reached within a bound, heard from before a deadline.

The peer side of NOTE [ One host copy per machine ] in shared_arena.py; the transport under it (addresses,
messages, credentials) is fd_socket.py.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from lightning_blockwise.residency.fd_socket import peer, receive

#: Why a peer could not reach an owner, when the address refused its connection.
NO_ANSWER = "it is bound, but no process answers on it"


def connect_to_owner(
    address: str, key: str, deadline: float, timeout: float, unreachable_after: float
) -> tuple[socket.socket, None] | tuple[None, str]:
    """A connection to this user's owner of ``address``, or ``None`` and why there is none.

    Args:
        address: The key's abstract socket address.
        key: The key claimed (for the error).
        deadline: When the wait for the owner to publish ends (``time.monotonic()``).
        timeout: That wait's length in seconds (for the error).
        unreachable_after: When the wait for an owner of this user to answer at all ends.

    Raises:
        TimeoutError: If ``deadline`` has passed with no owner answering.
    """
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # A full backlog blocks `connect`; only an owner that answers earns the longer wait.
        connection.settimeout(max(1e-3, min(unreachable_after, deadline) - time.monotonic()))
        connection.connect(address)
    except (ConnectionRefusedError, BlockingIOError, TimeoutError):
        connection.close()
        _remaining(key, deadline, timeout, owner_pid=None)
        return None, NO_ANSWER
    except BaseException:
        connection.close()
        raise
    pid, uid = peer(connection)
    if uid != os.getuid():
        # NOTE [ One host copy per machine ] in shared_arena.py: never another user's memory.
        connection.close()
        return None, f"process {pid} of user {uid} holds it"
    return connection, None


class NotAnOwnerError(Exception):
    """A process of this user answered on a key's address with something other than a host copy.

    Attributes:
        pid: That process.
        why: What was wrong with its message.
    """

    def __init__(self, pid: int, why: str) -> None:
        super().__init__(
            f"process {pid} of this user answers on its address, but {why}: it is no owner this version of"
            " lightning-blockwise understands (another version, or another program). Loading a copy of this process's"
            f" own, shared with no one: host RAM must hold a second copy of the base. Stop process {pid} to share."
        )
        self.pid, self.why = pid, why


def receive_from_owner(
    connection: socket.socket, key: str, deadline: float, timeout: float
) -> tuple[dict[str, Any], int] | None:
    """The owner's header and memfd, or ``None`` if the owner closed the connection without sending them.

    Raises:
        TimeoutError: If the owner has not sent them by ``deadline``.
        NotAnOwnerError: If what it sent is not an owner's header (another program, or another version of ours).
    """
    owner_pid, _ = peer(connection)
    connection.settimeout(_remaining(key, deadline, timeout, owner_pid))
    try:
        received = receive(connection)
    except TimeoutError:
        raise _timeout_error(key, timeout, owner_pid) from None
    except ValueError as error:
        raise NotAnOwnerError(owner_pid, str(error)) from None
    if received is not None and not _is_header(received[0]):
        os.close(received[1])
        raise NotAnOwnerError(owner_pid, f"its header {str(received[0])[:80]!r} holds no `sizes` list and `meta`")
    return received


def _is_header(header: Any) -> bool:
    """Whether ``header`` is what an owner publishes (``ArenaClaim.publish``): the slab sizes and the meta."""
    sizes = header.get("sizes") if isinstance(header, dict) else None
    return isinstance(sizes, list) and all(type(size) is int for size in sizes) and "meta" in header


def _remaining(key: str, deadline: float, timeout: float, owner_pid: int | None) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timeout_error(key, timeout, owner_pid)
    return remaining


def _timeout_error(key: str, timeout: float, owner_pid: int | None) -> TimeoutError:
    owner = f"its owner, process {owner_pid}," if owner_pid is not None else "no process"
    return TimeoutError(
        f"shared_arena: {owner} has not published the host copy {key!r} within {timeout:g} s."
        " If the owner is still loading the base, wait longer (a larger `timeout`); if it is stuck, stop it"
        " and run again: the first process to claim the key then loads it."
    )


__all__ = ["NO_ANSWER", "NotAnOwnerError", "connect_to_owner", "receive_from_owner"]
