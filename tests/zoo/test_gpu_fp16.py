"""GPU: a zoo client with an fp16 base under ``precision="16-mixed"`` (fp16 autocast and a ``GradScaler``), auto vs
blockwise, deterministic mode (issue 42, item 5).

The client is ``tests/zoo/test_half_precision.py``'s ``HalfLoRA`` as a T4/V100 script writes it: NF4 with
``bnb_4bit_compute_dtype=torch.float16``, the rest of the base loaded in fp16 on the GPU, LoRA with dropout. Both runs
are compared with ``torch.equal`` in every loss, gradient (as the optimizer step sees it: unscaled), trained tensor,
AdamW state, logged metric, file name, and the ``GradScaler``'s state (its scale and growth tracker) after the run;
the control runs the blockwise arm without RNG replay, which must differ. Every block streams (``vram_budget=None``).
Run: ``CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/zoo/test_gpu_fp16.py -s`` (seconds: a tiny model).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import save_checkpoint
from tests.zoo.harness import ZooRun, assert_same, assert_sees_each_field, collect, differences, zoo_data, zoo_trainer
from tests.zoo.test_half_precision import HalfLoRA

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The zoo's tiny random-init Llama (attention dropout 0.1), saved as a checkpoint."""
    return save_checkpoint("llama", tmp_path_factory.mktemp("fp16_base"))


def _fit(base: Path, strategy: Any, root: Path) -> ZooRun:
    """``HalfLoRA`` on the GPU under "16-mixed", deterministic, 4 steps; the scaler's state in ``extra``."""
    pl.seed_everything(0, verbose=False)
    module = HalfLoRA(str(base), device_map={"": 0})
    settings = dict(accelerator="gpu", precision="16-mixed", deterministic=True, max_steps=4)
    trainer = zoo_trainer(module, strategy, root, **settings)
    trainer.fit(module, zoo_data())
    run = collect(trainer, root)
    scaler = trainer.precision_plugin.scaler
    assert isinstance(scaler, torch.amp.GradScaler), "16-mixed on the GPU trains with a GradScaler"
    run.extra["scaler"] = {k: v for k, v in scaler.state_dict().items() if k in ("scale", "_growth_tracker")}
    assert module.model.base_model.model.model.embed_tokens.weight.dtype == torch.float16  # an fp16 base
    del module, trainer
    torch.cuda.empty_cache()
    return run


def test_fp16_base_16_mixed_blockwise_equals_resident(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    auto = _fit(base, "auto", tmp_path / "auto")
    blockwise = _fit(base, BlockwiseStrategy(vram_budget=None), tmp_path / "blockwise")
    assert len(auto.losses) == 4 and all(torch.isfinite(loss) for loss in auto.losses)
    assert_same(auto, blockwise)
    assert_sees_each_field(auto)
    # Control: without RNG replay the recompute draws other dropout masks, and the gradients differ.
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    unreplayed = _fit(base, BlockwiseStrategy(vram_budget=None), tmp_path / "unreplayed")
    assert {"grads", "weights", "optimizers"} <= set(differences(auto, unreplayed))
