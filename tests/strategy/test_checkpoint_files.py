"""Writing full-state checkpoint files: no temporary file left by a killed writer, a full disk said as such.

NOTE [ Temporary checkpoint files ] in checkpoint_files.py.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.processes import host_name
from lightning_blockwise.strategy.checkpoint_files import remove_stale_temporaries, save_unbuffered
from tests.helpers.models import CausalLMModule, build_model, loader, padded_batches, trainer

# A writer killed halfway through its temporary file, as SIGKILL or the OOM killer would.
_KILLED_WRITER = """
import os, signal, sys, torch
from pathlib import Path
from lightning_blockwise.strategy.checkpoint_files import save_unbuffered

def half_then_die(obj, name):
    with open(name, "wb") as f:
        f.write(b"PK" + bytes(1 << 20))
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = half_then_die
save_unbuffered({"x": 1}, Path(sys.argv[1]))
"""


def _killed_write(path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=Path(__file__).parents[2])
    assert done.returncode == -signal.SIGKILL


def test_a_killed_writers_temporary_file_is_removed_at_the_next_save(tmp_path: Path) -> None:
    """Control: the killed write does leave its temporary file (as large as what it wrote) until the next save."""
    _killed_write(tmp_path / "step=4.ckpt")
    (left,) = tmp_path.glob(".step=4.ckpt.*.tmp")
    assert left.stat().st_size > 1 << 20 and not (tmp_path / "step=4.ckpt").exists()
    save_unbuffered({"y": torch.ones(2)}, tmp_path / "step=8.ckpt")
    assert not left.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=8.ckpt"]
    assert torch.equal(torch.load(tmp_path / "step=8.ckpt")["y"], torch.ones(2))


def test_only_dead_writers_of_this_host_are_cleaned(tmp_path: Path) -> None:
    """A live writer's file, another host's, and files named otherwise are left alone."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    host = host_name()
    names = {
        "dead": f".a.ckpt.{host}-{dead_pid}.abc_123.tmp",
        "live": f".a.ckpt.{host}-{os.getpid()}.abc_123.tmp",
        "other host": f".a.ckpt.otherhost-{dead_pid}.abc_123.tmp",
        "not ours": ".a.ckpt.x1y2z3.tmp",
        "user file": "notes.tmp",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_temporaries(tmp_path) == [tmp_path / names["dead"]]
    assert {p.name for p in tmp_path.iterdir()} == set(names.values()) - {names["dead"]}


def _failing_save(message: str) -> Any:
    def save(obj: Any, name: str) -> None:
        Path(name).write_bytes(b"PK partial")
        raise RuntimeError(message)

    return save


def test_a_full_disk_names_the_path_and_says_no_space_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's writer says only `basic_ios::clear: iostream error`; the error names the file and the full disk."""
    monkeypatch.setattr(torch, "save", _failing_save("basic_ios::clear: iostream error"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 4096, 4096))
    target = tmp_path / "step=4.ckpt"
    with pytest.raises(OSError, match=r"No space left .* checkpoint .*step=4\.ckpt \(0\.00 GB free\)") as raised:
        save_unbuffered({"x": 1}, target)
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == [], "the partial temporary file is removed"


def test_control_another_write_error_is_not_called_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "save", _failing_save("basic_ios::clear: iostream error"))
    with pytest.raises(OSError, match=r"Could not write the checkpoint .*step=4\.ckpt: basic_ios") as raised:
        save_unbuffered({"x": 1}, tmp_path / "step=4.ckpt")
    assert "No space" not in str(raised.value)


