"""Generation on the GPU with the input embedding in host memory (NOTE [ Host embedding lookup ]).

An untied embedding stays on the host under ``BlockwiseStrategy``, so the model's ``device`` reads "cpu" and
``generate`` moves each step's inputs there; the inputs hook brings them back to the card. Run on a CUDA machine in
deterministic mode: ``CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/residency/test_gpu_generate.py -s``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.encoding import byte_tokenizer
from lightning_blockwise.recipes.generation import ChatSession, GeneratingFineTune, generate_replies
from lightning_blockwise.recipes.generation_options import Sampling
from lightning_blockwise.recipes.prompt_tokens import PromptFormat
from lightning_blockwise.residency import embedding
from tests.helpers.models import GPU_SHAPES, nf4_lora_builder

pytestmark = pytest.mark.gpu


def _replies(checkpoint: Path, strategy: Any) -> list[list[int]]:
    batches = [["Write one sentence about the sea.", "Name a colour."]]
    session = ChatSession(PromptFormat(byte_tokenizer(), None), batches, Sampling(12))
    module = GeneratingFineTune(checkpoint=str(checkpoint), random_init=True, lora_dropout=0.0, kernels=None)
    torch.manual_seed(0)  # random_init draws from the global generator: both arms build the same base
    return [reply.tokens.tolist() for reply in generate_replies(module, session, strategy, accelerator="gpu")]


def test_streamed_generation_with_a_host_embedding_equals_resident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.use_deterministic_algorithms(True)
    config = GPU_SHAPES["qwen2"]().to_dict() | {"num_hidden_layers": 4, "tie_word_embeddings": False}
    config.pop("layer_types", None)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))

    streamed = _replies(tmp_path / "ckpt", BlockwiseStrategy(vram_budget=None))
    resident = _replies(tmp_path / "ckpt", "auto")
    print(f"[gpu generate] streamed {streamed} resident {resident}")
    assert streamed == resident and all(len(tokens) > 0 for tokens in streamed)

    # Control: without the inputs hook, generate's inputs stay where the model's `device` says (the host).
    monkeypatch.setattr(embedding, "inputs_to", lambda device: lambda module, args, kwargs: (args, kwargs))
    with pytest.raises(RuntimeError, match="same device"):
        _replies(tmp_path / "ckpt", BlockwiseStrategy(vram_budget=None))


class _StrangersGenerator(pl.LightningModule):
    """Generation as a stranger's script writes it: ``import pytorch_lightning as pl``, a torchmetrics metric on the
    module, Hugging Face's ``generate`` on a PEFT model in ``predict_step``."""

    def __init__(self, build: Any) -> None:
        super().__init__()
        self.model: nn.Module = build()
        self.generated = torchmetrics.SumMetric()

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        tokens = self.model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0)
        self.generated.update(tokens.shape[-1] - batch["input_ids"].shape[-1])
        return tokens.cpu()


def _strangers_replies(checkpoint: Path, strategy: Any) -> tuple[list[list[int]], float]:
    module = _StrangersGenerator(nf4_lora_builder(checkpoint, ["q_proj", "v_proj"], r=8, lora_dropout=0.0))
    ids = torch.randint(1, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "attention_mask": torch.ones_like(row)} for row in ids]
    trainer = pl.Trainer(
        strategy=strategy, accelerator="gpu", devices=1, precision="bf16-mixed", profiler="simple", logger=False,
        enable_checkpointing=False, enable_progress_bar=False,
    )  # fmt: skip
    replies = trainer.predict(module, DataLoader(rows, batch_size=2))
    assert replies is not None
    return torch.cat(replies).tolist(), float(module.generated.compute())


def test_a_strangers_pytorch_lightning_generation_streamed_equals_resident(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host embedding's inputs hook under ``pytorch_lightning.Trainer.predict``, a metric and a profiler."""
    torch.use_deterministic_algorithms(True)
    config = GPU_SHAPES["qwen2"]()
    config.num_hidden_layers, config.tie_word_embeddings = 4, False
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:4]  # Qwen2's, one per layer
    torch.manual_seed(0)
    with torch.device("cuda"):
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "ckpt")
    torch.cuda.empty_cache()

    streamed = _strangers_replies(tmp_path / "ckpt", BlockwiseStrategy(vram_budget=None))
    resident = _strangers_replies(tmp_path / "ckpt", "auto")
    print(f"[gpu generate, pytorch_lightning] streamed {streamed} resident {resident}")
    assert streamed == resident and streamed[1] > 0

    # Control: without the inputs hook the stranger's generate fails as before the fix.
    monkeypatch.setattr(embedding, "inputs_to", lambda device: lambda module, args, kwargs: (args, kwargs))
    with pytest.raises(RuntimeError, match="same device"):
        _strangers_replies(tmp_path / "ckpt", BlockwiseStrategy(vram_budget=None))
