"""GPU: layer inputs split between card and host, and input checkpoints, are exact (deterministic mode).

`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/residency/test_gpu_input_levels.py -s` on a CUDA machine. An
8-layer bf16 Llama (hidden 512) loaded as NF4 with LoRA r8 and dropout 0.05, bf16-mixed, 3 optimizer steps of 2
micro-batches of 2 x 256 tokens; prints each arm's peak allocated memory, pinned input bytes and transfers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay.segments import Segment
from lightning_blockwise.residency.base import Pass
from tests.helpers.models import (
    CausalLMModule,
    RunResult,
    assert_equal_runs,
    fit,
    nf4_lora_builder,
    padded_batches,
    runs_differ,
)

pytestmark = pytest.mark.gpu

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")


class _Measured(Callback):
    """Peak allocated memory over training, and the offload's pinned bytes and traffic of the last micro-batch."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.cuda.reset_peak_memory_stats()
        self.pinned = self.to_host = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        # The resident run's strategy ("auto") has no offload.
        offload = getattr(trainer.strategy, "activation_offload", None)
        if offload is not None:
            self.pinned = offload.host_bytes
            self.to_host = offload.reset_stats().device_to_host_bytes

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak = torch.cuda.max_memory_allocated()


def _fit(path: Path, strategy: Any, label: str) -> RunResult:
    measured = _Measured()
    module = CausalLMModule(nf4_lora_builder(path, TARGETS, r=8), lr=1e-4)
    batches = padded_batches(6, batch_size=2, seq=256, vocab=1024)
    result = fit(
        module,
        strategy,
        batches,
        accelerator="gpu",
        precision="bf16-mixed",
        max_steps=3,
        deterministic=True,
        callbacks=[measured],
    )
    print(
        f"\n[input levels] {label}: peak {measured.peak / 2**20:.1f} MiB allocated, pinned inputs"
        f" {measured.pinned / 2**20:.2f} MiB, {measured.to_host / 2**20:.2f} MiB to host per micro-batch"
    )
    del module
    torch.cuda.empty_cache()
    return result


@pytest.fixture(scope="module")
def resident(small_llama_checkpoint: Path) -> RunResult:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    return _fit(small_llama_checkpoint, "auto", "resident")


@pytest.mark.parametrize(
    "options",
    [
        dict(offload_activations=3),
        dict(offload_activations=True),
        dict(input_checkpoint_every=3),
        dict(input_checkpoint_every=3, offload_activations=True),
        dict(input_checkpoint_every=2, offload_activations=5, block_size=2),
    ],
    ids=["split-3", "offload-all", "k3", "k3-offload-all", "k2-split-5-blocks-of-2"],
)
def test_input_levels_equal_resident(
    small_llama_checkpoint: Path, resident: RunResult, options: dict[str, Any]
) -> None:
    strategy = BlockwiseStrategy(vram_budget=None, **options)
    run = _fit(small_llama_checkpoint, strategy, ", ".join(f"{k}={v}" for k, v in options.items()))
    assert_equal_runs(resident, run)


def test_control_a_replay_under_another_rng_state_differs(
    small_llama_checkpoint: Path, resident: RunResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison can fail on the card: replays that draw fresh dropout masks change the run."""

    def replay_without_rng(self: Segment, below: int, position: int) -> None:
        hidden = self._inputs[below]
        for index in range(below, position):
            layer, call, _ = self.members[index]
            layer.residency.acquire(layer.index, Pass.REPLAY)
            with torch.random.fork_rng(devices=[torch.cuda.current_device()]), torch.no_grad():
                with call.autocast_context():
                    hidden = layer.rerun(hidden, call)
            layer.residency.release(layer.index, Pass.REPLAY)
            self._inputs[index + 1] = hidden

    monkeypatch.setattr(Segment, "_replay", replay_without_rng)
    run = _fit(small_llama_checkpoint, BlockwiseStrategy(vram_budget=None, input_checkpoint_every=3), "control")
    assert runs_differ(resident, run)


class _FlipOneOffloadedBit(CausalLMModule):
    """Flips one bit of the first offloaded input between the first forward and its backward."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 0:
            torch.cuda.synchronize()  # the copy to the host slab has landed
            self.trainer.strategy.activation_offload.held()[0].view(torch.uint8).view(-1)[5] ^= 0x10
        return loss


def test_control_a_flipped_bit_of_an_offloaded_input_differs(small_llama_checkpoint: Path, resident: RunResult) -> None:
    """The split's host copies are what the backward reads: one flipped bit in one changes the run."""
    module = _FlipOneOffloadedBit(nf4_lora_builder(small_llama_checkpoint, TARGETS, r=8), lr=1e-4)
    batches = padded_batches(6, batch_size=2, seq=256, vocab=1024)
    strategy = BlockwiseStrategy(vram_budget=None, offload_activations=3)
    run = fit(module, strategy, batches, accelerator="gpu", precision="bf16-mixed", max_steps=3, deterministic=True)
    assert runs_differ(resident, run)
