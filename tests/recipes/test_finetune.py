"""Every YAML in configs/ parses, and CausalLMFineTune (the module they train) trains blockwise on a tiny checkpoint."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import yaml
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel
from peft.tuners.lora.dora import DoraLinearLayer
from safetensors.torch import load_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.adapters.dora_norm import FactoredDoraNorm
from lightning_blockwise.cli import build_cli, main
from lightning_blockwise.compat.processes import host_name
from lightning_blockwise.export.adapter import export_adapter
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.longcontext.attention import tiled_attention_tokens
from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from lightning_blockwise.longcontext.tiling import TiledMLP
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.chat import save_adapter
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


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_logs_the_learning_rate_and_picks_its_logger(path: Path) -> None:
    trainer_config = yaml.safe_load(path.read_text(encoding="utf-8"))["trainer"]
    # Every config trains a module with a warmup-cosine schedule: its learning rate is logged every logged step.
    monitor = {
        "class_path": "lightning.pytorch.callbacks.LearningRateMonitor",
        "init_args": {"logging_interval": "step"},
    }
    assert monitor in trainer_config["callbacks"]
    if path.stem == "demo":
        # CSV whatever is installed: examples/README.md and the demo's tests read its metrics.csv.
        assert trainer_config["logger"]["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    else:
        # Lightning's default logger: TensorBoard when `tensorboard` or `tensorboardX` is installed, else CSV.
        assert trainer_config["logger"] is True


def test_model_config_logs_to_tensorboard_when_installed_else_to_csv(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    args = [
        "--config",
        str(ROOT / "configs" / "qwen2.5-7b.yaml"),
        f"--model.init_args.checkpoint={checkpoints['llama']}",
    ]
    args += ["--data.init_args.tokenizer=null", "--trainer.accelerator=cpu", "--trainer.precision=32-true"]
    cli = build_cli([*args, f"--trainer.default_root_dir={tmp_path}"], run=False)
    tensorboard = any(importlib.util.find_spec(name) is not None for name in ("tensorboard", "tensorboardX"))
    assert type(cli.trainer.logger) is (TensorBoardLogger if tensorboard else CSVLogger)
    assert Path(cli.trainer.log_dir).parent == tmp_path / "lightning_logs"
    assert sum(isinstance(callback, LearningRateMonitor) for callback in cli.trainer.callbacks) == 1


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
    fitter.fit(module, datamodule=_tokens())


def _tokens() -> SyntheticTokensDataModule:
    """4 batches of 2 x 12 random tokens."""
    return SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=8, batch_size=2)


def test_blockwise_loads_straight_into_the_strategys_arena(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Under the blockwise strategy the base comes from `load_blockwise` in the strategy's block size: no repack."""
    strategy = BlockwiseStrategy(block_size=2)
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1)
    with mock.patch("lightning_blockwise.recipes.finetune_model.load_blockwise", wraps=load_blockwise) as loaded:
        _fit_finetune(module, strategy, tmp_path)
    assert loaded.call_count == 1 and loaded.call_args.kwargs["block_size"] == 2
    base = module.model.get_base_model()
    assert strategy.host_copy is host_copy_of(base)
    assert strategy.host_copy.layer_ranges == (range(0, 2), range(2, 4))


def test_loader_choices(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    standard = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", loader="standard")
    with mock.patch("lightning_blockwise.recipes.finetune_model.load_blockwise") as loaded:
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


def test_dora_norm_factored_is_applied_and_other_values_are_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(MisconfigurationException, match=r"^CausalLMFineTune\(dora_norm='fast'\): choose 'dense' or"):
        CausalLMFineTune("/no/such/checkpoint", use_dora=True, dora_norm="fast")
    module = CausalLMFineTune(
        str(checkpoints["llama"]), lora_r=4, use_dora=True, dora_norm="factored", compute_dtype="float32"
    )
    _fit_finetune(module, "blockwise", tmp_path)
    dora = [m for m in module.modules() if type(m) is DoraLinearLayer]
    assert dora and all(isinstance(vars(m).get("forward"), FactoredDoraNorm) for m in dora)
    assert all(m.forward.base_sq is not None for m in dora)
    # Control arm: the default keeps PEFT's dense norm.
    dense = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, use_dora=True, compute_dtype="float32")
    _fit_finetune(dense, "blockwise", tmp_path / "dense")
    assert not any("forward" in vars(m) for m in dense.modules() if type(m) is DoraLinearLayer)


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


