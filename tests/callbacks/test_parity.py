"""``ParityCheck``: passes on a correct run, catches a broken replay (control arm), leaves no trace,
tells a nondeterministic stack from a broken replay, checks a prefix when the reference does not fit."""

from __future__ import annotations

import csv
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.callbacks.parity import ParityCheck, ParityError
from lightning_blockwise.replay import remat
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.verification import check as verification_check
from tests.helpers.models import (
    NUM_LAYERS,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    collect,
    fit,
    padded_batches,
    runs_differ,
    trainer,
    trainer_optimizer,
)

ROOT = Path(__file__).resolve().parents[2]


def _builder(checkpoints: dict[str, Path] | None = None, model_type: str = "gemma2") -> Callable[[], Any]:
    if checkpoints is None:
        return lambda: build_model(model_type)
    return lambda: build_model(model_type, checkpoint=checkpoints[model_type], quantized=True)


def _break_rng_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control arm: the recompute draws other dropout masks than the forward did."""
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))


@pytest.fixture
def arms(monkeypatch: pytest.MonkeyPatch) -> list[list[bool]]:
    """Per step the check runs: which decoder layers ran resident (no remat wrapper installed)."""
    seen: list[list[bool]] = []
    original = verification_check._step

    def spy(strategy: BlockwiseStrategy, *args: Any) -> dict[str, Tensor | None]:
        seen.append([remat.installed(layer) is None for layer in strategy.layers])
        return original(strategy, *args)

    monkeypatch.setattr(verification_check, "_step", spy)
    return seen


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "nf4"])
def test_passes_on_a_correct_run_and_logs(
    tmp_path: Path, checkpoints: dict[str, Path], quantized: bool, arms: list[list[bool]]
) -> None:
    check = ParityCheck()
    module = CausalLMModule(_builder(checkpoints if quantized else None))
    fit(module, "blockwise", callbacks=[check], logger=CSVLogger(tmp_path, name="", version=""))
    result = check.result
    assert result is not None and result.passed and result.full and not result.mismatches
    assert result.checked_layers == NUM_LAYERS and result.peak_vram_bytes is None
    assert result.num_tensors == 1 + sum(p.requires_grad for p in module.parameters())
    assert arms == [[False] * NUM_LAYERS, [True] * NUM_LAYERS], "blockwise arm, then the fully resident arm"
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["step"] == "0" and float(rows[0]["parity/passed"]) == 1.0
    assert float(rows[0]["parity/checked_layers"]) == NUM_LAYERS


def test_run_after_the_check_equals_a_run_without_it() -> None:
    """Shuffled data and dropout: batch order, RNG streams, grads and recorded losses are as if no check ran."""

    def run(callbacks: list[Callback]) -> Any:
        module = CausalLMModule(_builder())
        pl.seed_everything(0, verbose=False)
        data = DataLoader(padded_batches(8), batch_size=None, shuffle=True)
        trainer("blockwise", callbacks=callbacks).fit(module, data)
        return collect(module, trainer_optimizer(module))

    check = ParityCheck()
    checked = run([check])
    assert check.result is not None and check.result.passed
    assert_equal_runs(checked, run([]))


def _shuffling_loader(kind: str, num_workers: int) -> Any:
    """Shuffled padded batches: from the loader's own generator, from the global one, or a stateful loader."""
    batches = padded_batches(8)
    if kind == "stateful":
        sampler = StatefulRandomSampler(batches, generator=torch.Generator().manual_seed(3))
        return StatefulDataLoader(
            batches,
            batch_size=None,
            sampler=sampler,
            generator=torch.Generator().manual_seed(4),
            num_workers=num_workers,
        )
    generator = torch.Generator().manual_seed(3) if kind == "own" else None
    return DataLoader(batches, batch_size=None, shuffle=True, generator=generator, num_workers=num_workers)


