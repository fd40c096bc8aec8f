"""Checkpoints on the GPU: full-state files read the host copy while blocks sit in device slots; exact resume.

Run on a CUDA machine: `CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/strategy/test_gpu_checkpointing.py -s`
(deterministic mode: on the GPU resident training is reproducible only there, DESIGN.md section 2).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.strategy.checkpointing import is_quantization_metadata
from tests.helpers.models import (
    DEFAULT_TARGETS,
    CausalLMModule,
    RunResult,
    assert_equal_runs,
    collect,
    nf4_lora_builder,
    padded_batches,
    trainer,
    trainer_optimizer,
)

pytestmark = pytest.mark.gpu

TARGETS = DEFAULT_TARGETS
BATCHES = 6
RESUME_AT = BATCHES + 2
TOTAL = 2 * BATCHES + 2


def _data() -> StatefulDataLoader:
    batches = padded_batches(BATCHES, batch_size=1, seq=256, vocab=1024)
    sampler = RandomSampler(batches, generator=torch.Generator().manual_seed(7))
    return StatefulDataLoader(batches, batch_size=None, sampler=sampler, generator=torch.Generator().manual_seed(8))


def _run(path: Path, root: Path, steps: int, ckpt_path: Path | None = None, **strategy: object) -> RunResult:
    pl.seed_everything(0, verbose=False)
    module = CausalLMModule(nf4_lora_builder(path, TARGETS, r=8, lora_dropout=0.1), in_configure_model=True, lr=1e-3)
    checkpoints = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fitter = trainer(
        BlockwiseStrategy(**{"vram_budget": None, **strategy}),
        accelerator="gpu",
        precision="bf16-mixed",
        deterministic=True,
        max_steps=steps,
        accumulate_grad_batches=1,
        enable_checkpointing=True,
        callbacks=[checkpoints],
        default_root_dir=root,
    )
    fitter.fit(module, _data(), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


def test_gpu_resume_mid_epoch_is_exact(small_llama_checkpoint: Path, tmp_path: Path) -> None:
    whole = _run(small_llama_checkpoint, tmp_path / "whole", TOTAL)
    _run(small_llama_checkpoint, tmp_path / "first", RESUME_AT)
    resumed = _run(
        small_llama_checkpoint, tmp_path / "second", TOTAL, ckpt_path=tmp_path / "first" / f"step={RESUME_AT}.ckpt"
    )
    tail = TOTAL - RESUME_AT
    assert_equal_runs(RunResult(whole.losses[-tail:], whole.grads[-tail:], whole.weights, whole.optimizer), resumed)
    print(f"[gpu checkpointing] resume at step {RESUME_AT} of {TOTAL}: {tail} steps torch.equal (deterministic mode)")


def test_gpu_full_state_checkpoint_reads_the_host_copy(small_llama_checkpoint: Path, tmp_path: Path) -> None:
    """Saved mid-run (streamed blocks bound to device slots): the base as loaded, on the CPU."""
    _run(small_llama_checkpoint, tmp_path / "full", 2, save_frozen_base=True)
    state = torch.load(tmp_path / "full" / "step=1.ckpt", weights_only=False)["state_dict"]
    reference = nf4_lora_builder(small_llama_checkpoint, TARGETS, r=8, lora_dropout=0.1)().state_dict()
    frozen = [key for key in reference if "lora_" not in key]
    in_arena = [key for key in frozen if ".layers." in key and not is_quantization_metadata(key)]
    assert in_arena
    # The decoder layers' frozen tensors come from the host copy, not from the device slots they were bound to.
    assert all(state[f"model.{key}"].device.type == "cpu" for key in in_arena)
    for key in frozen:
        assert torch.equal(state[f"model.{key}"].cpu(), reference[key].cpu()), key
