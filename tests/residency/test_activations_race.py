"""NOTE [ Layer-input offload ] on a CUDA device: the copies wait for what they must, even behind a slow compute stream.

`python -m pytest tests/residency/test_activations_race.py -s` on a CUDA machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay import remat
from lightning_blockwise.residency.activations import ActivationOffload
from tests.helpers.models import CausalLMModule, assert_equal_runs, fit, nf4_lora_builder, padded_batches, runs_differ

pytestmark = pytest.mark.gpu


def _fit(path: Path, strategy: Any) -> Any:
    batches = padded_batches(6, batch_size=2, seq=128, vocab=1024)
    module = CausalLMModule(nf4_lora_builder(path, ["q_proj", "v_proj", "down_proj"], r=8))
    return fit(module, strategy, batches, accelerator="gpu", precision="bf16-mixed", max_steps=3)


def _delay_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """~10 ms of GPU sleep before every layer run: the host issues saves and fetches far ahead of the kernels."""
    original = remat.RematLayer.run

    def slow_run(self: remat.RematLayer, hidden: Tensor, call: Any) -> Tensor:
        torch.cuda._sleep(20_000_000)
        return original(self, hidden, call)

    monkeypatch.setattr(remat.RematLayer, "run", slow_run)


def _copy_without_waiting(
    self: ActivationOffload, stream: torch.cuda.Stream | None, dst: Tensor, src: Tensor, after: Any
) -> torch.cuda.Event:
    assert stream is not None
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    return done


def test_offload_waits_for_delayed_compute(small_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resident = _fit(small_llama_checkpoint, "auto")
    _delay_compute(monkeypatch)
    # Every block streamed and recomputed: the card's default budget keeps this model resident, its graphs kept.
    offloaded = _fit(small_llama_checkpoint, BlockwiseStrategy(offload_activations=True, vram_budget=None))
    assert_equal_runs(resident, offloaded)


def test_control_copies_that_do_not_wait_race(small_llama_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race test can fail: a save that does not wait for the compute stream copies an input not written yet."""
    resident = _fit(small_llama_checkpoint, "auto")
    _delay_compute(monkeypatch)
    monkeypatch.setattr(ActivationOffload, "_copy", _copy_without_waiting)
    racing = _fit(small_llama_checkpoint, BlockwiseStrategy(offload_activations=True, vram_budget=None))
    assert runs_differ(resident, racing)
