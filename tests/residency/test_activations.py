"""Layer-input offload: exact, the inputs really wait in host memory, and the backward really reads them there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise import BlockwiseStrategy
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


class _Inspecting(CausalLMModule):
    """Looks at the offload between each forward and its backward; may tamper with one saved input."""

    def __init__(self, *args: Any, flip_at: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flip_at = flip_at
        self.held: list[list[Tensor]] = []
        self.device_to_host: list[int] = []
        self.host_to_device: list[int] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        offload = self.trainer.strategy.activation_offload
        if offload is not None:
            self.host_to_device.append(offload.reset_stats().host_to_device_bytes)
        loss = super().training_step(batch, batch_idx)
        if offload is not None:
            held = offload.held()
            self.held.append([(t.data_ptr(), t.device, t.dtype, tuple(t.shape)) for t in held])
            self.device_to_host.append(offload.stats.device_to_host_bytes)
            if batch_idx == self.flip_at:
                held[1].view(torch.uint8).view(-1)[5] ^= 0x10  # one bit of layer 1's saved input
        return loss


def _nf4(checkpoints: dict[str, Path], model_type: str = "llama") -> Any:
    return lambda: build_model(model_type, checkpoint=checkpoints[model_type], quantized=True)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_offloaded_run_equals_resident(model_type: str, checkpoints: dict[str, Path]) -> None:
    resident = fit(CausalLMModule(_nf4(checkpoints, model_type)), "auto")
    offloaded = fit(CausalLMModule(_nf4(checkpoints, model_type)), BlockwiseStrategy(offload_activations=True))
    assert_equal_runs(resident, offloaded)


def test_offload_under_bf16_autocast_equals_resident() -> None:
    resident = fit(CausalLMModule(lambda: build_model("qwen2")), "auto", precision="bf16-mixed")
    strategy = BlockwiseStrategy(offload_activations=True, block_size=2)
    offloaded = fit(CausalLMModule(lambda: build_model("qwen2")), strategy, precision="bf16-mixed")
    assert_equal_runs(resident, offloaded)


def test_inputs_wait_in_host_memory_and_every_byte_is_counted(checkpoints: dict[str, Path]) -> None:
    module = _Inspecting(_nf4(checkpoints))
    fit(module, BlockwiseStrategy(offload_activations=True))
    offload_bytes = NUM_LAYERS * BATCH * SEQ * HIDDEN * 4  # fp32 on the CPU
    assert len(module.held) == 8  # 4 optimizer steps x 2 micro-batches
    for held, copied in zip(module.held, module.device_to_host, strict=True):
        # Between forward and backward: one host copy per layer, each its own slab, in host memory.
        assert len(held) == NUM_LAYERS and len({ptr for ptr, *_ in held}) == NUM_LAYERS
        assert all(device.type == "cpu" and shape == (BATCH, SEQ, HIDDEN) for _, device, _, shape in held)
        assert copied == offload_bytes
    # Each backward brought every input back (read before the next step's forward resets the counter).
    assert module.host_to_device[1:] == [offload_bytes] * 7


def test_control_flipping_one_offloaded_byte_changes_the_run(checkpoints: dict[str, Path]) -> None:
    resident = fit(CausalLMModule(_nf4(checkpoints)), "auto")
    tampered = fit(_Inspecting(_nf4(checkpoints), flip_at=0), BlockwiseStrategy(offload_activations=True))
    assert runs_differ(resident, tampered)
    untouched = fit(_Inspecting(_nf4(checkpoints)), BlockwiseStrategy(offload_activations=True))
    assert_equal_runs(resident, untouched)


def test_offload_off_keeps_inputs_on_the_device(checkpoints: dict[str, Path]) -> None:
    """Forced off (and "auto" on the CPU without a budget): no offload object, nothing copied."""
    for option in (False, None):
        module = _Inspecting(_nf4(checkpoints))
        fit(module, BlockwiseStrategy(offload_activations=option))
        assert module.held == [] and module.trainer.strategy.step_plan.offload is False


def test_saves_never_taken_back_return_their_slabs() -> None:
    """A graph dropped without its backward gives its slab back: the pool does not grow step after step."""
    offload = ActivationOffload(torch.device("cpu"), num_layers=2, slab_bytes=64, pin=False)
    allocated = offload.host_bytes
    for _ in range(5):
        saved = [offload.save(torch.randn(4, 4)) for _ in range(2)]
        assert len(offload.held()) == 2
        del saved
    assert offload.host_bytes == allocated and offload.held() == [] and len(offload._live) <= 2


def test_more_saves_than_layers_grow_the_pool_and_come_back_in_order() -> None:
    offload = ActivationOffload(torch.device("cpu"), num_layers=2, slab_bytes=64, pin=False)
    inputs = [torch.randn(4, 4) for _ in range(3)]
    allocated = offload.host_bytes
    saved = [offload.save(x) for x in inputs]
    assert offload.host_bytes == 2 * allocated  # a second set of slabs for the third save
    for x, handle in reversed(list(zip(inputs, saved, strict=True))):
        assert torch.equal(offload.load(handle), x)


def test_a_larger_input_gets_larger_slabs() -> None:
    offload = ActivationOffload(torch.device("cpu"), num_layers=2, slab_bytes=64, pin=False)
    big = torch.randn(8, 8)
    handle = offload.save(big)
    assert offload.slab_bytes == big.numel() * 4
    assert torch.equal(offload.load(handle), big)


def test_a_non_contiguous_input_stays_on_the_device() -> None:
    offload = ActivationOffload(torch.device("cpu"), num_layers=2, slab_bytes=64, pin=False)
    x = torch.randn(4, 4).t()
    handle = offload.save(x)
    assert offload.stats.kept_on_device == 1 and offload.stats.device_to_host_bytes == 0
    assert offload.load(handle) is x


def test_offload_short_of_host_ram_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before allocating: the error says what the memory is for and how to need less."""
    monkeypatch.setattr("lightning_blockwise.residency.arena.available_host_memory", lambda: 2 * 1024**3 + 100)
    with pytest.raises(MisconfigurationException, match=r"layer inputs offloaded .*offload_activations=False"):
        ActivationOffload(torch.device("cpu"), num_layers=4, slab_bytes=1000, pin=False)


