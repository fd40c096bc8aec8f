"""NOTE [ Reused events ] on a CUDA device: after the first step, streaming and offload create no CUDA events.

`python -m pytest tests/residency/test_streamer_events.py -s` on a CUDA machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from tests.helpers.models import CausalLMModule, fit, nf4_lora_builder, padded_batches

pytestmark = pytest.mark.gpu


class _CountingEvent(torch.cuda.Event):
    made = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        type(self).made += 1


class _EventsPerStep(Callback):
    """CUDA events made through `torch.cuda.Event` during each training batch; can forget the streamer's."""

    def __init__(self, forget_streamer_events: bool = False) -> None:
        self.forget = forget_streamer_events
        self.per_step: list[int] = []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.forget:
            streamer = trainer.strategy.streamer
            streamer._copied = [None] * len(streamer._copied)
            streamer._freed = [None] * len(streamer._freed)
        self._start = _CountingEvent.made

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.per_step.append(_CountingEvent.made - self._start)


def _fit(path: Path, counter: _EventsPerStep, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _CountingEvent)
    batches = padded_batches(6, batch_size=2, seq=128, vocab=1024)
    module = CausalLMModule(nf4_lora_builder(path, ["q_proj", "v_proj", "down_proj"], r=8))
    # Every block streamed: the card's default budget (NOTE [ The card as the default budget ]) keeps it resident.
    strategy = BlockwiseStrategy(block_size=1, prefetch_depth=1, offload_activations=True, vram_budget=None)
    fit(module, strategy, batches, accelerator="gpu", precision="bf16-mixed", max_steps=3, callbacks=[counter])


def test_no_events_are_made_after_the_first_step(small_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = _EventsPerStep()
    _fit(small_llama_checkpoint, counter, monkeypatch)
    print(f"[events] made per training batch: {counter.per_step}")
    assert counter.per_step[0] > 0 and counter.per_step[1:] == [0] * 5


def test_control_the_count_sees_the_streamers_events(
    small_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count can fail: a streamer that forgets its slot events makes them anew every step."""
    counter = _EventsPerStep(forget_streamer_events=True)
    _fit(small_llama_checkpoint, counter, monkeypatch)
    assert all(made > 0 for made in counter.per_step)
