"""A made-up model's step budget for the planner's tests: 8 layers, so that where the inputs wait matters."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning_blockwise.planning.step_budget import StepBudget

LAYERS = 8
#: The made-up model's micro-batch.
TOKENS = 256
CONFIG = SimpleNamespace(hidden_size=64, intermediate_size=128, vocab_size=100)
#: One layer input's bytes at ``TOKENS`` tokens.
ONE = TOKENS * CONFIG.hidden_size * 2


def made_up_budget(**overrides: Any) -> StepBudget:
    """The made-up model's step budget (every block streamed, no budget), with ``overrides``."""
    values: dict[str, Any] = dict(
        config=CONFIG,
        num_layers=LAYERS,
        activation_bytes=2,
        block_bytes=[1000] * LAYERS,
        prefetch_depth=1,
        fixed_bytes=10_000,
        trainable_bytes=100,
        budget=None,
        offload=None,
        device_limit=None,
    )
    values.update(overrides)
    return StepBudget(**values)
