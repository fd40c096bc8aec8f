"""`benchmarks/small_levers.py` on the CPU: the ``before`` arms really run the old code (and only inside their
block), the old loss is the new one's value, and every part runs end to end on a tiny shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import small_levers
from benchmarks.peer_arms import lightning_arm
from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from lightning_blockwise.replay import hooks
from tests.helpers.models import build_model, padded_batches


def test_each_arm_puts_back_exactly_the_levers_it_leaves_out() -> None:
    new_loss, new_listing = lightning_arm.chunked_causal_lm_loss, hooks._inner_modules
    for on in small_levers.ARMS.values():
        with small_levers.levers(on):
            assert (lightning_arm.chunked_causal_lm_loss is new_loss) == ("loss" in on)
            assert (hooks._inner_modules is new_listing) == ("hooks" in on)
    assert lightning_arm.chunked_causal_lm_loss is new_loss and hooks._inner_modules is new_listing


def test_the_sliced_loss_is_the_split_ones_value() -> None:
    """The ``before`` arm computes the same loss and gradients by other writes (tests/longcontext/test_loss.py)."""
    model = build_model("llama").eval()
    batch = padded_batches(1, batch_size=3, seed=7)[0]
    results = []
    for loss_fn in (small_levers.sliced_chunked_loss, chunked_causal_lm_loss):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, **batch, chunk_tokens=5).loss
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in model.parameters() if p.requires_grad)])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@pytest.mark.parametrize("part", ["hooks", "loss", "step", "attention"])
def test_every_part_runs_on_the_cpu(part: str, tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    small_levers.main(
        ["--device", "cpu", "--shape", "tiny", "--parts", part, "--loss-tokens", "64", "--points", "random:32x1",
         "--arm", "ours+fused", "--steps", "1", "--out", str(out)]
    )  # fmt: skip
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    arms = {"hooks": {"walked", "listed"}, "loss": {"sliced", "split"}, "step": set(small_levers.ARMS),
            "attention": {"none", "recorded", "around_sdpa"}}[part]  # fmt: skip
    assert {row["arm"] for row in rows} == arms and all(row["part"] == part for row in rows)
    if part == "step":
        assert all(row["status"] == "ok" and row["s_per_step"] > 0 for row in rows)


def test_the_candidate_records_what_the_dispatch_mode_records() -> None:
    """The attention part's candidate (entered around SDPA only) records the same kernel outputs, bit for bit."""
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    records = []
    for mode in (lambda kept: kept.record(), small_levers._AroundSdpa):
        kept = small_levers.KeptAttention()
        with torch.no_grad(), mode(kept):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        records.append(kept.entries)
    (first,), (second,) = records
    assert first is not None and second is not None and first.func is second.func
    assert all(torch.equal(a, b) for a, b in zip(first.outputs, second.outputs, strict=True))
