"""The host arena: exact sizes, host-RAM and CUDA errors, and its lifetime with the module."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.residency import arena
from lightning_blockwise.residency.arena import HostArena
from tests.helpers.models import CausalLMModule, build_model, fit, trainer


def test_slabs_are_exact_and_aligned() -> None:
    host = HostArena([1000, 3, 512], pin=False)
    assert [slab.numel() for slab in host.slabs] == [1000, 3, 512]
    assert host.bytes_needed == 1515 and host.nbytes == 256 * 5 + 512
    assert all(slab.data_ptr() % 256 == host.storage.data_ptr() % 256 for slab in host.slabs)


def test_not_enough_host_ram_is_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arena, "available_host_memory", lambda: 3 * 2**30)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: pytest.fail("allocated before checking"))
    monkeypatch.setattr(os, "memfd_create", lambda *a, **k: pytest.fail("allocated before checking"))
    with pytest.raises(MisconfigurationException, match=r"needs 2\.15 GB of host RAM.*only 3\.22 GB are available"):
        HostArena([2 * 2**30], pin=False)


def test_strategy_refuses_a_base_larger_than_host_ram(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(arena, "available_host_memory", lambda: arena.HOST_RAM_RESERVE + 1000)
    module = CausalLMModule(lambda: build_model("llama", checkpoint=checkpoints["llama"], quantized=True))
    with pytest.raises(MisconfigurationException, match="of host RAM for the frozen decoder layers"):
        fit(module, "blockwise")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_pinning_without_cuda_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match="CUDA is not available"):
        HostArena([16], pin=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_gpu_requested_without_cuda_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match="No supported gpu backend"):  # Lightning's own check
        trainer("blockwise", accelerator="gpu")
    with pytest.raises(MisconfigurationException, match=r"device='cuda:0'\).*CUDA is not available"):
        BlockwiseStrategy(device="cuda:0")


def test_dropping_the_module_frees_the_arena(checkpoints: dict[str, Path]) -> None:
    module = CausalLMModule(lambda: build_model("qwen3", checkpoint=checkpoints["qwen3"], quantized=True))
    strategy = BlockwiseStrategy()
    fit(module, strategy, max_steps=1)
    assert strategy.host_copy is not None
    alive = weakref.ref(strategy.host_copy.arena)
    del module, strategy
    gc.collect()
    assert alive() is None
