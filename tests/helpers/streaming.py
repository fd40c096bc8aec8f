"""Streaming test helpers shared by the CPU and GPU tests: a fault that breaks slot affinity, a step-peak probe."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.streamer import BlockStreamer
from lightning_blockwise.strategy.module_budget import device_bytes


def backward_blocks_come_back_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break slot affinity: two spare slots, and the backward copies each block into one outside its home.

    (With ``prefetch_depth + 1`` slots the slot a copy may use is forced: the spare ones make another possible.)
    """
    original_init, original_acquire = BlockStreamer.__init__, BlockStreamer.acquire
    original_fetch = BlockStreamer._fetch

    def init(self: BlockStreamer, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.slots:
            self.slots += [torch.empty_like(self.slots[0]) for _ in range(2)]
            self._slot_block += [None, None]
            self._copied += [None, None]
            self._freed += [None, None]

    def acquire(self: BlockStreamer, layer: int, phase: Pass) -> None:
        self._phase = phase
        original_acquire(self, layer, phase)

    def fetch(self: BlockStreamer, block: int, window: Any) -> None:
        home = self._home[block]
        # In the backward any slot but the home one; in the forward the home one unless a displaced block in the
        # window holds it (the spare slots leave one free of the window either way).
        backward = getattr(self, "_phase", None) is Pass.BACKWARD
        if backward or self._slot_block[home] in window:
            self._home[block] = next(
                s for s, held in enumerate(self._slot_block) if held not in window and not (backward and s == home)
            )
        try:
            original_fetch(self, block, window)
        finally:
            self._home[block] = home

    monkeypatch.setattr(BlockStreamer, "__init__", init)
    monkeypatch.setattr(BlockStreamer, "acquire", acquire)
    monkeypatch.setattr(BlockStreamer, "_fetch", fetch)


class StepPeak(Callback):
    """The training steps' allocated peak, less what the process held outside the module before each step.

    The whole model is built on the device before the strategy moves its blocks to the host, earlier fits'
    results stay on the device, and the test module records each step's losses and grads there: none of it is the
    strategy's to plan, and for a model this small the first two alone are larger than a step's peak. What a step
    records itself counts against it.
    """

    outside = allocated = step_outside = 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.outside = torch.cuda.memory_allocated() - device_bytes(pl_module, pl_module.device)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        records = [*pl_module.losses, *(grad for grads in pl_module.grads for grad in grads.values())]
        self.step_outside = self.outside + sum(record.untyped_storage().nbytes() for record in records)
        torch.cuda.reset_peak_memory_stats()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        torch.cuda.synchronize()
        self.allocated = max(self.allocated, torch.cuda.max_memory_allocated() - self.step_outside)


__all__ = ["StepPeak", "backward_blocks_come_back_elsewhere"]
