"""Adapter export: atomic, non-destructive, refused early when it would overwrite (NOTE [ Atomic adapter export ])."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel
from safetensors.torch import load_file

from lightning_blockwise.compat.processes import host_name
from lightning_blockwise.export.adapter import check_export_target, export_adapter, previous_export
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from tests.helpers.models import build_model, trainer

ADAPTER = "adapter_model.safetensors"


def _adapter(seed: int) -> PeftModel:
    return build_model("llama", seed=seed)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_export_writes_a_loadable_adapter_and_leaves_no_staging(tmp_path: Path) -> None:
    model = _adapter(0)
    written = export_adapter(model, tmp_path / "adapter")
    assert written == tmp_path / "adapter"
    saved = load_file(written / ADAPTER)
    assert saved and all(
        torch.equal(v, model.state_dict()[k.replace(".weight", ".default.weight")]) for k, v in saved.items()
    )
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]


def test_crash_mid_write_keeps_the_previous_adapter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "adapter"
    export_adapter(_adapter(0), target)
    before = _files(target)

    def crash(self: PeftModel, directory: str, **kwargs: object) -> None:
        (Path(directory) / ADAPTER).write_bytes(b"half an adapter")
        raise OSError("disk full")

    monkeypatch.setattr(PeftModel, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        export_adapter(_adapter(1), target, overwrite=True)
    assert _files(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["adapter"]  # no staging directory left behind


def test_overwrite_replaces_and_control_without_it_keeps_both(tmp_path: Path) -> None:
    target = tmp_path / "adapter"
    export_adapter(_adapter(0), target)
    first = _files(target)
    export_adapter(_adapter(1), target, overwrite=True)
    assert _files(target) != first and sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    # A target that gained files during the run without `overwrite`: the new adapter goes beside it.
    replaced = _files(target)
    with pytest.warns(UserWarning, match="gained files during the run"):
        written = export_adapter(_adapter(2), target)
    assert written != target and written.parent == tmp_path and _files(target) == replaced
    assert (written / ADAPTER).exists()


def test_non_empty_target_is_refused_before_the_model_loads(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "keep.txt").write_text("a previous run's adapter")
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", adapter_dir=str(target))
    with pytest.raises(MisconfigurationException, match="already holds files"):
        trainer("blockwise", max_steps=1).fit(module, [])
    assert module.model is None  # refused before `configure_model` loaded anything
    # Asked to overwrite: only a previous export is replaced, and `keep.txt` is not one.
    with pytest.raises(MisconfigurationException, match=r"holds files that are not a previous export \(keep.txt\)"):
        check_export_target(target, overwrite=True, owner="test")
    with pytest.raises(MisconfigurationException, match="is a file"):
        check_export_target(target / "keep.txt", overwrite=True, owner="test")


def test_previous_exports_are_recognized_by_their_files(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    adapter = export_adapter(_adapter(0), tmp_path / "adapter")
    assert previous_export(adapter) == "adapter"
    assert previous_export(checkpoints["llama"]) is None  # a base checkpoint: config.json without the merge record
    (adapter / "notes.txt").write_text("mine")
    assert previous_export(adapter) is None  # control: one file of someone else's and it is not an export
    (adapter / "notes.txt").unlink()
    (adapter / "sub").mkdir()
    assert previous_export(adapter) is None


def test_a_killed_exports_staging_is_cleaned_at_the_next_start(tmp_path: Path) -> None:
    """NOTE [ Cleaning what is ours ]: a dead process's staging goes; a running one's stays (control)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = host_name()
    stale = tmp_path / f".adapter.{host}-{dead.pid}.abc123.partial"
    retired = tmp_path / f".adapter.{host}-{dead.pid}.def456.old"
    live = tmp_path / f".adapter.{host}-{os.getpid()}.ghi789.partial"
    elsewhere = tmp_path / f".adapter.another-host-{dead.pid}.jkl012.partial"
    for directory in (stale, retired, live, elsewhere):
        directory.mkdir()
        (directory / ADAPTER).write_bytes(b"half an adapter")
    check_export_target(tmp_path / "adapter", overwrite=False, owner="test")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, elsewhere.name])
