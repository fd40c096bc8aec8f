"""Blockwise == resident, elementwise, on packed batches (position ids, no attention mask) through `Trainer.fit`.

The packed mask that transformers builds from the position ids is a decoder-layer call argument like any other:
captured in the forward and replayed in the recompute (NOTE [ Per-layer call replay ] in replay/capture.py).
Each run: 4 optimizer steps of 2 accumulated micro-batches of 2 packed rows (the second padded), LoRA and attention
dropout on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.packing import PackCollator, pack
from lightning_blockwise.replay import capture, remat
from tests.helpers.models import VOCAB, CausalLMModule, assert_equal_runs, build_model, fit, runs_differ

ROW = 30


def packed_batches(num_batches: int = 8, seed: int = 0) -> list[dict]:
    """Packed batches of 2 rows of up to ``ROW`` tokens, from examples of 3 to 9 tokens (prompts not trained on)."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    while len(examples) < 10 * num_batches:
        n = int(torch.randint(3, 10, (), generator=gen))
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3 :]})
    rows = [[examples[i] for i in b] for b in pack([len(e["input_ids"]) for e in examples], ROW)]
    collate = PackCollator(pad_id=0)
    return [collate(rows[2 * i : 2 * i + 2]) for i in range(num_batches)]


def test_batches_are_packed() -> None:
    batches = packed_batches()
    assert all("attention_mask" not in b and b["use_cache"] is False for b in batches)
    starts = [int((b["position_ids"] == 0).sum(dim=1).min()) for b in batches]
    assert min(starts) >= 3, "each row holds at least 3 examples (or 2 and padding)"


@pytest.mark.parametrize(("model_type", "quantized"), [("qwen2", False), ("llama", True)], ids=["qwen2", "llama-nf4"])
def test_packed_parity(model_type: str, quantized: bool, checkpoints: dict[str, Path]) -> None:
    def build() -> object:
        return build_model(model_type, checkpoint=checkpoints[model_type] if quantized else None, quantized=quantized)

    batches = packed_batches()
    resident = fit(CausalLMModule(build), "auto", batches=batches)
    blockwise = fit(CausalLMModule(build), BlockwiseStrategy(block_size=2), batches=batches)
    assert_equal_runs(resident, blockwise)


def test_control_recompute_without_the_packed_mask_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recompute that drops the packed mask lets the examples attend to each other: the grads differ."""
    batches = packed_batches()
    resident = fit(CausalLMModule(lambda: build_model("qwen2")), "auto", batches=batches)
    original_run = remat.RematLayer.run
    masks: list[object] = []

    def run_without_mask(self: remat.RematLayer, hidden: Tensor, call: capture.LayerCall) -> Tensor:
        masks.append(call.kwargs.get("attention_mask"))
        if torch.is_grad_enabled():  # the recompute
            call = capture.LayerCall(call.args, {**call.kwargs, "attention_mask": None}, call.autocast)
        return original_run(self, hidden, call)

    monkeypatch.setattr(remat.RematLayer, "run", run_without_mask)
    broken = fit(CausalLMModule(lambda: build_model("qwen2")), "blockwise", batches=batches)
    # The layers were given a packed mask (transformers' sdpa mask: boolean, one block per example).
    assert all(isinstance(mask, Tensor) and mask.dtype == torch.bool for mask in masks)
    assert torch.equal(broken.losses[0], resident.losses[0]), "the forward itself must be unaffected"
    assert runs_differ(resident, broken)
