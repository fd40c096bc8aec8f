"""Zoo: a user's own LightningModule trained through a command line (issue 42, item 5).

``tests/zoo/cli_client.py`` holds a user's module and data module. Each is run through Lightning's own
``LightningCLI(UserLoRA, UserData)``, as the user's script would, with ``--trainer.strategy=auto`` and
``--trainer.strategy=blockwise``, and through ``lightning-blockwise fit --model tests.zoo.cli_client.UserLoRA``
(our CLI takes any module by class path); all three runs are compared with ``torch.equal`` in every loss, gradient,
trained tensor, optimizer state, logged metric and file name (tests/zoo/harness.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise.cli import build_cli
from tests.zoo.cli_client import UserData, UserLoRA
from tests.zoo.harness import Recorder, ZooRun, assert_same, assert_sees_each_field, collect


def _arguments(base: Path, strategy: str, root: Path) -> list[str]:
    """``fit`` with the zoo's Trainer settings (tests/zoo/harness.py) as command-line flags, a recorder first."""
    return [
        "fit",
        "--seed_everything=0",
        f"--model.base={base}",
        "--model.rank=8",
        f"--trainer.strategy={strategy}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.max_steps=3",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.num_sanity_val_steps=0",
        f"--trainer.default_root_dir={root}",
        "--trainer.callbacks=tests.zoo.harness.Recorder",
    ]


def _collected(cli: Any, root: Path) -> ZooRun:
    """The run of ``cli``, read through its recorder (put first, where :func:`collect` reads it)."""
    trainer = cli.trainer
    trainer.callbacks.sort(key=lambda callback: not isinstance(callback, Recorder))
    return collect(trainer, root)


def test_user_module_through_lightning_cli_and_ours(zoo_base: Path, tmp_path: Path) -> None:
    runs = []
    for strategy in ("auto", "blockwise"):
        root = tmp_path / f"lightning-{strategy}"
        runs.append(_collected(LightningCLI(UserLoRA, UserData, args=_arguments(zoo_base, strategy, root)), root))
    # Ours: the module and data named by class path, under the Trainer flags a user gives Lightning's.
    root = tmp_path / "ours-blockwise"
    ours = _arguments(zoo_base, "blockwise", root)
    ours[2:4] = [
        "--model=tests.zoo.cli_client.UserLoRA",
        f"--model.base={zoo_base}",
        "--model.rank=8",
        "--data=tests.zoo.cli_client.UserData",
    ]
    cli = build_cli(ours)
    assert type(cli.trainer.strategy).__name__ == "BlockwiseStrategy" and type(cli.model) is UserLoRA
    runs.append(_collected(cli, root))
    assert runs[0].files == ["checkpoints/epoch=0-step=3.ckpt", "config.yaml"]
    assert runs[0].weights["model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"].shape[0] == 8
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])
    assert_sees_each_field(runs[0])
