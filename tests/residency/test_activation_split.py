"""Split layer inputs (NOTE [ Split layer inputs ]): the first layers' inputs in host memory, the rest on the device.

Exact against resident training (LoRA and attention dropout, two accumulated micro-batches per step), with
the host slabs sized for the offloaded layers only; the control flips one bit of an offloaded input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import StepShape
from lightning_blockwise.residency.activations import ActivationOffload
from tests.helpers.models import (
    NUM_LAYERS,
    SEQ,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    runs_differ,
)

HIDDEN = 32  # tests.helpers.models: the tiny configs' hidden size
BATCH = 2
INPUT_BYTES = BATCH * SEQ * HIDDEN * 4  # one layer's input, fp32 on the CPU


class _Inputs(CausalLMModule):
    """Records each layer's input and what the offload holds between forward and backward; may flip one bit."""

    def __init__(self, *args: Any, flip_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flip_at = flip_at
        self.inputs: dict[int, Tensor] = {}
        self.held: list[list[Tensor]] = []
        self.kept: list[int] = []
        self.device_to_host: list[int] = []
        self.host_to_device: list[int] = []

    def configure_model(self) -> None:
        super().configure_model()
        for index, layer in enumerate(self.model.get_decoder().layers):
            layer.register_forward_pre_hook(lambda _, args, index=index: self._record(index, args[0]))

    def _record(self, index: int, hidden: Tensor) -> None:
        self.inputs[index] = hidden.detach().clone()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        offload = self.trainer.strategy.activation_offload
        self.host_to_device.append(offload.reset_stats().host_to_device_bytes)
        loss = super().training_step(batch, batch_idx)
        held = offload.held()
        self.held.append([h.clone() for h in held])
        self.kept.append(offload.stats.kept_on_device)
        self.device_to_host.append(offload.stats.device_to_host_bytes)
        if batch_idx == self.flip_at:
            held[-1].view(torch.uint8).view(-1)[5] ^= 0x10  # one bit of the last offloaded layer's input
        return loss


def _nf4(checkpoints: dict[str, Path], model_type: str = "llama") -> Any:
    return lambda: build_model(model_type, checkpoint=checkpoints[model_type], quantized=True)


@pytest.mark.parametrize(("model_type", "offloaded"), [("llama", 2), ("gemma2", 1), ("llama", 3)])
def test_split_run_equals_resident(model_type: str, offloaded: int, checkpoints: dict[str, Path]) -> None:
    resident = fit(CausalLMModule(_nf4(checkpoints, model_type)), "auto")
    module = _Inputs(_nf4(checkpoints, model_type))
    strategy = BlockwiseStrategy(offload_activations=offloaded)
    split = fit(module, strategy)
    assert_equal_runs(resident, split)
    # Between each forward and its backward: the first `offloaded` layers' inputs in host memory, bit for bit,
    # the others kept on the device; each backward brought the offloaded ones back.
    assert len(module.held) == len(split.losses) == 8
    for held, kept, copied in zip(module.held, module.kept, module.device_to_host, strict=True):
        assert len(held) == offloaded and kept == NUM_LAYERS - offloaded
        assert copied == offloaded * INPUT_BYTES
    last = module.held[-1]
    assert all(torch.equal(last[i], module.inputs[i]) for i in range(offloaded))
    assert module.host_to_device[1:] == [offloaded * INPUT_BYTES] * 7
    # Host slabs for the offloaded layers only, exact size; the plan counts those bytes.
    offload = strategy.activation_offload
    assert offload is None  # closed at teardown
    assert strategy.step_plan is not None and strategy.step_plan.offload
    assert strategy.step_plan.offload_host_bytes == offloaded * strategy.step_plan.shape.input_bytes()


def test_host_slabs_are_sized_for_the_offloaded_layers_only(checkpoints: dict[str, Path]) -> None:
    sizes: list[tuple[int, int]] = []

    class _Slabs(CausalLMModule):
        def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
            offload = self.trainer.strategy.activation_offload
            sizes.append((offload.host_bytes, offload.slab_bytes))
            return super().training_step(batch, batch_idx)

    fit(_Slabs(_nf4(checkpoints)), BlockwiseStrategy(offload_activations=2), max_steps=1)
    host_bytes, slab_bytes = sizes[0]
    assert slab_bytes >= INPUT_BYTES and host_bytes == 2 * slab_bytes  # 2 slabs, not one per layer


def test_control_flipping_one_offloaded_bit_changes_the_split_run(checkpoints: dict[str, Path]) -> None:
    resident = fit(CausalLMModule(_nf4(checkpoints)), "auto")
    tampered = fit(_Inputs(_nf4(checkpoints), flip_at=0), BlockwiseStrategy(offload_activations=2))
    assert runs_differ(resident, tampered)


def test_all_and_none_behave_as_true_and_false(checkpoints: dict[str, Path]) -> None:
    """`offload_activations=4` of 4 layers offloads every input; `0` offloads none (no offload object at all)."""
    resident = fit(CausalLMModule(_nf4(checkpoints)), "auto", max_steps=1)
    every = _Inputs(_nf4(checkpoints))
    assert_equal_runs(resident, fit(every, BlockwiseStrategy(offload_activations=NUM_LAYERS), max_steps=1))
    assert [len(h) for h in every.held] == [NUM_LAYERS] * 2 and every.kept == [0, 0]
    none = BlockwiseStrategy(offload_activations=0)
    assert_equal_runs(resident, fit(CausalLMModule(_nf4(checkpoints)), none, max_steps=1))
    assert none.step_plan is not None and not none.step_plan.offload and none.step_plan.offload_host_bytes == 0


@pytest.mark.parametrize("value", [-1, 2.5, "2"])
def test_offload_count_must_be_a_count(value: Any) -> None:
    with pytest.raises(MisconfigurationException, match=rf"offload_activations={value!r}\)` must be True, False"):
        BlockwiseStrategy(offload_activations=value)


def test_more_offloaded_layers_than_the_model_has_is_refused_at_setup(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(MisconfigurationException, match=r"offload_activations=5\)`.* 4 decoder layers; pass at most 4"):
        fit(CausalLMModule(_nf4(checkpoints)), BlockwiseStrategy(offload_activations=5), max_steps=1)


def test_the_plan_counts_kept_inputs_on_the_device() -> None:
    """The step's device peak holds the kept inputs and those in flight; the host bytes the offloaded ones."""
    config = build_model("llama", peft=False).config
    shapes = {m: StepShape.for_config(config, 4096, 8, offload_inputs=m != 0, offloaded_layers=m) for m in (0, 2, 5, 8)}
    one = shapes[0].input_bytes()
    peaks = {m: shape.activation_peak() for m, shape in shapes.items()}
    # Saved inputs on the device: all 8; 6 kept + 2 in flight; 3 kept + 3 in flight; 3 in flight (rounded as
    # the allocator rounds, x 1.02).
    assert peaks[0] == peaks[2] > peaks[5] > peaks[8]
    assert abs((peaks[0] - peaks[5]) - 1.02 * 2 * one) <= 1 and abs((peaks[5] - peaks[8]) - 1.02 * 3 * one) <= 1
    assert [shapes[m].offloaded_host_bytes() for m in (0, 2, 5, 8)] == [0, 2 * one, 5 * one, 8 * one]


def test_the_lowest_kept_input_brings_back_the_highest_offloaded_one() -> None:
    """One layer ahead across the split: taking back layer 2's kept input starts the copy of layer 1's."""
    offload = ActivationOffload(torch.device("cpu"), num_layers=2, slab_bytes=64, pin=False)
    inputs = [torch.randn(4, 4) for _ in range(4)]
    handles = [offload.save(x) for x in inputs[:2]] + [offload.keep(x) for x in inputs[2:]]
    every = ActivationOffload(torch.device("cpu"), num_layers=4, slab_bytes=64, pin=False)
    assert 2 * offload.host_bytes == every.host_bytes and offload.stats.kept_on_device == 2
    assert torch.equal(offload.load(handles[3]), inputs[3])
    assert [h.pending for h in handles[:2]] == [True, True]  # layer 2's input is still on the device: no copy yet
    assert torch.equal(offload.load(handles[2]), inputs[2])
    assert [h.pending for h in handles[:2]] == [True, False]
    assert torch.equal(offload.load(handles[1]), inputs[1]) and torch.equal(offload.load(handles[0]), inputs[0])
    assert offload.stats.host_to_device_bytes == 2 * 4 * 4 * 4 and offload._live == []


def test_a_kept_input_changed_in_place_is_refused() -> None:
    """As autograd refuses a saved tensor modified in place: the recompute would read other values."""
    offload = ActivationOffload(torch.device("cpu"), num_layers=1, slab_bytes=64, pin=False)
    x = torch.randn(4, 4)
    handle = offload.keep(x)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        offload.load(handle)
