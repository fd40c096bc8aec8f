"""GPU: Liger-Kernel's layers (``use_liger_kernels``) train blockwise exactly as resident, and how much faster they are.

One command runs both tests (the parity test in deterministic mode, the timing in default mode):
`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/kernels/test_gpu_kernels.py -s`
(needs `pip install "lightning-blockwise[kernels]"`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.kernels.forwards import LigerForward
from lightning_blockwise.kernels.liger import liger_kernels_in, use_liger_kernels
from tests.helpers.models import (
    CONFIGS,
    DEFAULT_TARGETS,
    GPU_SHAPES,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    fit_on_gpu,
    nf4_lora_builder,
    padded_batches,
    runs_differ,
    save_gpu_shape,
)

pytestmark = pytest.mark.gpu
pytest.importorskip("liger_kernel", reason='needs pip install "lightning-blockwise[kernels]"')

LAYERS = 4  # a few real-shape layers (Qwen2.5-1.5B, Llama-3.2-1B): the switch is per layer
SEQ = 512
STEPS = 4
ACCUMULATE = 2
TIMED_STEPS = 23  # 3 of warm-up, 20 timed


@pytest.fixture(scope="module", params=sorted(GPU_SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A random-init bf16 checkpoint of a real architecture's shape, ``LAYERS`` decoder layers."""
    return request.param, save_gpu_shape(request.param, LAYERS, tmp_path_factory.mktemp(request.param))


def _builder(path: Path, liger: bool) -> Callable[[], nn.Module]:
    """NF4 base, LoRA r16 with dropout on every projection; Liger's kernels installed when ``liger``."""
    build = nf4_lora_builder(path, DEFAULT_TARGETS, r=16)

    def with_kernels() -> nn.Module:
        model = build()
        if liger:
            use_liger_kernels(model)
            assert liger_kernels_in(model) == {"rms_norm": 2 * LAYERS + 1, "rope": LAYERS, "mlp": LAYERS}
        return model

    return with_kernels


