"""residency/sharing.py: a load whose share secret has no private directory falls back to a copy of its own."""

from __future__ import annotations

import os
import pwd
import tempfile
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_blockwise.residency import fd_socket, sharing


@pytest.fixture
def squatted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No home directory to write, and `$TMPDIR/lightning-blockwise-<uid>` made first by another user (uid 4242)."""
    if os.getuid() != 0:
        pytest.skip("making a directory owned by another user needs root (CI runs as root)")
    uid = os.getuid()
    home = tmp_path / "home"
    home.mkdir(mode=0o500)  # not writable: `~/.cache/lightning-blockwise` cannot be made...
    monkeypatch.setattr(pwd, "getpwuid", lambda _: SimpleNamespace(pw_dir=str(home / "nothing-here")))
    monkeypatch.setattr(os, "mkdir", _refuse_under(home, os.mkdir))  # ...even as root, who ignores mode bits
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(fd_socket, "_SECRETS", {})
    squat = tmp_path / f"lightning-blockwise-{uid}"
    squat.mkdir(mode=0o777)
    os.chown(squat, 4242, 4242)
    return squat


def _refuse_under(root: Path, mkdir: object) -> object:
    def refusing(path: object, *args: object, **kwargs: object) -> None:
        if str(path).startswith(str(root)):
            raise PermissionError(13, "Permission denied", str(path))
        mkdir(path, *args, **kwargs)  # type: ignore[operator]

    return refusing


def test_a_squatted_secret_directory_loads_a_copy_of_its_own(squatted: Path) -> None:
    with pytest.warns(UserWarning, match=rf"{squatted}` is not a directory of user.*a host copy of its own"):
        assert sharing.attach_or_own(f"key-{uuid.uuid4().hex}", pin=False) == (None, None)
    # Nothing was written into the other user's directory.
    assert list(squatted.iterdir()) == []


def test_control_the_secret_itself_is_refused_there(squatted: Path) -> None:
    """Without the fallback the load fails: the secret has nowhere safe to live."""
    with pytest.raises(fd_socket.NoPrivateDirectoryError, match="is not a directory of user"):
        fd_socket.share_secret()


def test_control_an_unsquatted_directory_claims_the_key(squatted: Path) -> None:
    os.chown(squatted, os.getuid(), os.getgid())
    taken, arena = sharing.attach_or_own(f"key-{uuid.uuid4().hex}", pin=False)
    try:
        assert taken is not None and taken.owner and arena is None
        assert (squatted / "share-secret").stat().st_mode & 0o777 == 0o600
        assert squatted.stat().st_mode & 0o777 == 0o700  # ours: closed to others before it is trusted
    finally:
        taken.release()
