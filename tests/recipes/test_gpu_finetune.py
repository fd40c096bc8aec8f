"""`CausalLMFineTune` on the GPU: the base loads straight into the strategy's pinned arena and trains.

Run on a CUDA machine: `python -m pytest tests/recipes/test_gpu_finetune.py -s`.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import GPU_SHAPES

pytestmark = pytest.mark.gpu


def test_finetune_loads_into_the_pinned_arena_and_trains(tmp_path: Path) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(GPU_SHAPES["llama"](), dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "ckpt")
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()

    strategy = BlockwiseStrategy(vram_budget=None, block_size=1)
    module = CausalLMFineTune(str(tmp_path / "ckpt"), lora_r=16, warmup_steps=1, learning_rate=1e-3)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="gpu", precision="bf16-mixed", max_steps=8, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path,
    )  # fmt: skip
    data = SyntheticTokensDataModule(seq_len=256, vocab_size=32000, num_samples=16, batch_size=2)
    trainer.fit(module, datamodule=data)

    base = module.model.get_base_model()
    copy = host_copy_of(base)
    assert strategy.host_copy is copy and copy.arena.pinned  # loaded once, in the strategy's block size
    peak = torch.cuda.max_memory_allocated()
    print(f"[gpu finetune] Llama-3.2-1B shape: fit peak {peak / 1e9:.2f} GB, arena {copy.arena.nbytes / 1e9:.2f} GB")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
