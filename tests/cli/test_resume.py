"""A CLI run killed with SIGKILL mid-epoch and resumed with `fit --ckpt_path` equals the uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
BATCHES_PER_EPOCH = 24  # the demo's 378 training rows in batches of 16
CHECKPOINT_EVERY = 4
RESUME_AT = 28  # a checkpoint mid-epoch in epoch 1
KILL_AT = 30  # two steps after it: their work is lost with the process
TOTAL = 34


def _run(root: Path, callbacks: list[dict], ckpt_path: Path | None = None) -> subprocess.CompletedProcess:
    """`lightning-blockwise fit` on the demo config, its output under ``root``, with ``callbacks`` only."""
    override = {
        "trainer": {
            "max_steps": TOTAL,
            "enable_checkpointing": True,
            "enable_progress_bar": False,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(root),
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(root)}},
            "callbacks": callbacks,
        }
    }
    (root / "override.yaml").parent.mkdir(parents=True, exist_ok=True)
    (root / "override.yaml").write_text(yaml.safe_dump(override))
    args = [
        sys.executable,
        "-m",
        "lightning_blockwise",
        "fit",
        "--config",
        str(DEMO),
        "--config",
        str(root / "override.yaml"),
    ]
    if ckpt_path is not None:
        args.append(f"--ckpt_path={ckpt_path}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _record(directory: Path) -> dict:
    return {"class_path": "tests.helpers.callbacks.RecordLosses", "init_args": {"directory": str(directory)}}


def _losses(directory: Path, steps: range) -> list[torch.Tensor]:
    return [torch.load(directory / f"{step}.pt", weights_only=True) for step in steps]


def _adapter(root: Path) -> dict[str, torch.Tensor]:
    (path,) = root.rglob("adapter_model.safetensors")
    return load_file(path)


def test_sigkilled_cli_run_resumes_exactly(tmp_path: Path) -> None:
    assert BATCHES_PER_EPOCH < RESUME_AT < KILL_AT < TOTAL < 2 * BATCHES_PER_EPOCH
    whole = _run(tmp_path / "whole", [_record(tmp_path / "whole" / "losses")])
    assert whole.returncode == 0, whole.stderr[-3000:]

    checkpoints = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": str(tmp_path / "killed" / "checkpoints"),
            "every_n_train_steps": CHECKPOINT_EVERY,
            "save_top_k": -1,
            "filename": "{step}",
        },
    }
    kill = {"class_path": "tests.helpers.callbacks.KillAt", "init_args": {"step": KILL_AT}}
    killed = _run(tmp_path / "killed", [_record(tmp_path / "killed" / "losses"), checkpoints, kill])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not list((tmp_path / "killed").rglob("adapter_model.safetensors"))  # it died before exporting

    checkpoint = tmp_path / "killed" / "checkpoints" / f"step={RESUME_AT}.ckpt"
    resumed = _run(tmp_path / "resumed", [_record(tmp_path / "resumed" / "losses")], ckpt_path=checkpoint)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    before = range(1, RESUME_AT + 1)
    for a, b in zip(
        _losses(tmp_path / "whole" / "losses", before), _losses(tmp_path / "killed" / "losses", before), strict=True
    ):
        assert torch.equal(a, b)
    after = range(RESUME_AT + 1, TOTAL + 1)
    for step, a, b in zip(
        after,
        _losses(tmp_path / "whole" / "losses", after),
        _losses(tmp_path / "resumed" / "losses", after),
        strict=True,
    ):
        assert torch.equal(a, b), f"step {step}: {a.item()!r} vs {b.item()!r}"
    assert sorted(p.name for p in (tmp_path / "resumed" / "losses").iterdir()) == sorted(f"{s}.pt" for s in after)
    whole_adapter, resumed_adapter = _adapter(tmp_path / "whole"), _adapter(tmp_path / "resumed")
    assert whole_adapter.keys() == resumed_adapter.keys() and whole_adapter
    for name, value in whole_adapter.items():
        assert torch.equal(value, resumed_adapter[name]), name
