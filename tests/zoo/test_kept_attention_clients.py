"""Strangers' modules with kept attention on (NOTE [ Kept attention ]): exact against `strategy="auto"`.

`LitConfigureModel` (`import lightning as L`, model built in `configure_model`, non-reentrant checkpointing, a
torchmetrics `Perplexity`, `SimpleProfiler`) and `PlQLoRA` (`import pytorch_lightning as pl`, `sync_dist` logging) on
the zoo's base without attention dropout, under a budget where every recomputed layer keeps its attention outputs
(the FLOPs floor lifted: the tiny layers' attention is far under it). Each run counts the attention kernels: blockwise
one per layer and micro-batch, so the recompute really took the records.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.profilers import SimpleProfiler

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import step_budget
from tests.helpers.attention import CountAttention
from tests.helpers.budgets import budget_where, keeps_every_attention
from tests.helpers.models import NUM_LAYERS, SEQ
from tests.zoo.harness import assert_same, zoo_fit
from tests.zoo.test_qlora_scripts import LitConfigureModel, PlQLoRA

#: The zoo's micro-batches: 2 rows of SEQ tokens.
TOKENS = 2 * SEQ


@pytest.mark.parametrize("client", [LitConfigureModel, PlQLoRA], ids=["lightning", "pytorch_lightning"])
def test_a_strangers_module_with_kept_attention_is_exact(
    client: type, llama_no_attention_dropout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(step_budget, "KEPT_ATTENTION_MIN_FLOPS", 0)
    base = str(llama_no_attention_dropout)
    probe = BlockwiseStrategy(budget_tokens=TOKENS)
    zoo_fit(lambda: client(base), probe, tmp_path / "probe", max_steps=1)
    assert probe._planner is not None
    budget, _ = budget_where(probe._planner.budget, TOKENS, keeps_every_attention(NUM_LAYERS))
    runs, calls = [], []
    for name, strategy in (("auto", "auto"), ("blockwise", BlockwiseStrategy(vram_budget=budget))):
        with CountAttention() as mode:
            profiler = SimpleProfiler(dirpath=tmp_path, filename=name)
            runs.append(zoo_fit(lambda: client(base), strategy, tmp_path / name, profiler=profiler))
        calls.append(mode.total)
    assert_same(*runs)
    # Blockwise: one kernel per layer and micro-batch (the recompute took the records); resident training runs two
    # (both clients turn on Hugging Face's checkpointing, which the strategy replaces on the instances).
    once = NUM_LAYERS * len(runs[1].losses)
    assert calls == [2 * once, once]
    assert (tmp_path / "fit-blockwise.txt").read_text().count("run_training_batch") > 0