@pytest.fixture
def liger_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of the installed Liger forwards by kernel: proof that the run computed with them."""
    calls: dict[str, int] = {"rms_norm": 0, "rope": 0, "mlp": 0}
    for cls in LigerForward.__subclasses__():
        original = cls.__call__

        def counting(self: LigerForward, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            calls[self.kernel] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", counting)
    return calls


def test_deterministic_liger_blockwise_equals_resident_and_control(
    checkpoint: tuple[str, Path], liger_calls: dict[str, int]
) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    name, path = checkpoint
    micro_batches = STEPS * ACCUMULATE
    resident = fit_on_gpu(_builder(path, liger=True), "auto", STEPS, ACCUMULATE, SEQ)
    # One forward per micro-batch, each layer's attention once.
    assert liger_calls["rope"] == micro_batches * LAYERS, liger_calls
    resident_calls = dict(liger_calls)
    blockwise = fit_on_gpu(_builder(path, liger=True), "blockwise", STEPS, ACCUMULATE, SEQ)
    # Blockwise: each layer's no-grad forward and its recompute in the backward, both with Liger's kernels.
    assert liger_calls["rope"] - resident_calls["rope"] == 2 * micro_batches * LAYERS, liger_calls
    assert_equal_runs(resident, blockwise)
    print(f"[gpu kernels] {name}: Liger on, {micro_batches} micro-batches, {STEPS} steps: blockwise == resident")
    # The default budget (the card): these few layers stay resident and keep their graphs, Liger's saved tensors
    # included (NOTE [ The card as the default budget ]): each layer runs once per micro-batch, as resident.
    before = dict(liger_calls)
    kept = fit_on_gpu(_builder(path, liger=True), BlockwiseStrategy(), STEPS, ACCUMULATE, SEQ)
    assert liger_calls["rope"] - before["rope"] == micro_batches * LAYERS, liger_calls
    assert_equal_runs(resident, kept)
    print(f"[gpu kernels] {name}: Liger on, the card's budget (every layer kept): blockwise == resident")

    # Control: the switch changes the compute, so the module without it trains another function.
    plain = fit_on_gpu(_builder(path, liger=False), "auto", STEPS, ACCUMULATE, SEQ)
    assert runs_differ(resident, plain), "control: Liger's kernels on and off must differ"
    delta = max((a - b).abs().item() for a, b in zip(resident.losses, plain.losses, strict=True))
    print(f"[gpu kernels] {name}: Liger on vs off, largest loss difference {delta:.3g} (rounding)")


def _tiny_liger(model_type: str) -> nn.Module:
    """The tests' tiny fp32 model of ``model_type`` with LoRA (dropout on), Liger's kernels installed."""
    return use_liger_kernels(build_model(model_type))


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_liger_computes_each_architecture_as_hugging_face_does_up_to_rounding(
    model_type: str, liger_calls: dict[str, int]
) -> None:
    """The per-architecture settings (Gemma's 1 + weight, Phi-3's fused gate-up, Qwen3's head norms) are right."""
    model = build_model(model_type).cuda().eval()
    batch = {key: value.cuda() for key, value in padded_batches(1)[0].items()}

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = loss_and_grads()
    use_liger_kernels(model)
    loss, grads = loss_and_grads()
    assert sum(liger_calls.values()) > 0
    worst = max((grads[n] - plain_grads[n]).abs().max().item() / plain_grads[n].abs().max().item() for n in grads)
    print(f"[gpu kernels] {model_type}: fp32 loss {plain_loss.item():.6f} vs {loss.item():.6f} with Liger;"
          f" largest gradient difference {worst:.2e} of the gradient's scale")  # fmt: skip
    assert torch.allclose(loss, plain_loss, rtol=1e-5, atol=1e-5)
    assert worst < 1e-3


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_deterministic_liger_tiny_blockwise_equals_resident(model_type: str) -> None:
    """Every architecture's rebuilt attention and Liger forwards through the replay (tiny fp32 models, dropout on)."""
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    runs = [
        fit(CausalLMModule(lambda: _tiny_liger(model_type)), strategy, accelerator="gpu", deterministic=True)
        # Every block streamed and every layer recomputed (a budget would keep a tiny model resident).
        for strategy in ("auto", BlockwiseStrategy(vram_budget=None))
    ]
    assert_equal_runs(*runs)
    plain = fit(CausalLMModule(lambda: build_model(model_type)), "auto", accelerator="gpu", deterministic=True)
    assert runs_differ(runs[0], plain), "control: Liger's kernels on and off must differ"


class _StepTimer(pl.Callback):
    """Seconds of each training batch (synchronized), the first ``warmup`` left out (Triton compiles there)."""

    def __init__(self, warmup: int = 3) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)

    @property
    def seconds(self) -> float:
        # The median: a 4-layer step is tens of milliseconds, and a stray slow step would move a mean.
        return statistics.median(self.times[self.warmup :])


def test_liger_speed_report(checkpoint: tuple[str, Path], liger_calls: dict[str, int]) -> None:
    """s/step of one 2048-token micro-batch, resident and blockwise, Liger off and on (default mode; a report)."""
    name, path = checkpoint
    seconds: dict[tuple[str, bool], float] = {}
    for strategy in ("auto", "blockwise"):
        for liger in (False, True):
            timer = _StepTimer()
            before = sum(liger_calls.values())
            fit_on_gpu(_builder(path, liger), strategy, TIMED_STEPS, 1, 2048, deterministic=False, callbacks=[timer])
            # The arm computed with Liger's kernels exactly when it was asked to.
            assert (sum(liger_calls.values()) > before) == liger, (strategy, liger, liger_calls)
            seconds[strategy, liger] = timer.seconds
    for strategy in ("auto", "blockwise"):
        off, on = seconds[strategy, False], seconds[strategy, True]
        print(
            f"[gpu kernels] {name}, {LAYERS} layers, 2048 tokens, {strategy}: {off:.4f} s/step without Liger,"
            f" {on:.4f} s/step with ({off / on:.2f}x)"
        )
