"""Attention with a mask (padded or packed rows): what the plan counts, and which batches run it.

NOTE [ Masked attention ] in planning/step_shape.py; the planner's re-plan is in tests/strategy/test_step_budget.py.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import transformers

from lightning_blockwise.planning import StepShape
from lightning_blockwise.planning.step_kernels import StepKernels
from lightning_blockwise.strategy.step_tokens import masked_row

QWEN_7B = transformers.Qwen2Config(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064,
)  # fmt: skip


def test_a_masked_row_adds_the_additive_mask_and_the_repeated_keys_and_values() -> None:
    # A chunked loss of 256 rows, so that the layer's working set, not the logits, is the step's peak.
    kernels = StepKernels(loss_chunk_tokens=256, fused_norm=True, fused_mlp=True)
    unmasked = StepShape.for_config(QWEN_7B, tokens=2 * 4096, num_layers=28, kernels=kernels)
    masked = replace(unmasked, masked_row=4096)
    hidden = 2 * 4096 * 3584 * 2
    # The measured point (layer_allocations --packed 512, H100): the additive mask, 1.14 hidden-sized tensors, and
    # the keys and values repeated from 4 to 28 heads.
    extra = masked.masked_attention_bytes()
    assert extra == 2 * 4096 * 4096 * 2 + 2 * (hidden - 2 * 4096 * 512 * 2)
    assert 2 * 4096 * 4096 * 2 / hidden == pytest.approx(1.14, abs=0.01)
    # Every kept graph and the recomputed layer hold it; the boolean mask stays throughout.
    assert masked.layer_graph() - unmasked.layer_graph() == pytest.approx(extra * 1.02, rel=1e-6)
    assert masked.layer_working_set() - unmasked.layer_working_set() == extra
    boolean = 2 * 4096 * 4096
    assert masked.activation_peak() - unmasked.activation_peak() == pytest.approx((boolean + extra) * 1.02, abs=2)
    # Control: unmasked, nothing is added.
    assert unmasked.masked_attention_bytes() == 0


def _batch(**tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.ones(2, 8, dtype=torch.long), **tensors}


@pytest.mark.parametrize(
    ("batch", "row"),
    [
        (_batch(), None),
        (_batch(attention_mask=torch.ones(2, 8, dtype=torch.long)), None),
        (_batch(attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3])), 8),
        (_batch(attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()), 8),
        (_batch(position_ids=torch.arange(8).repeat(2, 1)), None),
        (_batch(position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)), 8),
        ({"input_ids": torch.ones(8, dtype=torch.long)}, None),
        (torch.ones(2, 8, dtype=torch.long), None),
    ],
    ids=["ids", "all-ones mask", "padded", "4-D mask", "positions", "packed", "one row, 1-D", "a tensor"],
)
def test_the_batches_that_run_attention_with_a_mask(batch: object, row: int | None) -> None:
    assert masked_row(batch, SimpleNamespace(_attn_implementation="sdpa")) == row


def test_only_sdpa_is_counted() -> None:
    padded = _batch(attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))
    assert masked_row(padded, SimpleNamespace(_attn_implementation="flash_attention_2")) is None
    # Unset (a config no model was built from yet): transformers' default, sdpa.
    assert masked_row(padded, SimpleNamespace(_attn_implementation=None)) == 8
    # A multimodal config's language model decides; control: sdpa there counts.
    text = SimpleNamespace(text_config=SimpleNamespace(_attn_implementation="sdpa"))
    assert masked_row(padded, text) == 8
