"""Input checkpoints (NOTE [ Input checkpoints ]): every k-th layer input kept, the others replayed, and exact.

Runs of 8-layer Llama NF4 models with LoRA and attention dropout, two accumulated micro-batches per step, are
`torch.equal` to resident training and to the run that keeps every input; each layer but a segment's top runs
three times per micro-batch; the controls replay under the wrong RNG state and flip a bit of a kept input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay import remat
from lightning_blockwise.replay.segments import Segment
from lightning_blockwise.residency import streamer as streamer_module
from lightning_blockwise.residency.base import AlwaysResident, Pass
from lightning_blockwise.residency.step_order import step_order
from lightning_blockwise.residency.streamer import BlockStreamer
from tests.helpers.callbacks import ForwardCounts
from tests.helpers.models import (
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    padded_batches,
    runs_differ,
    unmasked,
)

NUM_LAYERS = 8
_ACQUIRE = BlockStreamer.acquire


@pytest.fixture(scope="module")
def checkpoint(tiny_llama8_checkpoint: Path) -> Path:
    return tiny_llama8_checkpoint


def _nf4(checkpoint: Path) -> Any:
    return lambda: build_model("llama", checkpoint=checkpoint, quantized=True)


@pytest.fixture(scope="module")
def resident(checkpoint: Path) -> Any:
    return fit(CausalLMModule(_nf4(checkpoint)), "auto", max_steps=2)


def _runs_per_micro_batch(every: int) -> list[int]:
    """Forward, replay, recompute: three runs, but two for each segment's top layer (not replayed)."""
    tops = {min(first + every, NUM_LAYERS) - 1 for first in range(0, NUM_LAYERS, every)}
    return [2 if layer in tops else 3 for layer in range(NUM_LAYERS)]


@pytest.mark.parametrize(
    "options",
    [
        dict(input_checkpoint_every=2),
        dict(input_checkpoint_every=3, block_size=2),
        dict(input_checkpoint_every=3, offload_activations=True),
        dict(input_checkpoint_every=4, offload_activations=5, prefetch_depth=1),
    ],
    ids=["k2", "k3-blocks-of-2", "k3-offloaded", "k4-split-5"],
)
def test_input_checkpoints_equal_resident_and_keeping_every_input(
    checkpoint: Path, resident: Any, options: dict[str, Any]
) -> None:
    every = options["input_checkpoint_every"]
    counts = ForwardCounts()
    checkpointed = fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(**options), callbacks=[counts], max_steps=2)
    assert_equal_runs(resident, checkpointed)
    without = {key: value for key, value in options.items() if key != "input_checkpoint_every"}
    assert_equal_runs(checkpointed, fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(**without), max_steps=2))
    micro_batches = len(checkpointed.losses)
    assert counts.counts == [micro_batches * runs for runs in _runs_per_micro_batch(every)]


