"""The recipe's optimizer option: torch's AdamW or bitsandbytes' 8-bit AdamW, blockwise == resident, exact resume."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from bitsandbytes.optim import AdamW8bit, PagedAdamW8bit
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import main
from lightning_blockwise.compat.bitsandbytes.optimizers import MIN_8BIT_SIZE
from lightning_blockwise.recipes import finetune_checkpoint
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.optimizers import OPTIMIZER_KEY, OPTIMIZERS, build_optimizer
from tests.helpers.models import VOCAB, trainer

#: Rank 128 on the tiny llama (hidden 32, MLP 64, 16-wide k/v): q/o/gate/up/down adapter matrices have 4096 or 8192
#: elements and get 8-bit moments, k/v's B matrices (2048) keep fp32 ones, so both kinds of state are exercised.
RANK = 128
ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
RESUME_AT = 2


def test_optimizer_choices_are_checked_by_the_constructor() -> None:
    message = r"^CausalLMFineTune\(optimizer='adam'\): choose one of 'adamw', 'adamw8bit', 'paged_adamw8bit'\.$"
    with pytest.raises(MisconfigurationException, match=message):
        CausalLMFineTune("/no/such/checkpoint", optimizer="adam")
    # Control: every listed name is taken (the checkpoint is only read when the model is built).
    for name in OPTIMIZERS:
        assert CausalLMFineTune("/no/such/checkpoint", optimizer=name).hparams.optimizer == name


def test_every_model_config_names_the_optimizer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        if config.stem == "demo":  # the demo trains its own module (DemoCausalLM), with torch's AdamW
            continue
        assert yaml.safe_load(config.read_text(encoding="utf-8"))["model"]["init_args"]["optimizer"] == "adamw"
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--model.init_args.optimizer=adamw8bit", "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["optimizer"] == "adamw8bit"


def test_build_optimizer_by_name() -> None:
    params = [torch.nn.Parameter(torch.randn(MIN_8BIT_SIZE))]
    assert type(build_optimizer("adamw", params, lr=1e-3, weight_decay=0.1)) is torch.optim.AdamW
    assert type(build_optimizer("adamw8bit", params, lr=1e-3, weight_decay=0.1)) is AdamW8bit
    assert type(build_optimizer("paged_adamw8bit", params, lr=1e-3, weight_decay=0.1)) is PagedAdamW8bit
    with pytest.raises(ValueError, match="choose one of 'adamw', 'adamw8bit', 'paged_adamw8bit'"):
        build_optimizer("sgd", params, lr=1e-3, weight_decay=0.1)


def test_paged_falls_back_to_the_same_numbers_on_the_cpu() -> None:
    """bitsandbytes has no unified memory on the CPU: `PagedAdamW8bit` warns and steps as `AdamW8bit` does."""
    states = []
    for name in ("adamw8bit", "paged_adamw8bit"):
        param = torch.nn.Parameter(torch.linspace(-1, 1, 2 * MIN_8BIT_SIZE))
        optimizer = build_optimizer(name, [param], lr=1e-2, weight_decay=0.0)
        for step in range(3):
            param.grad = torch.sin(torch.arange(param.numel()) * (step + 1.0))
            optimizer.step()
        states.append((param.detach().clone(), optimizer.state[param]))
    (weight, state), (paged_weight, paged_state) = states
    assert state["state1"].dtype == torch.uint8 and torch.equal(weight, paged_weight)
    assert all(torch.equal(state[key], paged_state[key]) for key in ("state1", "state2", "absmax1", "absmax2"))


class _Record(pl.Callback):
    """Every training step's loss; at the end, the adapters and the optimizer state by parameter name."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []
        self.adapters: dict[str, Tensor] = {}
        self.state: dict[str, Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach().clone())

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        names = {param: name for name, param in module.named_parameters() if param.requires_grad}
        self.adapters = {name: param.detach().clone() for param, name in names.items()}
        for param, state in trainer.optimizers[0].state.items():
            for key, value in state.items():
                self.state[f"{names[param]}:{key}"] = torch.as_tensor(value).clone()


