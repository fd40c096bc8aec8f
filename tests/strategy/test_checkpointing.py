"""Checkpoints under `BlockwiseStrategy`: lean by default, full on request, refused over another base, exact resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.strategy.checkpoint_hooks import CheckpointHooks
from lightning_blockwise.strategy.checkpointing import CHECKPOINT_KEY, BaseKeys
from tests.helpers.models import (
    CausalLMModule,
    RunResult,
    assert_equal_runs,
    build_model,
    collect,
    loader,
    padded_batches,
    runs_differ,
    save_checkpoint,
    trainer,
    trainer_optimizer,
)

BATCHES = 6  # batches per epoch


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two llama checkpoints of one shape whose weights differ (another seed)."""
    root = tmp_path_factory.mktemp("bases")
    return {"a": save_checkpoint("llama", root / "a", seed=0), "b": save_checkpoint("llama", root / "b", seed=1)}


def _module(base: Path | None, quantized: bool = True, seed: int = 0) -> CausalLMModule:
    return CausalLMModule(lambda: build_model("llama", base, quantized=quantized, seed=seed), in_configure_model=True)


def _checkpointing_trainer(strategy: Any, root: Path, **kwargs: Any) -> pl.Trainer:
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    options: dict[str, Any] = dict(enable_checkpointing=True, callbacks=[callback], default_root_dir=root)
    options.update(kwargs)
    return trainer(strategy, accumulate_grad_batches=1, **options)


def _frozen_bytes(module: CausalLMModule) -> int:
    """Bytes of the Hugging Face model's frozen tensors, counted once each."""
    seen: dict[int, int] = {}
    for tensor in [*module.model.parameters(), *module.model.buffers()]:
        if not tensor.requires_grad:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())


def _storage_bytes(state: dict[str, Any]) -> int:
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in state.values() if torch.is_tensor(v)
    }
    return sum(storages.values())


@pytest.mark.parametrize("quantized", [True, False], ids=["nf4", "fp32"])
def test_default_checkpointing_saves_a_lean_checkpoint(bases: dict[str, Path], tmp_path: Path, quantized: bool) -> None:
    """Lightning's default `ModelCheckpoint` works under blockwise and leaves the frozen base out."""
    module = _module(bases["a"], quantized=quantized)
    strategy = BlockwiseStrategy()
    trainer(strategy, max_steps=2, enable_checkpointing=True, default_root_dir=tmp_path).fit(
        module, loader(padded_batches(2))
    )
    (path,) = tmp_path.rglob("*.ckpt")
    checkpoint = torch.load(path, weights_only=True)
    keys = BaseKeys.of(module, module.model.base_model.model)
    saved = set(checkpoint["state_dict"])
    assert not saved & keys.frozen  # no frozen-base tensor
    assert saved == set(keys.trainable)  # every trainable one
    assert checkpoint[CHECKPOINT_KEY]["base_fingerprint"] == strategy.base_fingerprint
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    assert _storage_bytes(checkpoint["state_dict"]) == trainable


def test_state_dict_of_a_fitted_module_saves_and_round_trips(bases: dict[str, Path], tmp_path: Path) -> None:
    """`torch.save(module.state_dict())` after a blockwise fit: each tensor once, no arena or slot storage."""
    module = _module(bases["a"])
    strategy = BlockwiseStrategy()
    trainer(strategy, max_steps=1).fit(module, loader(padded_batches(2)))
    state = module.state_dict()
    torch.save(state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=False)
    assert loaded.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(loaded[key], value), key
    arena = strategy.host_copy.arena
    assert _storage_bytes(loaded) < arena.nbytes + _frozen_bytes(module) - arena.bytes_needed + 2**20


