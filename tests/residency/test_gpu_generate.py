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
import torch

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.encoding import byte_tokenizer
from lightning_blockwise.recipes.generation import ChatSession, GeneratingFineTune, generate_replies
from lightning_blockwise.recipes.generation_options import Sampling
from lightning_blockwise.recipes.prompt_tokens import PromptFormat
from lightning_blockwise.residency import embedding
from tests.helpers.models import GPU_SHAPES

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