def _run_with(callbacks: list[Callback], kind: str, num_workers: int) -> Any:
    module = CausalLMModule(_builder())
    pl.seed_everything(0, verbose=False)
    trainer("blockwise", callbacks=callbacks).fit(module, _shuffling_loader(kind, num_workers))
    return collect(module, trainer_optimizer(module))


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["own", "global", "stateful"])
def test_check_leaves_a_shuffling_loader_alone(kind: str, num_workers: int) -> None:
    """The step-0 loss and every later one are equal with and without the check, whatever drives the shuffle."""
    check = ParityCheck()
    checked = _run_with([check], kind, num_workers)
    assert check.result is not None and check.result.passed
    assert_equal_runs(checked, _run_with([], kind, num_workers))


def test_control_loader_generator_not_restored_shifts_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without putting the loader's own generator back, the check's iterator changes the run's batches."""
    unchecked = _run_with([], "own", 0)
    monkeypatch.setattr(verification_check, "_generators", lambda dataloaders: [])
    assert runs_differ(_run_with([ParityCheck()], "own", 0), unchecked)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "nf4"])
def test_control_broken_replay_raises_before_any_step(
    monkeypatch: pytest.MonkeyPatch, checkpoints: dict[str, Path], quantized: bool
) -> None:
    _break_rng_replay(monkeypatch)
    module = CausalLMModule(_builder(checkpoints if quantized else None))
    with pytest.raises(ParityError) as raised:
        fit(module, "blockwise", callbacks=[ParityCheck()])
    report = str(raised.value)
    assert "lora_A" in report and "lora_B" in report and "max |diff|" in report and "elements differ" in report
    assert "loss:" not in report, "the forward is unaffected by the recompute's RNG"
    assert "replay is broken" in report and "nondeterministic" not in report
    assert module.trainer.global_step == 0 and module.losses == [] and module.grads == []


def test_control_warn_mode_warns_and_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    _break_rng_replay(monkeypatch)
    check = ParityCheck(on_mismatch="warn")
    module = CausalLMModule(_builder())
    with pytest.warns(UserWarning, match="tensors differ"):
        fit(module, "blockwise", callbacks=[check])
    assert check.result is not None and check.result.passed is False and check.result.mismatches
    assert module.trainer.global_step == 4 and len(module.losses) == 8


class _NondeterministicModule(CausalLMModule):
    """Every evaluation of the loss differs slightly, from a source no generator state covers."""

    calls = 0

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.calls += 1
        return super().training_step(batch, batch_idx) * (1 + 1e-3 * self.calls)


def test_nondeterministic_stack_is_not_blamed_on_the_strategy() -> None:
    with pytest.raises(ParityError) as raised:
        fit(_NondeterministicModule(_builder()), "blockwise", callbacks=[ParityCheck()])
    report = str(raised.value)
    assert "loss:" in report and "nondeterministic" in report
    assert "Trainer(deterministic=True)" in report and "CUBLAS_WORKSPACE_CONFIG=:4096:8" in report
    assert "replay is broken" not in report


def test_resumed_run_does_not_check_again_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = CausalLMModule(_builder())
    first = trainer("blockwise", max_steps=2, callbacks=[ParityCheck()])
    first.fit(module, DataLoader(padded_batches(8), batch_size=None))
    first.save_checkpoint(tmp_path / "last.ckpt")

    calls: list[bool] = []
    original = ParityCheck._check

    def spy(self: ParityCheck, *args: Any) -> Any:
        calls.append(self.always)
        return original(self, *args)

    monkeypatch.setattr(ParityCheck, "_check", spy)
    for always in (False, True):
        check = ParityCheck(always=always)
        resumed = trainer("blockwise", max_steps=4, callbacks=[check])
        resumed.fit(
            CausalLMModule(_builder()), DataLoader(padded_batches(8), batch_size=None), ckpt_path=tmp_path / "last.ckpt"
        )
        assert check.result is not None and check.result.passed and resumed.global_step == 4
    assert calls == [True], "the resumed run skips the check; `always=True` redoes it"


