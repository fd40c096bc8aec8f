"""A memfd handed to another process of the machine: abstract Unix socket addresses, the message, the credentials.

The transport of a shared host copy (NOTE [ One host copy per machine ] in shared_arena.py): an owner
listens on a key's address and sends every peer of its user one message, a length-prefixed JSON header
with the arena's memfd attached (SCM_RIGHTS). A key's address mixes in a secret of the user's
(:func:`share_secret`), so that no other user can compute it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pwd
import secrets
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_blockwise.compat.processes import host_name

# The length of the JSON header that precedes it, in every message an owner sends.
_LENGTH = struct.Struct("!Q")

# `SO_PEERCRED`'s answer: the pid, uid and gid of the process at the other end of a Unix socket.
_PEER_CREDENTIALS = struct.Struct("3i")


# The file, in a directory only its user can enter, that holds the user's share secret.
_SECRET_FILE = "share-secret"

# NOTE [ Addresses no other user can take ]
# An abstract address is visible to every user of the machine (`/proc/net/unix`) and anyone may bind it.
# Derived from the checkpoint alone, another user could compute the address a load will use and bind it
# first (without listening): every process of ours would then wait for an owner that never answers. So a
# key's address hashes a random secret of the user's with the key: the secret lies in a file of mode 0600
# in a directory of mode 0700 that the user owns (`~/.cache/lightning-blockwise`, else
# `$TMPDIR/lightning-blockwise-<uid>`), and a directory or file that another user owns or can read is
# refused, never trusted. An address seen in `/proc/net/unix` while an owner lives can still be bound by
# another user once that owner has exited; `ArenaClaim.attach` bounds that harm: a process that reaches
# no owner of its own user within `REACH_TIMEOUT_S` says so and loads a copy of its own.


def socket_address(key: str) -> str:
    """The abstract Unix socket address of ``key`` for this user (a leading NUL: no file behind it).

    See NOTE [ Addresses no other user can take ]: the address hashes :func:`share_secret` with ``key``, and with
    the host's name (NOTE [ Simulated hosts ] in compat/processes.py: two simulated nodes on one machine are two
    namespaces, as two machines would be).
    """
    digest = hashlib.sha256(share_secret() + f"{host_name()}\n{key}".encode()).hexdigest()[:32]
    return f"\0lightning-blockwise/{os.getuid()}/{digest}"


def share_secret() -> bytes:
    """This user's secret for shared-copy addresses, made on first use (NOTE [ Addresses no other user can take ]).

    Raises:
        RuntimeError: If no directory of this user's own can hold it, or the file is another user's or readable
            by others.
    """
    uid = os.getuid()
    if uid not in _SECRETS:
        _SECRETS[uid] = _read_or_make_secret(secret_directory() / _SECRET_FILE)
    return _SECRETS[uid]


def secret_directory() -> Path:
    """The directory of mode 0700 this user owns that holds the share secret (created if need be).

    Raises:
        NoPrivateDirectoryError: If neither ``~/.cache/lightning-blockwise`` nor ``$TMPDIR/lightning-blockwise-<uid>``
            can be made one (the second one squatted by another user, say).
    """
    uid = os.getuid()
    candidates = [Path(tempfile.gettempdir()) / f"lightning-blockwise-{uid}"]
    try:
        # The password database, not `$HOME`: every process of the user finds the same directory, whatever its
        # environment (a scheduler's job, a cron line).
        candidates.insert(0, Path(pwd.getpwuid(uid).pw_dir) / ".cache" / "lightning-blockwise")
    except KeyError:
        pass  # a uid without an entry (a container's): the temporary directory only
    problems = []
    for directory in candidates:
        problem = _make_private_directory(directory, uid)
        if problem is None:
            return directory
        problems.append(problem)
    raise NoPrivateDirectoryError(
        f"shared_arena: no directory of this user's own can hold the secret that names shared host copies"
        f" ({'; '.join(problems)}). Remove or fix the directory, or load with `share=False`."
    )


class NoPrivateDirectoryError(RuntimeError):
    """No directory of this user's own can hold the share secret (one squatted by another user, say)."""


# The secret read in this process, by uid (a forked child may change its user).
_SECRETS: dict[int, bytes] = {}


def _make_private_directory(directory: Path, uid: int) -> str | None:
    """Make ``directory`` (mode 0700, owned by ``uid``); why it cannot be one, or ``None`` when it is."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # `lstat`: a link another user planted would lead elsewhere.
        info = directory.lstat()
    except OSError as error:
        return f"`{directory}`: {error.strerror}"
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
        return f"`{directory}` is not a directory of user {uid}"
    if info.st_mode & 0o077:
        os.chmod(directory, 0o700)  # ours: close it (nothing of ours in it is trusted until it is)
    return None


def _read_or_make_secret(path: Path) -> bytes:
    """The secret in ``path``, written first if there is none (atomically: a racing process reads a whole one)."""
    if not path.exists():
        staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(secrets.token_bytes(32))
        try:
            os.link(staged, path)  # fails if another process linked its secret first: read that one
        except FileExistsError:
            pass
        finally:
            staged.unlink()
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())
        if info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise RuntimeError(
                f"shared_arena: the share secret `{path}` belongs to another user or others can read it"
                f" (mode {info.st_mode & 0o777:o}); remove it (a new one is made on the next load)."
            )
        secret = file.read()
    if len(secret) < 16:
        raise RuntimeError(f"shared_arena: the share secret `{path}` is truncated; remove it (a new one is made).")
    return secret


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


def serve(listener: socket.socket, fd: int, message: bytes, served: Callable[[int], None]) -> None:
    """Send every peer of this user that connects ``message`` with ``fd`` attached, until ``listener`` shuts down.

    ``served`` is called with the pid of each peer served.
    """
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            return  # the claim's `release` shut the listener down
        with connection:
            try:
                pid, uid = peer(connection)
                if uid != os.getuid():
                    continue  # NOTE [ One host copy per machine ]: only this user's processes are served
                served(pid)  # before the fd leaves: a peer that got it counts even if the rest fails
                sent = socket.send_fds(connection, [message], [fd])
                connection.sendall(message[sent:])
            except OSError:
                continue  # that peer left (timed out, or died) before it was served; serve the others


def receive(connection: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The header and fd an owner sent, or ``None`` if it closed the connection without sending them.

    Raises:
        TimeoutError: If the connection's timeout passes first.
        ValueError: If the header is not JSON (the fd is closed).
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
    try:
        return json.loads(data[_LENGTH.size :]), fd
    except ValueError as error:  # not JSON, or not UTF-8: whoever answered is no owner of ours
        os.close(fd)
        raise ValueError(f"its header is not JSON ({error})") from None


def peer(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process at the other end of a Unix socket connection."""
    pid, uid, _ = _PEER_CREDENTIALS.unpack(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    )
    return pid, uid


def _complete(message: bytes) -> bool:
    """Whether ``message`` holds its length and the whole JSON header that length announces."""
    return len(message) >= _LENGTH.size and len(message) >= _LENGTH.size + _LENGTH.unpack_from(message)[0]


__all__ = [
    "NoPrivateDirectoryError",
    "encode",
    "listen",
    "peer",
    "receive",
    "secret_directory",
    "serve",
    "share_secret",
    "socket_address",
]
