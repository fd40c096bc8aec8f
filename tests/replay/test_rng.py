"""The device generator's replay before each recompute, checked on the CPU with a fake device generator.

Every CPU control arm elsewhere switches both generators off at once, so the device half of NOTE [ RNG replay ]
(replay/rng.py) had no CPU guard (issue 41, item 12): a replay that set back the CPU generator only passed them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor

from lightning_blockwise.replay import remat
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import NUM_LAYERS, CausalLMModule, build_model, fit

FAKE = torch.device("cuda", 0)


class _FakeDeviceGenerator:
    """Stands for ``torch.cuda``'s generator of ``FAKE``: a counter as its state; every layer forward draws once."""

    def __init__(self) -> None:
        self.state = torch.tensor([0])
        self.captured: list[int] = []
        #: (layer index, the generator's state) at the start of each recompute, in order.
        self.at_rerun: list[tuple[int, int]] = []

    def get_rng_state(self, device: object = None) -> Tensor:
        return self.state.clone()

    def set_rng_state(self, state: Tensor, device: object = None) -> None:
        self.state = state.clone()

    def capture(self) -> RngSnapshot:
        """A layer's snapshot before its forward on the fake device; its dropout then draws (the state advances)."""
        state = self.get_rng_state()
        self.captured.append(int(state))
        self.state = self.state + 1
        return RngSnapshot(torch.get_rng_state(), FAKE, state)


def _fit_on_fake_device(monkeypatch: pytest.MonkeyPatch) -> _FakeDeviceGenerator:
    """One optimizer step of 2 micro-batches, every layer's snapshot taken on ``FAKE``; what the generator saw."""
    fake = _FakeDeviceGenerator()
    monkeypatch.setattr(RngSnapshot, "capture", classmethod(lambda cls, device: fake.capture()))
    monkeypatch.setattr(torch.cuda, "get_rng_state", fake.get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake.set_rng_state)
    rerun = remat.RematLayer.rerun

    def noted(self: remat.RematLayer, hidden: Tensor, call: object) -> Tensor:
        fake.at_rerun.append((self.index, int(fake.state)))
        return rerun(self, hidden, call)  # type: ignore[arg-type]

    monkeypatch.setattr(remat.RematLayer, "rerun", noted)
    fit(CausalLMModule(lambda: build_model("llama")), "blockwise", max_steps=1)
    return fake


def _expected(fake: _FakeDeviceGenerator) -> list[tuple[int, int]]:
    """Each recompute (layers in reverse, micro-batch by micro-batch) under the state its forward was captured at."""
    micro_batches = len(fake.captured) // NUM_LAYERS
    return [(i, fake.captured[m * NUM_LAYERS + i]) for m in range(micro_batches) for i in reversed(range(NUM_LAYERS))]


def test_the_device_generator_is_set_to_the_forwards_state_before_each_recompute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = _fit_on_fake_device(monkeypatch)
    assert len(fake.captured) == 2 * NUM_LAYERS
    assert fake.at_rerun == _expected(fake)
    # And the recomputes leave the device stream where the forwards left it, as resident training does.
    assert int(fake.state) == len(fake.captured)


def test_control_a_replay_of_the_cpu_generator_only_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The realistic bug: the replay forks both generators but sets back only the CPU one."""

    @contextmanager
    def cpu_only(self: RngSnapshot) -> Iterator[None]:
        with torch.random.fork_rng(devices=[self.device], device_type="cuda"):
            torch.set_rng_state(self.cpu_state)
            yield

    monkeypatch.setattr(RngSnapshot, "replay", cpu_only)
    fake = _fit_on_fake_device(monkeypatch)
    assert len(fake.at_rerun) == 2 * NUM_LAYERS and fake.at_rerun != _expected(fake)
