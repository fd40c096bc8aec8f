"""The rematerialization mechanism itself: it really recomputes, it keeps only the layer input,
and each piece of the replay matters (control arms that switch one piece off must differ)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

import lightning_blockwise  # noqa: F401
from lightning_blockwise.replay import capture, remat
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import (
    NUM_LAYERS,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    loader,
    padded_batches,
    runs_differ,
    trainer,
)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "nf4"])
def test_control_rng_restore_off_differs(
    monkeypatch: pytest.MonkeyPatch, checkpoints: dict[str, Path], quantized: bool
) -> None:
    """With dropout on, a recompute that does not restore the RNG draws other masks: grads differ."""

    def build() -> Any:
        return build_model("gemma2", checkpoint=checkpoints["gemma2"] if quantized else None, quantized=quantized)

    resident = fit(CausalLMModule(build), "auto")

    @contextmanager
    def no_restore(self: RngSnapshot) -> Iterator[None]:
        with torch.random.fork_rng(devices=[]):
            yield

    monkeypatch.setattr(RngSnapshot, "replay", no_restore)
    broken = fit(CausalLMModule(build), "blockwise")
    assert torch.equal(broken.losses[0], resident.losses[0]), "the forward itself must be unaffected"
    assert runs_differ(resident, broken)


def test_control_rng_restore_off_without_dropout_is_still_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The RNG control above fails because of dropout, not because the harness always fails."""
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))

    def build() -> Any:
        return build_model("llama", lora_dropout=0.0, attention_dropout=0.0)

    resident = fit(CausalLMModule(build), "auto")
    broken = fit(CausalLMModule(build), "blockwise")
    assert_equal_runs(resident, broken)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "qwen2"])
def test_control_shared_kwargs_replay_differs(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """On hybrid sliding/global models, recomputing every layer with one layer's arguments breaks the grads."""
    resident = fit(CausalLMModule(lambda: build_model(model_type)), "auto")
    last_forward_call: dict[str, capture.LayerCall] = {}
    original_run = remat.RematLayer.run

    def run_with_last_layers_call(self: remat.RematLayer, hidden: Tensor, call: capture.LayerCall) -> Tensor:
        if torch.is_grad_enabled():  # the recompute: replay the last layer's arguments instead of our own
            call = last_forward_call["call"]
        elif self.index == NUM_LAYERS - 1:
            last_forward_call["call"] = call
        return original_run(self, hidden, call)

    monkeypatch.setattr(remat.RematLayer, "run", run_with_last_layers_call)
    broken = fit(CausalLMModule(lambda: build_model(model_type)), "blockwise")
    assert torch.equal(broken.losses[0], resident.losses[0]), "the forward itself must be unaffected"
    assert runs_differ(resident, broken)


class _CountRuns(Callback):
    """Counts each decoder layer's evaluations per training batch, and what autograd saves inside each layer call."""

    def __init__(self) -> None:
        self.runs: list[Counter[int]] = []
        self.saved_per_layer: list[Counter[int]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.runs.append(Counter())
        self.saved_per_layer.append(Counter())

    def install(self, module: CausalLMModule) -> None:
        saved = {"count": 0}
        current: list[int | None] = [None]

        def pack(t: Tensor) -> Tensor:
            saved["count"] += 1
            return t

        def on_norm(index: int) -> Any:
            def hook(*_: Any) -> None:
                self.runs[-1][index] += 1

            return hook

        def pre(index: int) -> Any:
            def hook(*_: Any, **__: Any) -> None:
                current[0] = index
                self._before = saved["count"]

            return hook

        def post(index: int) -> Any:
            def hook(*_: Any, **__: Any) -> None:
                self.saved_per_layer[-1][index] += saved["count"] - self._before

            return hook

        def counted(forward: Any, count: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                count()
                return forward(*args, **kwargs)

            return run

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        for index, layer in enumerate(module.model.get_decoder().layers):
            # Counted in the module's forward, not by a hook: hooks fire once per step (replay/hooks.py).
            norm = layer.input_layernorm
            norm.forward = counted(norm.forward, on_norm(index))
            layer.register_forward_pre_hook(pre(index))
            layer.register_forward_hook(post(index))


class _RecordingModule(CausalLMModule):
    def __init__(self, counter: _CountRuns, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counter = counter

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        with self.counter._hooks:
            return super().training_step(batch, batch_idx)


def _counted_fit(strategy: str) -> _CountRuns:
    counter = _CountRuns()
    module = _RecordingModule(counter, build=lambda: build_model("llama"))
    counter.install(module)
    fit(module, strategy, callbacks=[counter], max_steps=2)
    return counter


def test_each_layer_runs_twice_per_step_and_saves_only_its_input() -> None:
    counter = _counted_fit("blockwise")
    assert len(counter.runs) == 4
    for runs, saved in zip(counter.runs, counter.saved_per_layer, strict=True):
        assert runs == dict.fromkeys(range(NUM_LAYERS), 2), "forward without grad, then the recompute in the backward"
        assert saved == dict.fromkeys(range(NUM_LAYERS), 1), "autograd may hold only the layer input between passes"


def test_count_harness_sees_a_resident_run() -> None:
    """Control: without the strategy each layer runs once and autograd saves many tensors per layer."""
    counter = _counted_fit("auto")
    for runs, saved in zip(counter.runs, counter.saved_per_layer, strict=True):
        assert runs == dict.fromkeys(range(NUM_LAYERS), 1)
        assert all(n > 1 for n in saved.values())


def test_no_capture_under_no_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation, test and predict run the layers directly: nothing is captured."""
    captured = Counter[str]()
    original = capture.LayerCall.capture.__func__

    def spy(cls: type, *args: Any, **kwargs: Any) -> capture.LayerCall:
        captured["calls"] += 1
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(capture.LayerCall, "capture", classmethod(spy))
    module = CausalLMModule(lambda: build_model("qwen3"))
    val = loader(padded_batches(2))
    trainer("blockwise", limit_val_batches=None).validate(module, val)
    assert captured["calls"] == 0 and len(module.val_losses) == 2
    fit(module, "blockwise", max_steps=1)
    assert captured["calls"] == 2 * NUM_LAYERS  # two micro-batches


def test_rng_snapshot_sees_a_draw() -> None:
    """`RngSnapshot.unchanged`: true until something draws from the generator (block-major's RNG checks)."""
    snapshot = RngSnapshot.capture(torch.device("cpu"))
    assert snapshot.unchanged()
    torch.rand(1)
    assert not snapshot.unchanged()
