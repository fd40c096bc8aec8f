"""Writing full-state checkpoint files: no temporary file left by a killed writer, a full disk said as such.

NOTE [ Temporary checkpoint files ] in checkpoint_files.py.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_blockwise.compat.processes import host_name
from lightning_blockwise.strategy.checkpoint_files import remove_stale_temporaries, save_unbuffered

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
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], cwd=Path(__file__).parents[1])
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
