"""Every YAML in configs/ parses, and CausalLMFineTune (the module they train) trains blockwise on a tiny checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import yaml
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import main
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import CONFIGS as MODEL_CONFIGS
from tests.helpers.models import VOCAB, trainer

ROOT = Path(__file__).resolve().parents[2]
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
    fitter = pl.Trainer(
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
    fitter.fit(module, datamodule=data)

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


def _fit_finetune(module: CausalLMFineTune, strategy: object, tmp_path: Path, steps: int = 2) -> None:
    fitter = trainer(strategy, max_steps=steps, accumulate_grad_batches=1, default_root_dir=tmp_path)
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=8, batch_size=2))


def test_blockwise_loads_straight_into_the_strategys_arena(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Under the blockwise strategy the base comes from `load_blockwise` in the strategy's block size: no repack."""
    strategy = BlockwiseStrategy(block_size=2)
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1)
    with mock.patch("lightning_blockwise.recipes.finetune.load_blockwise", wraps=load_blockwise) as loaded:
        _fit_finetune(module, strategy, tmp_path)
    assert loaded.call_count == 1 and loaded.call_args.kwargs["block_size"] == 2
    base = module.model.get_base_model()
    assert strategy.host_copy is host_copy_of(base)
    assert strategy.host_copy.layer_ranges == (range(0, 2), range(2, 4))


def test_loader_choices(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    standard = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", loader="standard")
    with mock.patch("lightning_blockwise.recipes.finetune.load_blockwise") as loaded:
        _fit_finetune(standard, "blockwise", tmp_path / "standard")
    assert loaded.call_count == 0
    blockwise_only = CausalLMFineTune(str(checkpoints["llama"]), compute_dtype="float32", loader="blockwise")
    with pytest.raises(MisconfigurationException, match="only `BlockwiseStrategy` trains from"):
        _fit_finetune(blockwise_only, "auto", tmp_path / "blockwise-only")
    with pytest.raises(MisconfigurationException, match="choose one of 'auto', 'standard', 'blockwise'"):
        CausalLMFineTune(str(checkpoints["llama"]), loader="fast")


def test_dora_trains_under_blockwise(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """DoRA is no longer refused: its magnitude vectors are adapters, trained blockwise (parity: test_parity.py)."""
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, use_dora=True, compute_dtype="float32")
    _fit_finetune(module, "blockwise", tmp_path)
    magnitudes = {n: p for n, p in module.named_parameters() if "lora_magnitude_vector" in n}
    assert magnitudes and all(p.requires_grad for p in magnitudes.values())


def test_random_init_from_a_config_only(tmp_path: Path) -> None:
    """A directory with nothing but config.json: the real shape, random NF4 weights, trained blockwise."""
    config_dir = tmp_path / "config-only"
    config_dir.mkdir()
    MODEL_CONFIGS["llama"]().save_pretrained(config_dir)
    assert [p.name for p in config_dir.iterdir()] == ["config.json"]
    module = CausalLMFineTune(str(config_dir), lora_r=4, compute_dtype="float32", random_init=True)
    _fit_finetune(module, "blockwise", tmp_path)
    base = module.model.get_base_model()
    assert base.config.num_hidden_layers == MODEL_CONFIGS["llama"]().num_hidden_layers
    assert isinstance(base.model.layers[0].self_attn.q_proj.base_layer, Linear4bit)