#: The long-context options of the tests below: a micro-batch of 2 x 12 tokens has 22 labelled rows (5 chunks of
#: the loss, the last one short) and runs each MLP in 5 tiles (the last one short).
CHUNK, TILE = 4, 5


class _Losses(pl.Callback):
    """Every training step's loss."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach().clone())


def _long_context_run(checkpoint: Path, strategy: object, tmp_path: Path, seed: int = 0, **options: Any) -> Tensor:
    """The losses of 3 steps of a seeded CausalLMFineTune run with ``options``, LoRA dropout on."""
    pl.seed_everything(seed, verbose=False)
    module = CausalLMFineTune(str(checkpoint), lora_r=4, compute_dtype="float32", warmup_steps=1, **options)
    losses = _Losses()
    fitter = trainer(strategy, max_steps=3, accumulate_grad_batches=1, default_root_dir=tmp_path, callbacks=[losses])
    fitter.fit(module, datamodule=_tokens())
    return torch.stack(losses.losses)


def _planned_options(strategy: BlockwiseStrategy) -> tuple[int | None, int | None]:
    """The loss chunk and MLP tile the strategy's plan was made for."""
    assert strategy.step_plan is not None
    return strategy.step_plan.shape.loss_chunk_tokens, strategy.step_plan.shape.mlp_tile_tokens