class _HostCopies(CausalLMModule):
    """What the offload holds between each forward and its backward."""

    def __init__(self, *args: Any, flip: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flip = flip
        self.held: list[int] = []
        self.kept: list[int] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        offload = self.trainer.strategy.activation_offload
        offload.reset_stats()
        loss = super().training_step(batch, batch_idx)
        held = offload.held()
        self.held.append(len(held))
        self.kept.append(offload.stats.kept_on_device)
        if self.flip and batch_idx == 0:
            held[-1].view(torch.uint8).view(-1)[5] ^= 0x10  # one bit of the top segment's kept input
        return loss


def test_only_the_checkpoints_wait_for_the_backward(checkpoint: Path) -> None:
    """k=3 with the first 5 layers offloaded: inputs 0 and 3 in host memory, 6 on the device, nothing else."""
    module = _HostCopies(_nf4(checkpoint))
    strategy = BlockwiseStrategy(input_checkpoint_every=3, offload_activations=5)
    fit(module, strategy, max_steps=1)
    assert module.held == [2, 2] and module.kept == [1, 1]


def test_control_a_replay_under_another_rng_state_differs(
    checkpoint: Path, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay must draw the forward's dropout masks: replayed under the current RNG state, the run differs."""

    def replay_without_rng(self: Segment, below: int, position: int) -> None:
        hidden = self._inputs[below]
        for index in range(below, position):
            layer, call, _ = self.members[index]
            layer.residency.acquire(layer.index, Pass.REPLAY)
            with torch.random.fork_rng(devices=[]), torch.no_grad(), call.autocast_context():
                hidden = layer.rerun(hidden, call)
            layer.residency.release(layer.index, Pass.REPLAY)
            self._inputs[index + 1] = hidden

    monkeypatch.setattr(Segment, "_replay", replay_without_rng)
    broken = fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(input_checkpoint_every=3), max_steps=2)
    assert runs_differ(resident, broken)


def test_control_a_flipped_bit_of_a_kept_input_changes_the_run(checkpoint: Path, resident: Any) -> None:
    tampered = _HostCopies(_nf4(checkpoint), flip=True)
    run = fit(tampered, BlockwiseStrategy(input_checkpoint_every=3, offload_activations=True), max_steps=2)
    assert runs_differ(resident, run)


def test_a_layer_whose_input_was_changed_between_layers_starts_its_own_segment(
    checkpoint: Path, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An in-place change of a layer's output under no_grad: not replayable, so the next layer keeps its input.

    The hook adds zero in place (values unchanged, version bumped): the run stays exact, and layer 1 (inside the
    first segment for k=4) starts a segment of its own. Control: joining anyway would have replayed it.
    """
    started: list[int] = []
    original = Segment.__init__

    def record(self: Segment, hidden: Tensor, *args: Any) -> None:
        original(self, hidden, *args)
        started.append(1)

    def bump(module: torch.nn.Module, args: Any, output: Tensor) -> None:
        with torch.no_grad():
            output.add_(0)

    class _Bumped(CausalLMModule):
        def configure_model(self) -> None:
            super().configure_model()
            self.model.get_decoder().layers[0].register_forward_hook(bump)

    monkeypatch.setattr(Segment, "__init__", record)
    run = fit(_Bumped(_nf4(checkpoint)), BlockwiseStrategy(input_checkpoint_every=4), max_steps=1)
    assert_equal_runs(fit(_Bumped(_nf4(checkpoint)), "auto", max_steps=1), run)
    # Segments per micro-batch: [0], [1, 4), [4, 8): three, where the unbumped run has two.
    assert len(started) == 3 * len(run.losses)


@pytest.mark.parametrize("value", [1, 0, True, "2", 2.0])
def test_input_checkpoint_every_must_be_at_least_two(value: Any) -> None:
    with pytest.raises(MisconfigurationException, match=rf"input_checkpoint_every={value!r}\)` must be None"):
        BlockwiseStrategy(input_checkpoint_every=value)


def test_input_checkpoints_are_refused_with_block_major_windows() -> None:
    with pytest.raises(MisconfigurationException, match=r"block_major_accumulation=True, input_checkpoint_every=2"):
        BlockwiseStrategy(input_checkpoint_every=2, block_major_accumulation=True)


def test_a_second_backward_is_refused_naming_the_option() -> None:
    """The replayed inputs live on the segment: `retain_graph=True` cannot run the backward twice."""
    model = build_model("llama")
    layers = model.get_decoder().layers
    params = [[p for p in layer.parameters() if p.requires_grad] for layer in layers]
    remat.install(layers, params, AlwaysResident(), checkpoint_every=2)
    loss = model(**padded_batches(1)[0]).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward reached the input checkpoint of decoder layer 2"):
        loss.backward()


def test_step_order_replays_each_segment_before_its_backward() -> None:
    """7 layers, k=3: segments [0, 3), [3, 6), [6]; the backward replays 3, 4 before 5, 4, 3, and 0, 1 before 2."""
    order = [(layer, phase.value[0]) for layer, phase in step_order(4, Pass.FORWARD, 7, 3)]
    backward = [(6, "b"), (3, "r"), (4, "r"), (5, "b"), (4, "b"), (3, "b"), (0, "r"), (1, "r"), (2, "b"), (1, "b")]
    assert order == [(5, "f"), (6, "f"), *backward, (0, "b")]
    assert [layer for layer, _ in step_order(4, Pass.REPLAY, 7, 3)] == [5, 4, 3, 0, 1, 2, 1, 0]
    assert list(step_order(3, Pass.BACKWARD, 7, None)) == [(2, Pass.BACKWARD), (1, Pass.BACKWARD), (0, Pass.BACKWARD)]


class _Misses(Callback):
    """Acquires, after the first micro-batch, whose block no earlier acquire had started copying (a stall)."""

    def __init__(self) -> None:
        self.misses: list[tuple[int, Pass]] = []
        self.counting = False

    def on_train_batch_end(self, *args: Any) -> None:
        self.counting = True


def _count_misses(monkeypatch: pytest.MonkeyPatch, misses: _Misses) -> None:

    def acquire(self: BlockStreamer, layer: int, phase: Pass) -> None:
        block = self.plan.block_of(layer)
        if misses.counting and block not in self.resident and block not in self._block_slot:
            misses.misses.append((layer, phase))
        _ACQUIRE(self, layer, phase)

    monkeypatch.setattr(BlockStreamer, "acquire", acquire)


def test_the_streamer_prefetches_along_the_replays(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block after the first micro-batch was on its way before its acquire, replays included.

    Control: a streamer that prefetches in the pass's direction only (the step's order without the replays)
    waits for the first block of each replay.
    """
    misses = _Misses()
    _count_misses(monkeypatch, misses)
    fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(input_checkpoint_every=3), callbacks=[misses], max_steps=1)
    assert misses.misses == []
    plain = streamer_module.step_order
    monkeypatch.setattr(streamer_module, "step_order", lambda layer, phase, n, every: plain(layer, phase, n, None))
    misses = _Misses()
    _count_misses(monkeypatch, misses)
    fit(CausalLMModule(_nf4(checkpoint)), BlockwiseStrategy(input_checkpoint_every=3), callbacks=[misses], max_steps=1)
    assert (3, Pass.REPLAY) in misses.misses and (0, Pass.REPLAY) in misses.misses


class _KeepStreamedBlocks(Callback):
    """Makes layers ``kept`` keep their graphs while their blocks stream (as a budget's plan may)."""

    def __init__(self, kept: tuple[int, ...] = (2, 5)) -> None:
        self.kept = kept

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy._run.layers.restream(resident=(), kept=self.kept)


@pytest.mark.parametrize(
    ("kept", "every"),
    [((2, 5), 3), ((3, 4), 2)],
    ids=["layers-2-5-segments-of-3", "layers-3-4-segments-of-2"],
)
def test_kept_graphs_of_streamed_blocks_come_back_to_their_slot(
    checkpoint: Path, resident: Any, monkeypatch: pytest.MonkeyPatch, kept: tuple[int, ...], every: int
) -> None:
    """Replays move other blocks between slots; a block whose layer kept its graph still goes home, and exact.

    Two placements: kept layers inside segments of 3, and two neighbouring layers, the last of one segment of 2 and
    the first of the next. (Not every placement needs `homebound`: layers 1 and 6 in segments of 2 come home
    either way, so the control could not fail there.) Control: without `homebound`, the kept blocks land where the
    replays leave room and their graphs read whatever their forward slot holds then.
    """
    # Unmasked rows: a re-plan for masked ones at the first step would put back the plan's kept blocks.
    batches = unmasked(padded_batches(8))

    def run_blockwise() -> Any:
        strategy = BlockwiseStrategy(input_checkpoint_every=every, block_size=1)
        return fit(
            CausalLMModule(_nf4(checkpoint)), strategy, batches, callbacks=[_KeepStreamedBlocks(kept)], max_steps=2
        )

    run = run_blockwise()
    assert_equal_runs(fit(CausalLMModule(_nf4(checkpoint)), "auto", batches, max_steps=2), run)
    original = BlockStreamer.__init__
    monkeypatch.setattr(
        BlockStreamer, "__init__", lambda self, *a, homebound=(), **k: original(self, *a, homebound=(), **k)
    )
    assert runs_differ(run, run_blockwise())
