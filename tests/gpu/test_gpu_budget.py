"""GPU: a budget sized at short batches holds when longer ones come (the plan is made again before their step).

`python -m pytest tests/gpu/test_gpu_budget.py -s` (default mode; nothing here is about exactness).
Runs in a process of its own or last: it caps this process's caching allocator.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from tests.helpers.models import DEFAULT_TARGETS, CausalLMModule, fit, nf4_lora_builder, padded_batches

pytestmark = pytest.mark.gpu

CAP = 11 * 2**30
# Every block streamed needs 1.71 GiB at 512 tokens and 8.25 GiB at 4096 (the planner); 28 blocks of 23 MiB.
BUDGET = "8.6GiB"


class _Plans(CausalLMModule):
    """Records the plan each training step ran under."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        plan = self.trainer.strategy.step_plan
        self.plans.append((plan.tokens, len(plan.residency.resident), plan.offload))
        return super().training_step(batch, batch_idx)


def test_short_batches_then_long_ones_under_a_capped_allocator(qwen2_checkpoint: Path) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(CAP / total, device)
    try:
        torch.cuda.reset_peak_memory_stats()
        module = _Plans(nf4_lora_builder(qwen2_checkpoint, DEFAULT_TARGETS, r=16), lr=1e-4)
        module.plans = []
        batches = padded_batches(2, batch_size=1, seq=512, vocab=32000) + padded_batches(
            2, batch_size=1, seq=4096, vocab=32000, seed=7
        )
        strategy = BlockwiseStrategy(vram_budget=BUDGET, budget_tokens=512)
        fit(module, strategy, batches, accelerator="gpu", precision="bf16-mixed", max_steps=4,
            accumulate_grad_batches=1)  # fmt: skip
        reserved = torch.cuda.max_memory_reserved()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    print(f"\nplans per step (tokens, resident blocks, offload): {module.plans}; peak reserved {reserved / 1e9:.2f} GB,"
          f" cap {CAP / 1e9:.2f} GB")  # fmt: skip
    (short, short_resident, _), (long, long_resident, _) = module.plans[0], module.plans[-1]
    assert (short, long) == (512, 4096)
    # The long batches were planned for before their step: fewer blocks stay on the device for them.
    assert long_resident < short_resident
    assert reserved <= CAP