def test_long_context_options_are_planned_for_and_applied(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    strategy = BlockwiseStrategy()
    module = CausalLMFineTune(
        str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", loss_chunk_tokens=CHUNK, mlp_tile_tokens=TILE
    )
    assert (module.hparams.loss_chunk_tokens, module.hparams.mlp_tile_tokens) == (CHUNK, TILE)
    # A validation batch after each of the 2 training steps: both kinds of step use the module's loss.
    fitter = trainer(
        strategy, max_steps=2, accumulate_grad_batches=1, limit_val_batches=1, val_check_interval=1,
        default_root_dir=tmp_path,
    )  # fmt: skip
    with mock.patch(
        "lightning_blockwise.recipes.finetune_loss.chunked_causal_lm_loss", wraps=chunked_causal_lm_loss
    ) as loss:
        fitter.fit(module, datamodule=_tokens())
    # The planner read the module's attributes: it plans CHUNK rows of logits and MLP tiles of TILE tokens.
    assert _planned_options(strategy) == (CHUNK, TILE)
    # The module really uses them: every training and validation loss is the chunked one, every MLP is tiled.
    assert loss.call_count == 2 + 2 and all(call.kwargs["chunk_tokens"] == CHUNK for call in loss.call_args_list)
    layers = module.model.get_base_model().model.layers
    assert all(isinstance(vars(layer.mlp).get("forward"), TiledMLP) for layer in layers)
    assert {layer.mlp.forward.tile_tokens for layer in layers} == {TILE}
    # Control arm: without the options, nothing is tiled and the planner plans Hugging Face's loss.
    plain_strategy = BlockwiseStrategy()
    plain = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32")
    _fit_finetune(plain, plain_strategy, tmp_path / "plain")
    assert _planned_options(plain_strategy) == (None, None)
    assert not any("forward" in vars(layer.mlp) for layer in plain.model.get_base_model().model.layers)


@pytest.mark.parametrize("name", ["loss_chunk_tokens", "mlp_tile_tokens", "attention_tile_tokens"])
@pytest.mark.parametrize("value", [0, -1, 2.5, True, "1024"])
def test_long_context_options_must_be_positive_integers(name: str, value: Any) -> None:
    # Refused by the constructor, before any trainer or model work (the checkpoint does not even exist).
    message = rf"^CausalLMFineTune\({name}={re.escape(repr(value))}\) must be an integer of at least 1 \(e\.g\. "
    with pytest.raises(MisconfigurationException, match=message):
        CausalLMFineTune("/no/such/checkpoint", **{name: value})
    # Control arm: None (off) and a positive integer are taken.
    assert getattr(CausalLMFineTune("/no/such/checkpoint", **{name: 1}), name) == 1
    assert getattr(CausalLMFineTune("/no/such/checkpoint", **{name: None}), name) is None


def test_long_context_module_blockwise_equals_resident(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    options = dict(loss_chunk_tokens=CHUNK, mlp_tile_tokens=TILE)
    resident = _long_context_run(checkpoints["llama"], "auto", tmp_path / "auto", **options)
    blockwise = _long_context_run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "blockwise", **options)
    assert torch.equal(resident, blockwise), f"{resident.tolist()} vs {blockwise.tolist()}"
    # Control arms: each option is part of the function the module trains, so the module without either of them
    # (or both) trains to other losses on the CPU. A run that silently dropped the chunked loss or the tiling would
    # fail the comparison above. (Whether the first loss, the base's, already differs depends on the CPU: a tile's
    # matmul has fewer rows, and some CPUs' kernels round a row differently with another row count.)
    for kept in ({"loss_chunk_tokens": CHUNK}, {"mlp_tile_tokens": TILE}, {}):
        other = _long_context_run(checkpoints["llama"], "auto", tmp_path / f"only-{'-'.join(kept)}", **kept)
        assert torch.allclose(other, resident, rtol=1e-4) and not torch.equal(other, resident), f"{kept}: {other}"


def test_attention_tiles_are_planned_for_applied_and_trained_exactly(
    llama_no_attention_dropout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[CausalLMFineTune] = []
    on_fit_start = CausalLMFineTune.on_fit_start
    monkeypatch.setattr(CausalLMFineTune, "on_fit_start", lambda self: (built.append(self), on_fit_start(self)))

    def run(strategy: object, name: str, **options: Any) -> list[Tensor]:
        losses = _long_context_run(llama_no_attention_dropout, strategy, tmp_path / name, **options)
        return [losses, *(p.detach().clone() for p in built[-1].parameters() if p.requires_grad)]

    # Rows of 12 tokens in attention tiles of 5 queries; with the MLP tiled too (the two tilings are independent).
    options = dict(attention_tile_tokens=TILE, mlp_tile_tokens=TILE)
    strategy = BlockwiseStrategy()
    blockwise = run(strategy, "blockwise", **options)
    assert strategy.step_plan is not None and strategy.step_plan.shape.attention_tile_tokens == TILE  # the planner's
    assert tiled_attention_tokens(built[-1].model) == TILE  # the model's
    resident = run("auto", "auto", **options)
    assert len(resident) > 1 and all(torch.equal(a, b) for a, b in zip(resident, blockwise, strict=True))
    # Control: the tiles are part of the function; without them the module trains other adapters (within rounding:
    # the losses of 3 steps on this tiny model may even agree).
    untiled = run("auto", "untiled", mlp_tile_tokens=TILE)
    assert not all(torch.equal(a, b) for a, b in zip(untiled, resident, strict=True))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(untiled, resident, strict=True))


def test_attention_tiles_refuse_attention_dropout_and_packed_batches(checkpoints: dict[str, Path]) -> None:
    # The tests' Llama has attention dropout 0.1: refused from its config before the base loads, naming the fix.
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", attention_tile_tokens=TILE)
    never = mock.Mock(side_effect=AssertionError("the base was loaded before the refusal"))
    with mock.patch("lightning_blockwise.recipes.finetune_build.load_base", never):
        with pytest.raises(MisconfigurationException, match=r"attention_tile_tokens=5\): .*attention_dropout=0\.0"):
            module.configure_model()
        # A data module that packs its rows: refused before the base loads too, even with a config without dropout.
        packing = SimpleNamespace(hparams={"packing": True})  # a data module's hparams are a mapping
        trainer = SimpleNamespace(datamodule=packing, strategy=SimpleNamespace(root_device=torch.device("cpu")))
        module._trainer = trainer  # type: ignore[assignment]
        with pytest.raises(MisconfigurationException, match=r"packs its rows \(`packing=True`\).*Turn off"):
            module.configure_model()
        module._trainer = None
    assert not never.called
    # Control: with the config's attention dropout checked at the model too, the base does load and tiling refuses.
    with pytest.raises(MisconfigurationException, match=r"attention_tile_tokens=5\): .*attention_dropout=0\.0"):
        with mock.patch("lightning_blockwise.recipes.finetune_build.check_attention_tiles"):
            module.configure_model()
    ids = torch.randint(1, VOCAB, (1, 12))
    packed = {
        "input_ids": ids,
        "labels": ids,
        "position_ids": torch.tensor([[*range(7), *range(5)]]),
        "use_cache": False,
    }
    with pytest.raises(MisconfigurationException, match=r"packed batches need a mask.*Turn off the data module's"):
        module._loss(packed)


def test_dense_base_trains_blockwise_equal_to_resident(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """`quantize=False`: `load_blockwise(quantize=False)` under the strategy, `from_pretrained` resident; same losses.

    Control: the NF4 base of the same checkpoint gives other losses, so the comparison can see the base.
    """
    strategy = BlockwiseStrategy(block_size=2)
    with mock.patch("lightning_blockwise.recipes.finetune_model.load_blockwise", wraps=load_blockwise) as loaded:
        blockwise = _long_context_run(checkpoints["llama"], strategy, tmp_path / "b", quantize=False)
    assert loaded.call_args.kwargs["quantize"] is False
    base = strategy.lightning_module.model.get_base_model()
    assert not any(isinstance(m, Linear4bit) for m in base.modules()) and host_copy_of(base) is strategy.host_copy
    resident = _long_context_run(checkpoints["llama"], "auto", tmp_path / "r", quantize=False)
    assert len(blockwise) == 3 and torch.equal(blockwise, resident)
    nf4 = _long_context_run(checkpoints["llama"], "auto", tmp_path / "nf4")
    assert not torch.equal(nf4, resident)


def test_dense_option_from_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    """The option is a YAML key like the others (`model.init_args.quantize`), parsed by LightningCLI."""
    config = ROOT / "configs" / "qwen3-32b.yaml"
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--model.init_args.quantize=false", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["quantize"] is False
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--model.init_args.quantize=sometimes", "--print_config"])


def test_random_init_dense(tmp_path: Path) -> None:
    """`random_init` with `quantize=False`: a dense random model of the config's shape, trained blockwise."""
    config_dir = tmp_path / "config-only"
    MODEL_CONFIGS["llama"]().save_pretrained(config_dir)
    module = CausalLMFineTune(str(config_dir), lora_r=4, compute_dtype="float32", random_init=True, quantize=False)
    _fit_finetune(module, "blockwise", tmp_path)
    q_proj = module.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("quantize", [True, False], ids=["nf4", "dense"])
def test_random_init_trains_the_same_run_under_every_strategy(tmp_path: Path, quantize: bool) -> None:
    """`random_init` builds the base in the host arena under blockwise and on the device otherwise: the same bytes
    and the same RNG state after, so the adapters' init and the dropout masks match (blockwise == resident).

    Control: the resident run seeded otherwise differs.
    """
    config_dir = tmp_path / "config-only"
    MODEL_CONFIGS["llama"]().save_pretrained(config_dir)
    options = {"random_init": True, "quantize": quantize}
    resident = _long_context_run(config_dir, "auto", tmp_path / "auto", **options)
    blockwise = _long_context_run(config_dir, BlockwiseStrategy(), tmp_path / "blockwise", **options)
    assert torch.equal(resident, blockwise), (resident, blockwise)
    other = _long_context_run(config_dir, "auto", tmp_path / "other", seed=1, **options)
    assert not torch.equal(resident, other)


def test_a_resume_with_nothing_left_to_train_exports_the_restored_adapter(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """NOTE [ A resume with nothing to train ]: a run resumed at `max_steps` (its export lost) still exports.

    Control: the resumed fit really skipped training (`on_train_end` never ran), and its adapter is the
    checkpoint's, not the fresh module's.
    """
    first = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1)
    _fit_finetune(first, BlockwiseStrategy(), tmp_path / "first", steps=2)
    first.trainer.save_checkpoint(tmp_path / "last.ckpt")
    expected = load_file(tmp_path / "first" / "adapter" / "adapter_model.safetensors")

    resumed = CausalLMFineTune(
        str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1, adapter_dir=str(tmp_path / "out")
    )
    train_ends = []
    resumed.on_train_end = lambda: train_ends.append(1)  # type: ignore[method-assign]
    fitter = trainer(BlockwiseStrategy(), max_steps=2, accumulate_grad_batches=1, default_root_dir=tmp_path / "again")
    fitter.fit(resumed, datamodule=_tokens(), ckpt_path=tmp_path / "last.ckpt")
    assert train_ends == [] and fitter.global_step == 2
    restored = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert restored.keys() == expected.keys() and expected
    for name, value in expected.items():
        assert torch.equal(restored[name], value), name
    fresh = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32")
    fresh.configure_model()
    export_adapter(fresh.model, tmp_path / "fresh")
    untrained = load_file(tmp_path / "fresh" / "adapter_model.safetensors")
    assert any(not torch.equal(untrained[name], value) for name, value in expected.items())


def _evaluated(checkpoint: Path, strategy: object, tmp_path: Path, adapter: Path) -> tuple[Tensor, Tensor]:
    """``val_loss`` and ``test_loss`` of the recipe started from ``adapter``, on two batches each."""
    module = CausalLMFineTune(str(checkpoint), lora_r=4, compute_dtype="float32", adapter_path=str(adapter))
    evaluator = trainer(strategy, limit_val_batches=2, limit_test_batches=2, default_root_dir=tmp_path)
    evaluator.validate(module, datamodule=_tokens())
    val = evaluator.callback_metrics["val_loss"].clone()
    # The training batches as the test set (the data module has none of its own).
    evaluator.test(module, dataloaders=_tokens().train_dataloader())
    return val, evaluator.callback_metrics["test_loss"].clone()


def test_adapter_path_continues_validates_and_tests_as_resident(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """`adapter_path`: training continues from the exported adapter, and `validate`/`test` score it, exactly.

    Controls: fresh adapters train to other losses, and another adapter scores other losses.
    """
    adapter = save_adapter(checkpoints["llama"], tmp_path / "adapter", seed=1)
    other = save_adapter(checkpoints["llama"], tmp_path / "other", seed=2)
    resident = _long_context_run(checkpoints["llama"], "auto", tmp_path / "r", adapter_path=str(adapter))
    blockwise = _long_context_run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "b", adapter_path=str(adapter))
    assert len(resident) == 3 and torch.equal(resident, blockwise), f"{resident.tolist()} vs {blockwise.tolist()}"
    fresh = _long_context_run(checkpoints["llama"], "auto", tmp_path / "fresh")
    assert not torch.equal(fresh[0], resident[0])

    scores = _evaluated(checkpoints["llama"], "auto", tmp_path / "ve", adapter)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            scores, _evaluated(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "vb", adapter), strict=True
        )
    )
    assert not any(
        torch.equal(a, b)
        for a, b in zip(scores, _evaluated(checkpoints["llama"], "auto", tmp_path / "vo", other), strict=True)
    )


