"""`keep_4bit_trainable_on_cpu`: a user's own `strategy="auto"` NF4 run on the CPU trains after validation as without
it (issue 42, item 6; NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py).

The tests' processes behave as on a CPU without AVX512-BF16 (tests/helpers/__init__.py), where bitsandbytes never
repacks; here each model's layers get the flag such a CPU gives them, and bitsandbytes' repacking kernel runs on
this CPU either way. The base is 128 wide: the repacked format needs whole 64-column blocks.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import transformers
from bitsandbytes.nn import Linear4bit
from peft import LoraConfig, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

import lightning_blockwise
from lightning_blockwise import keep_4bit_trainable_on_cpu
from lightning_blockwise.compat.bitsandbytes import is_repacked_for_cpu
from tests.zoo.harness import differences, zoo_fit


@pytest.fixture(scope="module")
def wide_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("wide_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _load(base: Path) -> torch.nn.Module:
    """The base as NF4 on the CPU, its layers flagged as bitsandbytes flags them on a CPU with AVX512-BF16."""
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(base, quantization_config=nf4, device_map="cpu")
    for layer in model.modules():
        if isinstance(layer, Linear4bit):
            layer.support_avx512bf16_for_cpu = True
    return model


class UserModule(pl.LightningModule):
    """A user's QLoRA module as examples/existing_module.py writes it, with or without the guard."""

    def __init__(self, base: Path, guard: bool) -> None:
        super().__init__()
        model = _load(base)
        if guard:
            keep_4bit_trainable_on_cpu(model)
        # No dropout: each validation pass draws a seed for its DataLoader from the global generator, so with dropout
        # the steps after it would draw other masks whatever the kernel.
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])
        self.model = get_peft_model(model, lora).train()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self.model(**batch).loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _auto(base: Path, root: Path, guard: bool, validate: bool) -> tuple[object, UserModule]:
    """Four steps under `strategy="auto"`, validating after the second one when ``validate``.

    No checkpoint: saving one converts a repacked weight back in place (bitsandbytes' `_save_to_state_dict`), with
    its absmax rounded through bf16: the steps after it still train another function, but the repacking itself
    would no longer show.
    """
    made: list[UserModule] = []
    validation = dict(val_check_interval=2, limit_val_batches=1) if validate else {}
    settings = dict(max_steps=4, enable_checkpointing=False, **validation)
    run = zoo_fit(lambda: made.append(UserModule(base, guard)) or made[-1], "auto", root, **settings)
    return run, made[0]


def _repacked(module: torch.nn.Module) -> bool:
    return any(is_repacked_for_cpu(m.weight.quant_state) for m in module.modules() if isinstance(m, Linear4bit))


def test_guarded_auto_run_trains_after_validation_as_without_it(wide_base: Path, tmp_path: Path) -> None:
    plain, _ = _auto(wide_base, tmp_path / "plain", guard=True, validate=False)
    validated, module = _auto(wide_base, tmp_path / "validated", guard=True, validate=True)
    assert not _repacked(module)
    # Validation draws no random numbers and changes no weight: the training run is the same, bit for bit.
    assert {"losses", "grads", "weights", "optimizers"}.isdisjoint(differences(plain, validated))


def test_unguarded_auto_run_trains_another_function_after_validation(wide_base: Path, tmp_path: Path) -> None:
    """The control: without the call, bitsandbytes repacks in validation and the steps after it differ."""
    plain, _ = _auto(wide_base, tmp_path / "plain", guard=False, validate=False)
    validated, module = _auto(wide_base, tmp_path / "validated", guard=False, validate=True)
    assert _repacked(module)
    assert torch.equal(torch.stack(plain.losses[:2]), torch.stack(validated.losses[:2]))  # the same until validation
    assert not torch.equal(plain.losses[2], validated.losses[2])


def test_a_repacked_model_is_refused_with_the_fix(wide_base: Path) -> None:
    model = _load(wide_base).eval()
    with torch.no_grad():
        model(input_ids=torch.arange(1, 9)[None])  # what a validation pass or `generate` does
    assert _repacked(model)
    with pytest.raises(ValueError, match=r"already repacked .* Load the model again and make this call right after"):
        keep_4bit_trainable_on_cpu(model)
    fresh = _load(wide_base)
    assert keep_4bit_trainable_on_cpu(fresh) is fresh  # control: a model just loaded is accepted
    assert not any(m.support_avx512bf16_for_cpu for m in fresh.modules() if isinstance(m, Linear4bit))


def test_the_guard_is_public_under_both_namespaces() -> None:
    import lightning_blockwise.pl as blockwise_pl

    assert "keep_4bit_trainable_on_cpu" in lightning_blockwise.__all__
    assert blockwise_pl.keep_4bit_trainable_on_cpu is keep_4bit_trainable_on_cpu
