"""A CLI run SIGKILLed while it writes its final adapter, resumed with `fit --ckpt_path`, still writes the adapter.

NOTE [ A resume with nothing to train ] in recipes/finetune.py: the resumed run restores `global_step ==
max_steps`, so Lightning skips `on_train_end`; the adapter is exported from the restored weights at `on_fit_end`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch import Callback
from peft import PeftModel
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
STEPS = 4


class KillWhileExporting(Callback):
    """SIGKILL this process in the middle of writing the adapter: half a file in the staging directory."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        def half_then_die(self: PeftModel, directory: str, **kwargs: Any) -> None:
            (Path(directory) / "adapter_model.safetensors").write_bytes(b"half an adapter")
            os.kill(os.getpid(), signal.SIGKILL)

        PeftModel.save_pretrained = half_then_die  # type: ignore[method-assign]


def _run(root: Path, callbacks: list[dict], ckpt_path: Path | None = None) -> subprocess.CompletedProcess:
    """`lightning-blockwise fit` of the demo for ``STEPS`` steps, everything under ``root``, no logger."""
    override = {
        "trainer": {
            "max_steps": STEPS,
            "enable_checkpointing": True,
            "enable_progress_bar": False,
            "num_sanity_val_steps": 0,
            "default_root_dir": str(root),
            "logger": False,
            "callbacks": callbacks,
        }
    }
    root.mkdir(parents=True, exist_ok=True)
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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_run_killed_while_exporting_writes_its_adapter_when_resumed(tmp_path: Path) -> None:
    whole = _run(tmp_path / "whole", [])
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = load_file(tmp_path / "whole" / "adapter" / "adapter_model.safetensors")

    root = tmp_path / "killed"
    checkpoints = {
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {
            "dirpath": str(root / "checkpoints"),
            "every_n_train_steps": 2,
            "save_top_k": -1,
            "filename": "{step}",
        },
    }
    kill = {"class_path": "tests.cli.test_resume_adapter.KillWhileExporting"}
    killed = _run(root, [checkpoints, kill])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (root / "adapter").exists()
    (partial,) = root.glob(".adapter.*.partial")  # what the kill left behind

    (root / "config.yaml").unlink()  # LightningCLI's record of the killed run, which it will not overwrite
    resumed = _run(root, [], ckpt_path=root / "checkpoints" / f"step={STEPS}.ckpt")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"max_steps={STEPS}` reached" in resumed.stderr + resumed.stdout  # nothing was left to train
    assert not partial.exists()  # cleaned at the next start (NOTE [ Cleaning what is ours ])
    restored = load_file(root / "adapter" / "adapter_model.safetensors")
    assert restored.keys() == expected.keys() and expected
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name
    # Control: the adapter two steps earlier differs, so the comparison sees a stale one.
    earlier = torch.load(root / "checkpoints" / "step=2.ckpt", weights_only=False)["state_dict"]
    lora = {k: v for k, v in earlier.items() if "lora_" in k}
    assert lora and any(not torch.equal(v, restored[_peft_name(k)]) for k, v in lora.items())


def _peft_name(module_key: str) -> str:
    """The adapter file's name of a checkpoint's LoRA parameter (``model.`` prefix, ``.default`` dropped)."""
    return module_key.removeprefix("model.").replace(".default", "")
