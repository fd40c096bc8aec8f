"""Zoo: clients that change the vocabulary, put LoRA on the embedding or load a saved adapter (issue 42, items 4-5, 7).

Each is fitted under ``strategy="auto"`` and ``strategy="blockwise"`` from one seed and compared in every loss,
gradient, trained tensor, optimizer state, logged metric and checkpoint name (tests/zoo/harness.py).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import peft
import pytest
import torch
from packaging.version import Version
from peft import LoraConfig, PeftModel, get_peft_model
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch import Tensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedTokenizerFast
from transformers.integrations.peft import MIN_PEFT_VERSION

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.helpers.models import VOCAB, padded_batches
from tests.zoo.harness import assert_same, assert_sees_each_field, zoo_fit

NF4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
CHAT_TOKENS = ["<|user|>", "<|assistant|>"]


def _tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the base's vocabulary, made here because nothing may be downloaded."""
    vocab = {f"w{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="w1")), pad_token="w0")


def _chat_batches() -> list[dict[str, Tensor]]:
    """The zoo's batches with some tokens turned into the added chat tokens, so that their new rows train."""
    batches = padded_batches(6)
    for batch in batches:
        for name, new_id in zip(("input_ids", "labels"), (VOCAB, VOCAB), strict=True):
            ids = batch[name]
            batch[name] = torch.where((ids > 0) & (ids % 7 == 0), new_id + ids % 2, ids)
    return batches


class ChatTokensModule(pl.LightningModule):
    """Adds chat special tokens, resizes the embeddings and trains them whole through ``modules_to_save``."""

    def __init__(self, base: str, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.tokenizer = _tokenizer()
        self.tokenizer.add_special_tokens({"additional_special_tokens": CHAT_TOKENS})
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=NF4, device_map="cpu")
        model.resize_token_embeddings(len(self.tokenizer))
        lora = LoraConfig(
            r=8,
            lora_alpha=16,
            lora_dropout=0.05,
            target_modules=["q_proj", "v_proj"],
            modules_to_save=["embed_tokens", "lm_head"],
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(model, lora)
        self.model.train()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr)


def test_added_tokens_resized_embeddings_modules_to_save(zoo_base: Path, tmp_path: Path) -> None:
    runs = [
        zoo_fit(lambda: ChatTokensModule(str(zoo_base)), s, tmp_path / s, batches=_chat_batches())
        for s in ("auto", "blockwise")
    ]
    assert_same(*runs)
    trained = runs[0].weights
    assert any("embed_tokens.modules_to_save" in n for n in trained)
    assert any("lm_head.modules_to_save" in n for n in trained)
    assert_sees_each_field(runs[0])


class EmbeddingLoRA(pl.LightningModule):
    """LoRA on the embedding as well as on the attention, the way some instruction-tuning scripts target it."""

    def __init__(self, base: str) -> None:
        super().__init__()
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=NF4, device_map="cpu")
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["embed_tokens", "q_proj", "o_proj"])
        self.model = get_peft_model(model, lora)
        self.model.train()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, on_epoch=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-3)


def test_lora_on_the_embedding(zoo_base: Path, tmp_path: Path) -> None:
    runs = [zoo_fit(lambda: EmbeddingLoRA(str(zoo_base)), s, tmp_path / s) for s in ("auto", "blockwise")]
    assert_same(*runs)
    assert any("embed_tokens.lora_embedding_A" in n for n in runs[0].weights)
    assert_sees_each_field(runs[0])


class ContinueAdapter(pl.LightningModule):
    """Continues training a saved adapter: ``PeftModel.from_pretrained(base, adapter, is_trainable=True)``."""

    def __init__(self, base: str, adapter: str) -> None:
        super().__init__()
        model = AutoModelForCausalLM.from_pretrained(base, quantization_config=NF4, device_map="cpu")
        model.train()
        self.model = PeftModel.from_pretrained(model, adapter, is_trainable=True)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_peft_from_pretrained_is_trainable(zoo_base: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    first = get_peft_model(
        AutoModelForCausalLM.from_pretrained(zoo_base),
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    first.save_pretrained(tmp_path / "adapter")
    loaded = dict(ContinueAdapter(str(zoo_base), str(tmp_path / "adapter")).named_parameters())
    saved_b = "model.base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert torch.equal(loaded[saved_b], dict(first.named_parameters())[saved_b.removeprefix("model.")])
    assert loaded[saved_b].requires_grad  # the saved adapter, trainable: what the clients below continue
    runs = [
        zoo_fit(lambda: ContinueAdapter(str(zoo_base), str(tmp_path / "adapter")), s, tmp_path / s)
        for s in ("auto", "blockwise")
    ]
    assert_same(*runs)
    assert_sees_each_field(runs[0])


# transformers' `add_adapter` (and `load_adapter`, `enable_adapters`) check for its own `MIN_PEFT_VERSION` before doing
# anything: 5.24 asks for peft >= 0.22, which our bounds (peft < 0.22) exclude, so transformers is bounded below 5.24
# (pyproject.toml) and such scripts run. Read from transformers, so that the test follows what the stack installed.
ADD_ADAPTER_NEEDS = Version(MIN_PEFT_VERSION)
ADD_ADAPTER_REFUSAL = (
    f"The version of PEFT you are using is not compatible, please use a version >= {ADD_ADAPTER_NEEDS}"
)


class TransformersAdapter(pl.LightningModule):
    """transformers' own PEFT integration: ``model.add_adapter(LoraConfig(...))`` instead of ``get_peft_model``."""

    def __init__(self, base: str) -> None:
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(base, quantization_config=NF4, device_map="cpu")
        self.model.add_adapter(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
        self.model.train()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


@pytest.mark.skipif(Version(peft.__version__) < ADD_ADAPTER_NEEDS, reason=f"transformers says: {ADD_ADAPTER_REFUSAL}")
def test_transformers_add_adapter(zoo_base: Path, tmp_path: Path) -> None:
    runs = [zoo_fit(lambda: TransformersAdapter(str(zoo_base)), s, tmp_path / s) for s in ("auto", "blockwise")]
    assert_same(*runs)
    assert_sees_each_field(runs[0])


@pytest.mark.skipif(Version(peft.__version__) >= ADD_ADAPTER_NEEDS, reason="this peft runs add_adapter")
def test_add_adapter_fails_before_any_strategy_with_this_peft(zoo_base: Path) -> None:
    """The reason the test above is skipped, checked rather than assumed: the client cannot even be built."""
    with pytest.raises(ValueError, match=f"^{ADD_ADAPTER_REFUSAL}$"):
        TransformersAdapter(str(zoo_base))
    assert ChatTokensModule(str(zoo_base)).model.peft_config  # control: get_peft_model builds on this stack