class _CountingList(list):
    """A list that counts how often it is walked: the handle stack must not be walked per layer."""

    walks = 0

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()


def _saved_inputs(offload: ActivationOffload, count: int) -> tuple[list[Tensor], list[Any]]:
    inputs = [torch.randn(4, 4) for _ in range(count)]
    return inputs, [offload.save(x) for x in inputs]


def test_the_backward_order_never_walks_the_handles() -> None:
    """NOTE [ Layer-input offload ]: O(1) per layer; the one walk seen is the control (`held()` does walk)."""
    offload = ActivationOffload(torch.device("cpu"), num_layers=16, slab_bytes=64, pin=False)
    inputs, handles = _saved_inputs(offload, 16)
    offload._live = _CountingList(offload._live)
    _CountingList.walks = 0
    for x, handle in reversed(list(zip(inputs, handles, strict=True))):
        assert torch.equal(offload.load(handle), x)
    assert _CountingList.walks == 0
    offload.held()
    assert _CountingList.walks == 1


def test_each_load_prefetches_the_input_saved_just_before_it() -> None:
    offload = ActivationOffload(torch.device("cpu"), num_layers=4, slab_bytes=64, pin=False)
    _, handles = _saved_inputs(offload, 4)
    offload.load(handles[3])
    assert [h.pending for h in handles[:3]] == [True, True, False]
    assert len(offload.held()) == 2
    offload.load(handles[2])
    assert [h.pending for h in handles[:2]] == [True, False]
    assert offload.stats.host_to_device_bytes == 3 * 4 * 4 * 4  # 3 inputs on their way back, none twice


def test_out_of_order_loads_come_back_exact_and_fetch_each_input_once() -> None:
    offload = ActivationOffload(torch.device("cpu"), num_layers=6, slab_bytes=64, pin=False)
    inputs, handles = _saved_inputs(offload, 6)
    order = [2, 5, 4, 0, 3, 1]
    for index in order:
        assert torch.equal(offload.load(handles[index]), inputs[index]), f"input {index} came back wrong"
    assert offload.stats.host_to_device_bytes == 6 * 4 * 4 * 4
    assert offload.held() == [] and offload._live == []


def test_control_a_changed_host_copy_comes_back_changed() -> None:
    """The equality above can fail: a bit flipped in a host copy is what the load returns."""
    offload = ActivationOffload(torch.device("cpu"), num_layers=2, slab_bytes=64, pin=False)
    inputs, handles = _saved_inputs(offload, 2)
    handles[1].host.view(torch.uint8).view(-1)[3] ^= 0x01
    assert not torch.equal(offload.load(handles[1]), inputs[1])
    assert torch.equal(offload.load(handles[0]), inputs[0])


def test_handles_stay_bounded_when_graphs_are_dropped_or_half_differentiated() -> None:
    offload = ActivationOffload(torch.device("cpu"), num_layers=4, slab_bytes=64, pin=False)
    allocated = offload.host_bytes
    for step in range(20):
        inputs, handles = _saved_inputs(offload, 4)
        if step % 2:
            offload.load(handles[3])  # a backward that stops after one layer
        del inputs, handles
        assert len(offload._live) <= 2 * offload.num_layers
    assert offload.host_bytes == allocated and offload.held() == []
