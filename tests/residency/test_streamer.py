"""The residency engine on the CPU: host arena, slots, prefetch order, rebinding and budgets through `Trainer.fit`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.residency.binding import unbound, views
from lightning_blockwise.residency.placement import host_copy_of
from lightning_blockwise.residency.streamer import BlockStreamer, TransferStats
from tests.helpers.models import CausalLMModule, assert_equal_runs, build_model, fit, runs_differ


class _Stats(Callback):
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        streamer = trainer.strategy.streamer
        self.stats = TransferStats(streamer.stats.copies, streamer.stats.bytes)
        self.slots = len(streamer.slots)
        self.resident = streamer.resident


def _nf4(checkpoints: dict[str, Path], model_type: str = "llama") -> Any:
    return lambda: build_model(model_type, checkpoint=checkpoints[model_type], quantized=True)


def test_prefetch_order_loads_each_block_once_per_turn(checkpoints: dict[str, Path]) -> None:
    """4 blocks, 3 slots: the first micro-batch loads 0,1,2,3 and reloads 0; later ones load only 3 and 0."""
    stats = _Stats()
    module = CausalLMModule(_nf4(checkpoints))
    fit(module, BlockwiseStrategy(block_size=1, prefetch_depth=2), callbacks=[stats], max_steps=2)
    assert stats.slots == 3
    micro_batches = 4
    assert stats.stats.copies == 5 + 2 * (micro_batches - 1)


def test_blocks_are_bound_to_the_host_arena_after_fit(checkpoints: dict[str, Path]) -> None:
    module = CausalLMModule(_nf4(checkpoints))
    strategy = BlockwiseStrategy(block_size=2)
    fit(module, strategy, max_steps=1)
    copy = strategy.host_copy
    assert copy is not None and copy.is_bound()
    assert all(not unbound(layout, slab) for layout, slab in zip(copy.layouts, copy.arena.slabs, strict=True))
    assert copy.arena.nbytes - copy.arena.bytes_needed < 256 * len(copy.layouts)
    # A second fit reuses the same arena: nothing grows.
    fit(module, BlockwiseStrategy(block_size=2), max_steps=1)
    assert host_copy_of(module.model.get_base_model()) is copy


@pytest.mark.parametrize("budget_blocks", [2, 4])
def test_budget_parity_with_resident_blocks(checkpoints: dict[str, Path], budget_blocks: int) -> None:
    probe = BlockwiseStrategy(block_size=1)
    fit(CausalLMModule(_nf4(checkpoints, "gemma2")), probe, max_steps=1)
    assert probe.residency_plan is not None and probe.host_copy is not None
    block = probe.host_copy.layouts[0].nbytes
    budget = probe.residency_plan.minimum + budget_blocks * block
    stats = _Stats()
    resident = fit(CausalLMModule(_nf4(checkpoints, "gemma2")), "auto")
    blockwise = fit(
        CausalLMModule(_nf4(checkpoints, "gemma2")), BlockwiseStrategy(vram_budget=budget), callbacks=[stats]
    )
    assert len(stats.resident) >= budget_blocks
    assert_equal_runs(resident, blockwise)


def test_budget_below_minimum_is_refused(checkpoints: dict[str, Path]) -> None:
    module = CausalLMModule(_nf4(checkpoints))
    with pytest.raises(MisconfigurationException, match="Raise the budget to at least"):
        fit(module, BlockwiseStrategy(vram_budget="1KiB"))


def test_control_binding_the_wrong_slot_differs(checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers really compute from their slot: bound to the neighbouring slot instead, the run differs."""
    resident = fit(CausalLMModule(_nf4(checkpoints)), "auto")
    original = BlockStreamer._bind

    def bind_next_slot(self: BlockStreamer, block: int, block_views: list[torch.Tensor]) -> None:
        if block_views is not self._host_views[block]:
            neighbour = self.slots[(self._block_slot[block] + 1) % len(self.slots)]
            block_views = views(self.layouts[block], neighbour)
        original(self, block, block_views)

    monkeypatch.setattr(BlockStreamer, "_bind", bind_next_slot)
    broken = fit(CausalLMModule(_nf4(checkpoints)), BlockwiseStrategy(block_size=1))
    assert runs_differ(resident, broken)