def test_adapter_path_takes_the_adapters_shape(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """The adapter's config decides rank, alpha and targets; its weights are the saved ones, trainable."""
    adapter = save_adapter(checkpoints["llama"], tmp_path / "adapter", seed=1)
    module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=8, compute_dtype="float32", adapter_path=str(adapter))
    module.configure_model()
    config = module.model.peft_config["default"]
    assert (config.r, config.lora_alpha, sorted(config.target_modules)) == (4, 16, ["down_proj", "q_proj", "v_proj"])
    saved = load_file(adapter / "adapter_model.safetensors")
    loaded = {n.replace(".default", ""): p for n, p in module.model.named_parameters() if "lora_" in n}
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[n], p.detach()) and p.requires_grad for n, p in loaded.items())


def test_an_adapter_path_without_an_adapter_is_refused_before_the_base_loads(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    module = CausalLMFineTune(str(checkpoints["llama"]), compute_dtype="float32", adapter_path=str(tmp_path))
    with (
        mock.patch("lightning_blockwise.recipes.finetune_model.AutoModelForCausalLM.from_pretrained") as loaded,
        pytest.raises(MisconfigurationException, match=r"holds no adapter_config\.json\. Give a PEFT"),
    ):
        module.configure_model()
    assert loaded.call_count == 0


def test_a_resume_where_auto_chooses_other_kernels_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kernels="auto"` depends on the machine: a resume whose choice differs from the checkpoint's is refused.

    Control: on the same machine the same resume goes on, and an explicit other choice is taken with a warning.
    """
    first = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1)
    _fit_finetune(first, BlockwiseStrategy(), tmp_path / "first", steps=2)
    first.trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["lightning_blockwise_kernels"] == ["fused_lora"]

    def resume(out: str, kernels: Any = "auto") -> pl.Trainer:
        module = CausalLMFineTune(
            str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1, kernels=kernels,
            adapter_dir=str(tmp_path / out),
        )  # fmt: skip
        fitter = trainer(BlockwiseStrategy(), max_steps=3, accumulate_grad_batches=1, default_root_dir=tmp_path / out)
        fitter.fit(module, datamodule=_tokens(), ckpt_path=tmp_path / "last.ckpt")
        return fitter

    assert resume("same").global_step == 3
    with pytest.warns(UserWarning, match=r"trained with kernels \['fused_lora'\] .* computes with \[\], as asked"):
        assert resume("explicit", kernels=None).global_step == 3
    # Another machine, where "auto" takes nothing (stood in): refused, naming what to pass.
    monkeypatch.setattr("lightning_blockwise.recipes.finetune_build.resolve_auto", lambda *args: frozenset())
    with pytest.raises(
        MisconfigurationException, match=r"kernels='auto'\): this run was trained with.*kernels=\['fused_lora'\]"
    ):
        resume("other")


def test_a_resume_cleans_what_its_runs_killed_export_left(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """NOTE [ A resume cleans its run's export ]: the resumed run logs (and exports) to `version_1`; the staging
    directory a killed export left in `version_0` is removed all the same.

    Controls: a live process's staging directory is left, and a checkpoint without the record (older ones) leaves
    the dead one too, as the issue found.
    """

    def fit(ckpt_path: Path | None = None) -> pl.Trainer:
        module = CausalLMFineTune(str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", warmup_steps=1)
        logger = CSVLogger(tmp_path, name="run")
        fitter = trainer(BlockwiseStrategy(), max_steps=2, accumulate_grad_batches=1, logger=logger)
        fitter.fit(module, datamodule=_tokens(), ckpt_path=ckpt_path)
        return fitter

    first = fit()
    first.save_checkpoint(tmp_path / "last.ckpt")
    version_0 = Path(first.log_dir)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = version_0 / f".adapter.{host_name()}-{int(gone.stdout)}.k1ll3d.partial"
    live = version_0 / f".adapter.{host_name()}-{os.getpid()}.l1v3.partial"
    for staging in (killed, live):
        staging.mkdir()
        (staging / "adapter_model.safetensors").write_bytes(b"half an adapter")

    second = fit(tmp_path / "last.ckpt")
    assert Path(second.log_dir).name == "version_1" and (Path(second.log_dir) / "adapter").is_dir()
    assert not killed.exists() and live.exists()

    killed.mkdir()
    unrecorded = torch.load(tmp_path / "last.ckpt", weights_only=True)
    del unrecorded["lightning_blockwise_adapter_dir"]
    torch.save(unrecorded, tmp_path / "unrecorded.ckpt")
    fit(tmp_path / "unrecorded.ckpt")
    assert killed.exists()