def test_state_dict_round_trip() -> None:
    check = ParityCheck()
    fit(CausalLMModule(_builder()), "blockwise", callbacks=[check], max_steps=1)
    restored = ParityCheck()
    restored.load_state_dict(check.state_dict())
    assert restored.result == check.result


class _LimitToBlocks(Callback):
    """Sets the check's memory limit to exactly what the first ``num_blocks`` blocks need (runs before it)."""

    def __init__(self, check: ParityCheck, num_blocks: int) -> None:
        self.check = check
        self.num_blocks = num_blocks

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, BlockwiseStrategy)
        needs = [strategy.resident_prefix_bytes(k) for k in range(NUM_LAYERS + 1)]
        assert needs[0] == 0 and all(a < b for a, b in itertools.pairwise(needs))
        self.check.max_reference_bytes = needs[self.num_blocks]


def test_prefix_mode_when_the_reference_does_not_fit(arms: list[list[bool]]) -> None:
    check = ParityCheck()
    fit(CausalLMModule(_builder()), "blockwise", callbacks=[_LimitToBlocks(check, 2), check])
    result = check.result
    assert result is not None and result.passed and not result.full
    assert (result.checked_blocks, result.checked_layers, result.num_layers) == (2, 2, NUM_LAYERS)
    assert "layers 0..1 (2 of 4 blocks) resident" in result.scope() and "layers 2..3 ran blockwise" in result.scope()
    assert arms == [[False] * 4, [True, True, False, False]]


def test_control_prefix_mode_still_catches_a_broken_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    _break_rng_replay(monkeypatch)
    check = ParityCheck()
    with pytest.raises(ParityError, match=r"layers 0\.\.0 \(1 of 4 blocks\)"):
        fit(CausalLMModule(_builder()), "blockwise", callbacks=[_LimitToBlocks(check, 1), check])


def test_nothing_fits_warns_and_trains() -> None:
    check = ParityCheck(max_reference_bytes=1)
    module = CausalLMModule(_builder())
    with pytest.warns(UserWarning, match="Nothing was checked"):
        fit(module, "blockwise", callbacks=[check], max_steps=1)
    assert check.result is not None and check.result.passed is None and check.result.checked_layers == 0
    assert module.trainer.global_step == 1


def test_error_not_blockwise() -> None:
    with pytest.raises(MisconfigurationException, match="needs `BlockwiseStrategy`"):
        fit(CausalLMModule(_builder()), "auto", callbacks=[ParityCheck()])


def test_error_bad_on_mismatch() -> None:
    with pytest.raises(MisconfigurationException, match="on_mismatch='ignore'"):
        ParityCheck(on_mismatch="ignore")  # type: ignore[arg-type]