def _bad_files(root: Path) -> dict[str, Path]:
    """An empty file, a truncated checkpoint, a bare state dict, and a file of another format."""
    root.mkdir(parents=True, exist_ok=True)
    good = root / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64)}, "global_step": 1, "pytorch-lightning_version": "2.6"}, good)
    files = {"empty": root / "empty.ckpt", "truncated": root / "truncated.ckpt", "foreign": root / "foreign.ckpt"}
    files["empty"].write_bytes(b"")
    files["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torch.save({"model.w": torch.ones(2)}, files["foreign"])
    files["text"] = root / "notes.ckpt"
    files["text"].write_text("not a checkpoint\n")
    return files


@pytest.mark.parametrize(
    ("kind", "says"),
    [("empty", "is empty"), ("truncated", "truncated"), ("foreign", "is not a Lightning checkpoint"),
     ("text", "truncated")],
)  # fmt: skip
def test_a_bad_ckpt_path_is_refused_naming_the_file(tmp_path: Path, kind: str, says: str) -> None:
    """`Trainer.fit(ckpt_path=...)` under the strategy names the file and the problem (not EOFError, KeyError: 101)."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_blockwise import BlockwiseStrategy
    from tests.helpers.models import CausalLMModule, build_model, loader, padded_batches, trainer

    path = _bad_files(tmp_path)[kind]
    module = CausalLMModule(lambda: build_model("llama"), in_configure_model=True)
    with pytest.raises(MisconfigurationException, match=rf"`ckpt_path` '.*{path.name}'.*{says}"):
        trainer(BlockwiseStrategy()).fit(module, loader(padded_batches(2)), ckpt_path=path)


def test_control_a_good_checkpoint_file_passes_the_check(tmp_path: Path) -> None:
    from lightning_blockwise.strategy.checkpoint_files import check_checkpoint_file

    _bad_files(tmp_path)
    check_checkpoint_file(tmp_path / "good.ckpt")


@pytest.fixture
def full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder on a disk that fills halfway through any checkpoint written into it, on another file system than
    the system's temporary directory (fsspec, under Lightning's write, stages the file there and moves it).

    Every write of a file into the folder stores half its bytes and raises ``OSError(ENOSPC)``: ``torch.save`` to a
    path there, and the copy a move across file systems makes (``os.rename`` from outside raises ``EXDEV``).
    """
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    real_save, real_rename = torch.save, os.rename

    def half_then_full(data: bytes, name: Any) -> None:
        Path(name).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(name))

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(f, (str, os.PathLike)) or Path(f).parent != folder:
            return real_save(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real_save(obj, buffer)
        half_then_full(buffer.getvalue(), f)

    def rename(source: Any, target: Any) -> None:
        if Path(target).parent == folder and Path(source).parent != folder:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        real_rename(source, target)

    def copyfile(source: Any, target: Any, **kwargs: Any) -> Any:
        half_then_full(Path(source).read_bytes(), target)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "copyfile", copyfile)
    return folder


def _lean_fitted(strategy: Any) -> pl.Trainer:
    module = CausalLMModule(lambda: build_model("llama"), in_configure_model=True)
    fitted = trainer(strategy, max_steps=1)
    fitted.fit(module, loader(padded_batches(2)))
    return fitted


def test_a_lean_save_on_a_full_disk_leaves_no_file_under_its_name(full_disk: Path) -> None:
    """A full disk mid-write: the error names the file, and the name keeps what it held (here: nothing)."""
    fitted = _lean_fitted(BlockwiseStrategy())
    assert not fitted.strategy.options.save_frozen_base
    with pytest.raises(OSError, match=r"No space left on the device to write the checkpoint .*last\.ckpt") as raised:
        fitted.save_checkpoint(full_disk / "last.ckpt")
    assert raised.value.errno == errno.ENOSPC
    assert list(full_disk.iterdir()) == [], "no truncated file under the final name, no temporary file left"


def test_control_lightnings_own_write_leaves_a_truncated_file(full_disk: Path) -> None:
    """The same module and disk under `strategy="auto"` (Lightning's `TorchCheckpointIO`): the move into place is a
    copy, and the full disk leaves half a checkpoint under the final name, which the test above would see."""
    fitted = _lean_fitted("auto")
    with pytest.raises(OSError):
        fitted.save_checkpoint(full_disk / "last.ckpt")
    assert (full_disk / "last.ckpt").stat().st_size > 0 and not zipfile.is_zipfile(full_disk / "last.ckpt")


def test_a_checkpoint_is_readable_as_a_plain_file_would_be(tmp_path: Path) -> None:
    """The temporary file is created with 0o666 less the umask, as Lightning's write does (`mkstemp` gave 0o600)."""
    umask = os.umask(0o022)
    try:
        save_unbuffered({"x": torch.ones(1)}, tmp_path / "a.ckpt")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.ckpt").stat().st_mode & 0o777 == 0o644
    # Control: the mode `mkstemp` gives.
    handle, name = tempfile.mkstemp(dir=tmp_path)
    os.close(handle)
    assert Path(name).stat().st_mode & 0o777 == 0o600