class _StopAt(pl.Callback):
    """Stop after ``step`` optimizer steps, as a killed run would (its schedule still planned for ``STEPS``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _run(
    checkpoint: Path, strategy: Any, root: Path, optimizer: str = "adamw8bit", ckpt_path: Path | None = None,
    callbacks: list[pl.Callback] | None = None,
) -> _Record:  # fmt: skip
    """``STEPS`` seeded steps of CausalLMFineTune (LoRA dropout on) with ``optimizer``; what they left."""
    pl.seed_everything(0, verbose=False)
    module = CausalLMFineTune(
        str(checkpoint), lora_r=RANK, compute_dtype="float32", warmup_steps=1, optimizer=optimizer
    )
    record = _Record()
    fitter = trainer(
        strategy, max_steps=STEPS, accumulate_grad_batches=1, default_root_dir=root,
        callbacks=[record, *(callbacks or [])], enable_checkpointing=bool(callbacks),
    )  # fmt: skip
    data = SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=12, batch_size=2)
    fitter.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return record


def _assert_equal(a: _Record, b: _Record, steps: int = STEPS) -> None:
    assert torch.equal(torch.stack(a.losses[-steps:]), torch.stack(b.losses[-steps:]))
    assert a.adapters.keys() == b.adapters.keys() and a.state.keys() == b.state.keys()
    for name, value in a.adapters.items():
        assert torch.equal(value, b.adapters[name]), name
    for key, value in a.state.items():
        assert torch.equal(value, b.state[key]), key


def _8bit_keys(record: _Record) -> set[str]:
    return {key for key, value in record.state.items() if key.endswith(":state1") and value.dtype == torch.uint8}


def test_8bit_adamw_blockwise_equals_resident(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    resident = _run(checkpoints["llama"], "auto", tmp_path / "resident")
    blockwise = _run(checkpoints["llama"], BlockwiseStrategy(block_size=2), tmp_path / "blockwise")
    # Both kinds of bitsandbytes state are there: 8-bit moments, and fp32 ones for the small k/v B matrices.
    assert _8bit_keys(blockwise) and any(
        key.endswith(":state1") and v.dtype == torch.float32 for key, v in blockwise.state.items()
    )
    assert len(blockwise.losses) == STEPS
    _assert_equal(resident, blockwise)
    # Control: torch's AdamW from the same start trains other adapters (the option is what the runs used), and the
    # comparison above sees it from the second loss on (the first is the untrained model's).
    fp32 = _run(checkpoints["llama"], BlockwiseStrategy(block_size=2), tmp_path / "fp32", optimizer="adamw")
    # The losses after the first step as a whole: in 4 steps the two optimizers' last losses can round to the same
    # float32 (seen: 4.565035 both, the third 4.537877 against 4.537876).
    later = [torch.stack(run.losses[1:]) for run in (fp32, blockwise)]
    assert torch.equal(fp32.losses[0], blockwise.losses[0]) and not torch.equal(*later)
    assert any(not torch.equal(value, fp32.adapters[name]) for name, value in blockwise.adapters.items())
    assert not _8bit_keys(fp32)


def test_8bit_adamw_resumes_exactly_from_a_lean_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    whole = _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "whole")
    every_step = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "first", callbacks=[every_step, _StopAt(RESUME_AT)])
    saved = tmp_path / "ckpt" / f"step={RESUME_AT}.ckpt"
    # Lean: adapters only, and the optimizer's 8-bit moments as bitsandbytes' own uint8 codes and fp32 absmaxes.
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["state_dict"] and all("lora_" in key for key in checkpoint["state_dict"])
    wrapped = [
        state.get("__bnb_optimizer_quant_state__", {}) for state in checkpoint["optimizer_states"][0]["state"].values()
    ]
    eight_bit = [state for state in wrapped if "absmax1" in state]
    assert len(eight_bit) == len(_8bit_keys(whole)) > 0
    assert all(state["state1"].dtype == state["state2"].dtype == torch.uint8 for state in eight_bit)

    resumed = _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "second", ckpt_path=saved)
    assert len(resumed.losses) == STEPS - RESUME_AT
    _assert_equal(whole, resumed, steps=STEPS - RESUME_AT)
    # Control: the same checkpoint without its optimizer state (fresh moments at step 2) trains other adapters.
    for state in checkpoint["optimizer_states"][0]["state"].values():
        state.clear()
    torch.save(checkpoint, tmp_path / "no-moments.ckpt")
    fresh = _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "third", ckpt_path=tmp_path / "no-moments.ckpt")
    assert torch.equal(fresh.losses[0], resumed.losses[0])
    assert any(not torch.equal(value, fresh.adapters[name]) for name, value in resumed.adapters.items())


def _saved_at_resume(checkpoint: Path, root: Path, optimizer: str) -> Path:
    """The checkpoint of a run with ``optimizer`` stopped after ``RESUME_AT`` steps (moments in its state)."""
    every_step = ModelCheckpoint(root / "ckpt", filename="{step}", every_n_train_steps=1, save_top_k=-1)
    _run(
        checkpoint, BlockwiseStrategy(), root / "first", optimizer=optimizer, callbacks=[every_step, _StopAt(RESUME_AT)]
    )
    return root / "ckpt" / f"step={RESUME_AT}.ckpt"


@pytest.mark.parametrize(("saved_with", "resumed_with"), [("adamw8bit", "adamw"), ("adamw", "paged_adamw8bit")])
def test_resume_with_another_kind_of_optimizer_is_refused_before_the_load(
    checkpoints: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, saved_with: str, resumed_with: str
) -> None:
    """NOTE [ An optimizer's state resumes into its own kind only ]: both names and the fix, not a bare KeyError."""
    saved = _saved_at_resume(checkpoints["llama"], tmp_path, saved_with)
    assert torch.load(saved, weights_only=True)[OPTIMIZER_KEY] == saved_with
    message = (
        rf"^CausalLMFineTune\(optimizer='{resumed_with}'\): the checkpoint was trained with optimizer='{saved_with}',"
        rf".* Pass `optimizer='{saved_with}'` \(YAML: `optimizer: {saved_with}`\) to resume the run"
    )
    with pytest.raises(MisconfigurationException, match=message):
        _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "second", optimizer=resumed_with, ckpt_path=saved)
    # A checkpoint older than the record is read by its state's keys.
    unrecorded = torch.load(saved, weights_only=True)
    del unrecorded[OPTIMIZER_KEY]
    torch.save(unrecorded, tmp_path / "unrecorded.ckpt")
    with pytest.raises(MisconfigurationException, match=rf"optimizer='{resumed_with}'\): the checkpoint was trained"):
        _run(checkpoints["llama"], "auto", tmp_path / "third", resumed_with, ckpt_path=tmp_path / "unrecorded.ckpt")
    # Control: without the check the resume fails as the issue found it, at the first step, on a missing moment.
    monkeypatch.setattr(finetune_checkpoint, "check_resumed_optimizer", lambda *args: None)
    with pytest.raises(KeyError):
        _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "fourth", optimizer=resumed_with, ckpt_path=saved)


def test_resume_between_the_two_8bit_optimizers_is_allowed_and_exact(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """`AdamW8bit` and `PagedAdamW8bit` keep the same state: the switch is not refused, and resumes exactly.

    Control of the refusal above: the check refuses another kind of state, not another name.
    """
    whole = _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "whole")
    saved = _saved_at_resume(checkpoints["llama"], tmp_path, "adamw8bit")
    resumed = _run(checkpoints["llama"], BlockwiseStrategy(), tmp_path / "paged", "paged_adamw8bit", ckpt_path=saved)
    _assert_equal(whole, resumed, steps=STEPS - RESUME_AT)
