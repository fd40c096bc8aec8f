"""Whether a loader maps another process's host copy of the base or builds its own, and then serves it.

The two calls a loader makes around building a host arena (``load_blockwise`` and the strategy's
placement): :func:`attach_or_own` before, :func:`serve_or_release` after. The claim they use is in
shared_arena.py (NOTE [ One host copy per machine ]).
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning_blockwise.residency.arena import HostArena
from lightning_blockwise.residency.fd_socket import NoPrivateDirectoryError
from lightning_blockwise.residency.shared_arena import ArenaClaim, claim, owned_here

#: How long a process waits for another one to finish loading or packing the copy it shares (a 72B base
#: loads in about 20 s from a warm page cache on the H100 machine; a cold disk takes minutes).
SHARE_TIMEOUT_S = 3600.0


def attach_or_own(key: str | None, pin: bool) -> tuple[ArenaClaim | None, HostArena | None]:
    """The claim on ``key`` (``None``: not shared, or this process owns it already) and, for a peer, the owner's arena.

    The owner (an arena of ``None``) builds its arena and ends with :func:`serve_or_release`. A process that
    reaches no owner (:meth:`ArenaClaim.attach`) gets ``(None, None)``: it builds a copy of its own, whose host
    RAM its caller checks as for any unshared load.
    """
    if key is None or owned_here(key):
        return None, None
    try:
        taken = claim(key)
    except NoPrivateDirectoryError as error:
        # NOTE [ Addresses no other user can take ] in fd_socket.py: without a directory of our own there is no
        # secret, and an address without one could be taken by another user. Sharing only saves host RAM, so the
        # load goes on with a copy of its own instead of failing (another user squatting `$TMPDIR` must not be
        # able to stop every load of a user without a writable home).
        warnings.warn(f"{error} This process loads a host copy of its own (not shared).", stacklevel=2)
        return None, None
    if taken.owner:
        return taken, None
    attached = taken.attach(pin=pin, timeout=SHARE_TIMEOUT_S)  # None: the owner died first, this process owns
    if attached is None:
        return (taken, None) if taken.owner else (None, None)
    return taken, attached[0]


def serve_or_release(taken: ArenaClaim | None, arena: HostArena, meta: dict[str, Any]) -> ArenaClaim | None:
    """Publish ``arena`` if this process owns the claim (returned: it serves while the copy lives), else release it."""
    if taken is None:
        return None
    if taken.owner:
        taken.publish(arena, meta)
        return taken
    taken.release()
    return None


__all__ = ["SHARE_TIMEOUT_S", "attach_or_own", "serve_or_release"]
