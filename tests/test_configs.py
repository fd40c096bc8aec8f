"""Every YAML in configs/ parses, and CausalLMFineTune (the module they train) trains blockwise on a tiny checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import main
from lightning_blockwise.data import SyntheticTokensDataModule
from lightning_blockwise.finetune import CausalLMFineTune
from tests.models import VOCAB

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


def test_the_model_configs_are_there() -> None:
    names = {path.stem for path in CONFIGS}
    assert {"demo", "qwen2.5-7b", "qwen2.5-32b", "qwen2.5-72b", "llama-3.1-8b", "qwen3-32b", "gemma-3-27b"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_with_print_config(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--print_config"])
    assert exit_info.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["trainer"]["strategy"]["class_path"] == "lightning_blockwise.BlockwiseStrategy"
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# Run with:  lightning-blockwise fit --config configs/")
    # Every setting is commented: a `key: value` line (other than a `class_path` right under its commented key)
    # follows a comment line.
    lines = text.splitlines()
    for index, line in enumerate(lines):
        key, _, value = line.strip().partition(": ")
        if value and not key.startswith(("#", "- ")) and key != "class_path":
            assert lines[index - 1].strip().startswith("#"), f"{path.name}:{index + 1} `{line.strip()}` has no comment"


def test_finetune_trains_saves_adapter_only_checkpoints_and_exports(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1)
    trainer = pl.Trainer(
        strategy=BlockwiseStrategy(block_size=2),
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    data = SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=8, batch_size=2)
    trainer.fit(module, datamodule=data)

    (saved,) = (tmp_path / "checkpoints").glob("*.ckpt")
    state = torch.load(saved, weights_only=False)["state_dict"]
    trained = {name: p.detach().clone() for name, p in module.named_parameters() if p.requires_grad}
    assert state.keys() == trained.keys() and all("lora_" in name for name in state)

    # Back into a fresh module over a freshly loaded base (Lightning calls `configure_model` before loading the
    # state): non-strict, the adapters come back as trained.
    fresh = CausalLMFineTune.load_from_checkpoint(saved)
    for name, value in trained.items():
        assert torch.equal(dict(fresh.named_parameters())[name], value), name

    base = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    exported = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert exported.peft_config["default"].r == 4


def test_dora_is_refused_under_blockwise(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    module = CausalLMFineTune(str(checkpoints["llama"]), use_dora=True)
    trainer = pl.Trainer(strategy="blockwise", accelerator="cpu", max_steps=1, logger=False, default_root_dir=tmp_path)
    with pytest.raises(Exception, match="DoRA has not passed the blockwise parity"):
        trainer.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB))