def test_full_state_checkpoint_round_trips_into_another_base(bases: dict[str, Path], tmp_path: Path) -> None:
    """`save_frozen_base=True`: a self-contained file, each frozen tensor once, that loads over another base."""
    module = _module(bases["a"])
    fitted = trainer(BlockwiseStrategy(save_frozen_base=True), max_steps=2)
    fitted.fit(module, loader(padded_batches(2)))
    fitted.save_checkpoint(tmp_path / "full.ckpt")
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=False)
    expected = module.state_dict()
    assert checkpoint["state_dict"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(checkpoint["state_dict"][key], value), key
    trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    arena = fitted.strategy.host_copy.arena
    outside_arena = _frozen_bytes(module) - arena.bytes_needed
    # Every frozen tensor once, read from the host copy: no device slot, no whole-arena storage.
    assert _storage_bytes(checkpoint["state_dict"]) <= arena.bytes_needed + outside_arena + trainable + 2**16

    other = _module(bases["b"])  # same shape, other weights
    strategy = BlockwiseStrategy(save_frozen_base=True)
    trainer(strategy, max_steps=2).fit(other, loader(padded_batches(2)), ckpt_path=tmp_path / "full.ckpt")
    restored = other.state_dict()
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(restored[key], value), key
    assert strategy.base_fingerprint == fitted.strategy.base_fingerprint

    # Control: the other base really is another base.
    control = _module(bases["b"])
    trainer(BlockwiseStrategy(), max_steps=1).fit(control, loader(padded_batches(2)))
    assert any(not torch.equal(control.state_dict()[k], v) for k, v in checkpoint["state_dict"].items())


def test_lean_checkpoint_over_another_base_is_refused(bases: dict[str, Path], tmp_path: Path) -> None:
    module = _module(bases["a"])
    trainer(BlockwiseStrategy(), max_steps=1).fit(module, loader(padded_batches(2)))
    module.trainer.save_checkpoint(tmp_path / "lean.ckpt")
    with pytest.raises(MisconfigurationException, match="another frozen base"):
        trainer(BlockwiseStrategy(), max_steps=2).fit(
            _module(bases["b"]), loader(padded_batches(2)), ckpt_path=tmp_path / "lean.ckpt"
        )
    # Control: the same base resumes.
    trainer(BlockwiseStrategy(), max_steps=2).fit(
        _module(bases["a"]), loader(padded_batches(2)), ckpt_path=tmp_path / "lean.ckpt"
    )


def test_missing_trainable_keys_are_an_error_even_when_not_strict(bases: dict[str, Path], tmp_path: Path) -> None:
    module = _module(bases["a"])
    trainer(BlockwiseStrategy(), max_steps=1).fit(module, loader(padded_batches(2)))
    module.trainer.save_checkpoint(tmp_path / "lean.ckpt")
    checkpoint = torch.load(tmp_path / "lean.ckpt", weights_only=True)
    dropped = next(iter(checkpoint["state_dict"]))
    del checkpoint["state_dict"][dropped]
    torch.save(checkpoint, tmp_path / "cut.ckpt")
    resumed = _module(bases["a"])
    resumed.strict_loading = False
    with pytest.raises(MisconfigurationException, match="lacks 1 trainable"):
        trainer(BlockwiseStrategy(), max_steps=2).fit(
            resumed, loader(padded_batches(2)), ckpt_path=tmp_path / "cut.ckpt"
        )


def test_lean_checkpoint_under_auto(bases: dict[str, Path], tmp_path: Path) -> None:
    """Under `strategy="auto"` a lean checkpoint loads only non-strictly (the base comes from the module)."""
    module = _module(bases["a"])
    trainer(BlockwiseStrategy(), max_steps=1).fit(module, loader(padded_batches(2)))
    module.trainer.save_checkpoint(tmp_path / "lean.ckpt")
    with pytest.raises(RuntimeError, match="Missing key"):
        trainer("auto", max_steps=2).fit(
            _module(bases["a"]), loader(padded_batches(2)), ckpt_path=tmp_path / "lean.ckpt"
        )
    resumed = _module(bases["a"])
    resumed.strict_loading = False
    trainer("auto", max_steps=1).fit(resumed, loader(padded_batches(2)), ckpt_path=tmp_path / "lean.ckpt")
    # max_steps reached on restore: no step ran, so the weights are the checkpoint's.
    saved = torch.load(tmp_path / "lean.ckpt", weights_only=True)["state_dict"]
    for key, value in saved.items():
        assert torch.equal(resumed.state_dict()[key], value), key


# --- exact resume ---------------------------------------------------------------------------------------------------


def _shuffled(stateful: bool = True) -> StatefulDataLoader | torch.utils.data.DataLoader:
    """A shuffling loader over BATCHES padded batches that never draws from the global RNG.

    The stateful form is how an exactly resumable loader is built with torchdata (see NOTE
    [ Resumable data order ] in recipes/sampling.py): its stateful sampler with a generator of its own, and
    another generator for the loader's base seed.
    """
    batches = padded_batches(BATCHES)
    if not stateful:
        return torch.utils.data.DataLoader(
            batches, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
    sampler = StatefulRandomSampler(batches, generator=torch.Generator().manual_seed(7))
    return StatefulDataLoader(batches, batch_size=None, sampler=sampler, generator=torch.Generator().manual_seed(8))


def _run(strategy_factory: Any, max_steps: int, root: Path, ckpt_path: Path | None = None, **kwargs: Any) -> RunResult:
    pl.seed_everything(0, verbose=False)
    module = CausalLMModule(lambda: build_model("llama", lora_dropout=0.1), in_configure_model=True)
    fitted = _checkpointing_trainer(strategy_factory(), root, max_steps=max_steps)
    fitted.fit(module, kwargs.get("data", _shuffled()), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


RESUME_AT = BATCHES + 2  # mid-epoch, in epoch 1
TOTAL = 2 * BATCHES + 2  # ends in epoch 2


def _tail(result: RunResult, steps: int) -> RunResult:
    return RunResult(result.losses[-steps:], result.grads[-steps:], result.weights, result.optimizer)


@pytest.mark.parametrize("name", ["blockwise", "auto"])
def test_resume_mid_epoch_is_exact(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resumed from a checkpoint taken mid-epoch in epoch 1: every later loss, grad, weight and Adam state equal.

    The `auto` arm records what Lightning alone gives: no RNG state, so dropout differs after the resume.
    """
    factory = BlockwiseStrategy if name == "blockwise" else (lambda: "auto")
    whole = _run(factory, TOTAL, tmp_path / "whole")
    _run(factory, RESUME_AT, tmp_path / "first")
    resumed = _run(factory, TOTAL, tmp_path / "second", ckpt_path=tmp_path / "first" / f"step={RESUME_AT}.ckpt")
    assert len(resumed.losses) == TOTAL - RESUME_AT
    if name == "auto":
        assert runs_differ(_tail(whole, TOTAL - RESUME_AT), resumed)
        return
    assert_equal_runs(_tail(whole, TOTAL - RESUME_AT), resumed)


class _ScheduledModule(CausalLMModule):
    """Reads `estimated_stepping_batches` in `configure_optimizers`, as every warmup-cosine schedule does."""

    def configure_optimizers(self) -> Any:
        optimizer = super().configure_optimizers()
        total = self.trainer.estimated_stepping_batches
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / (total + 1))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class _StopAt(pl.Callback):
    """Stops the run after ``step`` optimizer steps, as if it were killed there (its schedule unchanged)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _scheduled_run(root: Path, ckpt_path: Path | None = None, stop_at: int | None = None) -> RunResult:
    pl.seed_everything(0, verbose=False)
    module = _ScheduledModule(lambda: build_model("llama", lora_dropout=0.1), in_configure_model=True)
    # `max_epochs` set: Lightning then builds the train loader inside `configure_optimizers`.
    fitted = _checkpointing_trainer(BlockwiseStrategy(), root, max_steps=-1, max_epochs=EPOCHS)
    if stop_at is not None:
        fitted.callbacks.append(_StopAt(stop_at))
    fitted.fit(module, _shuffled(), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


EPOCHS = 3


def test_resume_with_a_schedule_over_the_estimated_steps_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NOTE [ Loader state restored late ]: the loader resumes mid-epoch though Lightning built it before the restore.

    Control: without handing the loader its state at train start, the resumed run trains other batches.
    """
    whole = _scheduled_run(tmp_path / "whole")
    assert len(whole.losses) == EPOCHS * BATCHES
    _scheduled_run(tmp_path / "first", stop_at=RESUME_AT)
    checkpoint = tmp_path / "first" / f"step={RESUME_AT}.ckpt"
    resumed = _scheduled_run(tmp_path / "second", ckpt_path=checkpoint)
    steps = EPOCHS * BATCHES - RESUME_AT
    assert_equal_runs(_tail(whole, steps), resumed)
    monkeypatch.setattr(CheckpointHooks, "resume_loader", staticmethod(lambda fit_loop: None))
    assert runs_differ(_tail(whole, steps), _scheduled_run(tmp_path / "third", ckpt_path=checkpoint))


def test_control_resume_without_rng_restore_differs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _run(BlockwiseStrategy, TOTAL, tmp_path / "whole")
    _run(BlockwiseStrategy, RESUME_AT, tmp_path / "first")
    monkeypatch.setattr(GlobalRngState, "restore", lambda self: None)
    resumed = _run(
        BlockwiseStrategy, TOTAL, tmp_path / "second", ckpt_path=tmp_path / "first" / f"step={RESUME_AT}.ckpt"
    )
    assert runs_differ(_tail(whole, TOTAL - RESUME_AT), resumed)


def test_control_resume_without_loader_state_differs(tmp_path: Path) -> None:
    """A loader without `state_dict` restarts its epoch on resume (Lightning cannot put it back)."""
    plain = {"data": _shuffled(stateful=False)}
    whole = _run(BlockwiseStrategy, TOTAL, tmp_path / "whole", **plain)
    _run(BlockwiseStrategy, RESUME_AT, tmp_path / "first", data=_shuffled(stateful=False))
    resumed = _run(
        BlockwiseStrategy,
        TOTAL,
        tmp_path / "second",
        ckpt_path=tmp_path / "first" / f"step={RESUME_AT}.ckpt",
        data=_shuffled(stateful=False),
    )
    assert runs_differ(_tail(whole, TOTAL - RESUME_AT), resumed)


def test_rng_state_loads_weights_only(tmp_path: Path) -> None:
    import random

    import numpy as np

    state = GlobalRngState.capture()
    torch.save(state.state_dict(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    GlobalRngState.from_state_dict(torch.load(tmp_path / "rng.pt", weights_only=True)).restore()
    assert random.random() == expected[0] and np.random.rand() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def _epoch_run(root: Path, ckpt_path: Path | None = None) -> RunResult:
    """Two epochs of a plain loader whose iterator draws its base seed from the global RNG; a checkpoint per epoch."""
    pl.seed_everything(0, verbose=False)
    module = CausalLMModule(lambda: build_model("llama", lora_dropout=0.1), in_configure_model=True)
    save = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    fitted = trainer(BlockwiseStrategy(), max_steps=-1, max_epochs=2, accumulate_grad_batches=1,
                     enable_checkpointing=True, callbacks=[save])  # fmt: skip
    fitted.fit(module, loader(padded_batches(4)), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


def test_resume_at_an_epoch_end_is_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [ Loader state restored late ]: resumed from the checkpoint written at the end of epoch 0, exact.

    Control: without making the loader iterator again after the RNG states are back, every random number of the
    resumed epoch is one draw off.
    """
    whole = _epoch_run(tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "epoch=0.ckpt"
    assert_equal_runs(_tail(whole, 4), _epoch_run(tmp_path / "second", ckpt_path=checkpoint))
    monkeypatch.setattr(CheckpointHooks, "restart_epoch", staticmethod(lambda fit_loop: None))
    assert runs_differ(_tail(whole, 4), _epoch_run(tmp_path / "third", ckpt_path=checkpoint))


def _stepped_run(root: Path, ckpt_path: Path | None = None) -> RunResult:
    """Two epochs of four batches of a plain loader, a checkpoint every four steps: each one ends an epoch."""
    pl.seed_everything(0, verbose=False)
    module = CausalLMModule(lambda: build_model("llama", lora_dropout=0.1), in_configure_model=True)
    save = ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    fitted = trainer(BlockwiseStrategy(), max_steps=-1, max_epochs=2, accumulate_grad_batches=1,
                     enable_checkpointing=True, callbacks=[save])  # fmt: skip
    fitted.fit(module, loader(padded_batches(4)), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


def test_resume_at_a_step_checkpoint_that_ends_an_epoch_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ModelCheckpoint(every_n_train_steps=4)` over epochs of four batches: the step-4 checkpoint ends epoch 0.

    Control: without making the loader iterator again after the RNG states are back, the resumed epoch's random
    numbers are one draw off.
    """
    whole = _stepped_run(tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "step=4.ckpt"
    resumed = _stepped_run(tmp_path / "second", ckpt_path=checkpoint)
    assert_equal_runs(_tail(whole, 4), resumed)
    monkeypatch.setattr(CheckpointHooks, "restart_epoch", staticmethod(lambda fit_loop: None))
    assert runs_differ(_tail(whole, 4), _stepped_run(tmp_path / "third", ckpt_path=checkpoint))


def _short_run(strategy: Any, root: Path, max_steps: int, ckpt_path: Path | None = None) -> None:
    pl.seed_everything(0, verbose=False)
    module = CausalLMModule(lambda: build_model("llama", lora_dropout=0.1), in_configure_model=True)
    _checkpointing_trainer(strategy, root, max_steps=max_steps).fit(module, _shuffled(), ckpt_path=ckpt_path)


def test_resuming_a_checkpoint_of_another_strategy_warns(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    """A `strategy="auto"` checkpoint resumed under the strategy holds no RNG states: the resume is not exact, said.

    Control: a checkpoint the strategy wrote resumes without that warning.
    """
    _short_run("auto", tmp_path / "auto", 1)
    with pytest.warns(UserWarning, match=r"not written by BlockwiseStrategy .*the resume is not exact"):
        _short_run(BlockwiseStrategy(), tmp_path / "resumed", 2, ckpt_path=tmp_path / "auto" / "step=1.ckpt")
    _short_run(BlockwiseStrategy(), tmp_path / "blockwise", 1)
    recwarn.clear()
    _short_run(BlockwiseStrategy(), tmp_path / "again", 2, ckpt_path=tmp_path / "blockwise" / "step=1.ckpt")
    assert not [w for w in recwarn if "not written by BlockwiseStrategy" in str(w.message)]


def test_lightnings_default_checkpoint_saves_and_resumes_an_nf4_run_exactly(
    bases: dict[str, Path], tmp_path: Path
) -> None:
    """An NF4 module and the `Trainer`'s own `ModelCheckpoint`: saved at the first epoch's end, resumed into the
    second, every loss, grad, weight and AdamW state equals the uninterrupted run's (the first thing a user does).

    Control: the second epoch started afresh differs. (This replaces the timed-plan version of the test, removed with
    `timed_plan`.)
    """

    def run(root: Path, epochs: int, ckpt_path: Path | None = None) -> RunResult:
        module = _module(bases["a"])
        pl.seed_everything(0, verbose=False)
        fitted = trainer(
            BlockwiseStrategy(), max_steps=-1, max_epochs=epochs, enable_checkpointing=True, default_root_dir=root
        )
        fitted.fit(module, loader(padded_batches(8)), ckpt_path=ckpt_path)
        return collect(module, trainer_optimizer(module))

    whole = run(tmp_path / "whole", 2)
    run(tmp_path / "first", 1)
    (saved,) = (tmp_path / "first").rglob("*.ckpt")
    resumed = run(tmp_path / "second", 2, ckpt_path=saved)
    tail = RunResult(whole.losses[-8:], whole.grads[-4:], whole.weights, whole.optimizer)
    assert len(resumed.losses) == 8
    assert_equal_runs(tail, resumed)
    assert runs_differ(tail, run(tmp_path / "afresh", 1))
