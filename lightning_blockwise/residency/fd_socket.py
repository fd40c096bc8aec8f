"""A memfd handed to another process of the machine: abstract Unix socket addresses, the message, the credentials.

The transport of a shared host copy (NOTE [ One host copy per machine ] in shared_arena.py): an owner
listens on a key's address and sends every peer of its user one message, a length-prefixed JSON header
with the arena's memfd attached (SCM_RIGHTS).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import struct
from typing import Any

# The length of the JSON header that precedes it, in every message an owner sends.
_LENGTH = struct.Struct("!Q")

# `SO_PEERCRED`'s answer: the pid, uid and gid of the process at the other end of a Unix socket.
_PEER_CREDENTIALS = struct.Struct("3i")


def socket_address(key: str) -> str:
    """The abstract Unix socket address of ``key`` for this user (a leading NUL: no file behind it)."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return f"\0lightning-blockwise/{os.getuid()}/{digest}"


def listen(address: str) -> socket.socket | None:
    """A socket listening on ``address`` if no process does (``bind`` is atomic), else ``None``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            return None
        raise
    # Listening before the arena exists lets peers wait in the backlog while the owner loads.
    listener.listen(socket.SOMAXCONN)
    return listener


def encode(header: dict[str, Any]) -> bytes:
    """The message an owner sends: the JSON ``header``'s length, then the header.

    Raises:
        TypeError, ValueError: If ``header`` is not JSON.
    """
    body = json.dumps(header).encode()
    return _LENGTH.pack(len(body)) + body


def serve(listener: socket.socket, fd: int, message: bytes) -> None:
    """Send every peer of this user that connects ``message`` with ``fd`` attached, until ``listener`` shuts down."""
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return  # the claim's `release` shut the listener down
        with connection:
            try:
                _, uid = peer(connection)
                if uid != os.getuid():
                    continue  # NOTE [ One host copy per machine ]: only this user's processes are served
                sent = socket.send_fds(connection, [message], [fd])
                connection.sendall(message[sent:])
            except OSError:
                continue  # that peer left (timed out, or died) before it was served; serve the others


def receive(connection: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The header and fd an owner sent, or ``None`` if it closed the connection without sending them.

    Raises:
        TimeoutError: If the connection's timeout passes first.
    """
    try:
        data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 1, socket.MSG_CMSG_CLOEXEC)
        if not data or not fds:
            for fd in fds:
                os.close(fd)
            return None
        fd = fds[0]
        # The header may arrive in more than one piece (the owner sends nothing after it).
        while not _complete(data):
            chunk = connection.recv(1 << 16)
            if not chunk:
                os.close(fd)
                return None
            data += chunk
    except ConnectionError:
        return None
    return json.loads(data[_LENGTH.size :]), fd


def peer(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket connection."""
    pid, uid, _ = _PEER_CREDENTIALS.unpack(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    )
    return pid, uid


def _complete(message: bytes) -> bool:
    """Whether ``message`` holds its length and the whole JSON header that length announces."""
    return len(message) >= _LENGTH.size and len(message) >= _LENGTH.size + _LENGTH.unpack_from(message)[0]


__all__ = ["encode", "listen", "peer", "receive", "serve", "socket_address"]