def test_resident_prefix_restores_the_strategy() -> None:
    """Inside: the prefix layers are unwrapped; outside: every layer is wrapped, bound to the host arena again."""

    class Probe(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            strategy = trainer.strategy
            assert isinstance(strategy, BlockwiseStrategy) and strategy.host_copy is not None
            with pytest.raises(ValueError, match="num_blocks=5"):
                with strategy.resident_prefix(5):
                    pass
            with strategy.resident_prefix(3):
                assert [remat.installed(layer) is None for layer in strategy.layers] == [True] * 3 + [False]
            assert all(remat.installed(layer).residency is strategy.streamer for layer in strategy.layers)
            assert strategy.host_copy.is_bound()

    fit(CausalLMModule(_builder()), "blockwise", callbacks=[Probe()], max_steps=1)


def test_reference_limit_respects_a_per_process_memory_fraction(monkeypatch: pytest.MonkeyPatch) -> None:
    """An 86 GB card, 6 GB of it reserved by this process: capped at 25%, the reference gets what the cap leaves."""
    gb = 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (80 * gb, 86 * gb))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 5 * gb)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 6 * gb)
    fraction = {"value": 1.0}
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction["value"])
    strategy = BlockwiseStrategy()
    monkeypatch.setattr(BlockwiseStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    plan = SimpleNamespace(residency=SimpleNamespace(predicted_peak=8 * gb))
    monkeypatch.setattr(BlockwiseStrategy, "step_plan", property(lambda self: plan))
    # Uncapped: free + cached - what the step still needs (8 - 5 allocated).
    assert strategy.reference_headroom() == 80 * gb + 1 * gb - 3 * gb
    fraction["value"] = 0.25  # 21.5 GB for the process: 21.5 - 5 allocated - 3 still needed
    assert strategy.reference_headroom() == 13.5 * gb
    # The budget binds tighter still: as the allocator's cap, 10 GB hold (10 GB - 128 MiB) / 1.1 of allocations
    # (NOTE [ A budget is a cap on the card ]), less the 8 planned.
    strategy.options = dataclasses.replace(strategy.options, vram_budget=10 * gb)
    assert strategy.reference_headroom() == (10 * gb - 128 * 2**20) * 100 // 110 - 8 * gb


def test_check_leaves_the_instruction_data_module_alone() -> None:
    """The demo's data module (a stateful, shuffling loader): the first and every later loss as without the check."""
    from lightning_blockwise.recipes.data import InstructionDataModule

    def run(callbacks: list[Callback]) -> Any:
        module = CausalLMModule(lambda: build_model("llama", vocab_size=259))
        pl.seed_everything(0, verbose=False)
        data = InstructionDataModule(str(ROOT / "data" / "instructions.jsonl"), max_length=96, batch_size=4)
        trainer("blockwise", callbacks=callbacks, max_steps=3, accumulate_grad_batches=1).fit(module, datamodule=data)
        return collect(module, trainer_optimizer(module))

    check = ParityCheck()
    checked = run([check])
    assert check.result is not None and check.result.passed
    assert_equal_runs(checked, run([]))


def _demo_step_checkpoint(root: Path, callbacks: list[Callback]) -> dict[str, Any]:
    """The demo's module and data module (configs/demo.yaml, smaller batches), a checkpoint at step 3 of epoch 0."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_blockwise.demos.tiny import DemoCausalLM
    from lightning_blockwise.recipes.data import InstructionDataModule

    pl.seed_everything(0, verbose=False)
    module = DemoCausalLM(vocab_size=259, num_hidden_layers=2, lora_dropout=0.05)
    data = InstructionDataModule(path="data/instructions.jsonl", max_length=128, batch_size=8)
    save = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    fitted = trainer(BlockwiseStrategy(block_size=1), max_steps=3, max_epochs=3, accumulate_grad_batches=1,
                     enable_checkpointing=True, callbacks=[*callbacks, save], default_root_dir=root)  # fmt: skip
    fitted.fit(module, datamodule=data)
    return torch.load(root / "step=3.ckpt", weights_only=False)


def _loader_position(checkpoint: dict[str, Any]) -> int:
    """Batches the training loader had yielded when ``checkpoint`` was written."""
    (state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return state["_num_yielded"]


def test_a_step_checkpoint_records_the_real_loader_position(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ The loop's iterator stays the loader's ]: with ParityCheck, a mid-epoch checkpoint of epoch 0 records
    the batches the loop drew (3), as without the check, and the same data state.

    Control: without putting the loader's iterator back after the check's throwaway one, the position is 0.
    """
    checked = _demo_step_checkpoint(tmp_path / "checked", [ParityCheck()])
    unchecked = _demo_step_checkpoint(tmp_path / "unchecked", [])
    assert _loader_position(checked) == _loader_position(unchecked) == 3
    assert checked["loops"]["fit_loop"]["state_dict"] == unchecked["loops"]["fit_loop"]["state_dict"]
    monkeypatch.setattr(verification_check, "_ITERATOR_ATTRIBUTES", ())
    assert _loader_position(_demo_step_checkpoint(tmp_path / "control", [ParityCheck()])) == 0
