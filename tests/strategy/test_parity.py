"""Blockwise == resident, elementwise, through a real `Trainer.fit`, per validated architecture.

Each run: 4 optimizer steps of 2 accumulated micro-batches, LoRA dropout and attention
dropout on, right-padded batches with -100 labels. Compared with `torch.equal`: the
loss of every micro-batch, every adapter gradient at every optimizer step, the final
adapter weights and the AdamW state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay import remat
from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import (
    CONFIGS,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    left_padded,
    padded_batches,
    runs_differ,
)

ARCHS = sorted(CONFIGS)


@pytest.mark.parametrize("model_type", ARCHS)
def test_fp32_parity(model_type: str) -> None:
    resident = fit(CausalLMModule(lambda: build_model(model_type)), "auto")
    blockwise = fit(CausalLMModule(lambda: build_model(model_type)), "blockwise")
    assert_equal_runs(resident, blockwise)


@pytest.mark.parametrize("model_type", ARCHS)
def test_nf4_parity(model_type: str, checkpoints: dict[str, Path]) -> None:
    def build() -> object:
        return build_model(model_type, checkpoint=checkpoints[model_type], quantized=True)

    resident = fit(CausalLMModule(build), "auto")
    module = CausalLMModule(build)
    layer = module.model.get_decoder().layers[0]
    assert type(layer.self_attn.o_proj.base_layer).__name__ == "Linear4bit"
    blockwise = fit(module, BlockwiseStrategy(block_size=2))
    assert_equal_runs(resident, blockwise)


def test_parity_with_model_built_in_configure_model(checkpoints: dict[str, Path]) -> None:
    def build() -> object:
        return build_model("llama", checkpoint=checkpoints["llama"], quantized=True)

    resident = fit(CausalLMModule(build, in_configure_model=True), "auto")
    blockwise = fit(CausalLMModule(build, in_configure_model=True), "blockwise")
    assert_equal_runs(resident, blockwise)


def test_parity_under_bf16_autocast() -> None:
    resident = fit(CausalLMModule(lambda: build_model("qwen2")), "auto", precision="bf16-mixed")
    blockwise = fit(CausalLMModule(lambda: build_model("qwen2")), "blockwise", precision="bf16-mixed")
    assert_equal_runs(resident, blockwise)


def test_parity_with_hf_gradient_checkpointing_enabled() -> None:
    """`prepare_model_for_kbit_training` style setups turn HF checkpointing on; results must not change."""

    def build() -> object:
        model = build_model("gemma2")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        return model

    resident = fit(CausalLMModule(build), "auto")
    blockwise = fit(CausalLMModule(build), "blockwise")
    assert_equal_runs(resident, blockwise)


@pytest.mark.parametrize(("model_type", "quantized"), [("llama", True), ("gemma2", False)], ids=["llama-nf4", "gemma2"])
def test_dora_parity_and_control(
    model_type: str, quantized: bool, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DoRA's magnitude vectors are adapters too; its weight norm reads the streamed base inside the residency."""

    def build() -> object:
        torch.manual_seed(0)
        model = build_model(
            model_type, checkpoint=checkpoints[model_type] if quantized else None, quantized=quantized, peft=False
        )
        lora = LoraConfig(
            r=4,
            lora_dropout=0.1,
            use_dora=True,
            init_lora_weights=False,
            target_modules=["q_proj", "v_proj", "down_proj"],
        )
        return get_peft_model(model, lora)

    resident = fit(CausalLMModule(build), "auto")
    assert any("lora_magnitude_vector" in name for name in resident.grads[0])
    assert_equal_runs(resident, fit(CausalLMModule(build), "blockwise"))
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    assert runs_differ(resident, fit(CausalLMModule(build), "blockwise"))


#: The architectures whose right-padded parity a replay without the attention mask passed (issue 41, item 12).
MASK_BLIND_ON_RIGHT_PADDING = ["llama", "phi3", "qwen3"]


@pytest.mark.parametrize("model_type", MASK_BLIND_ON_RIGHT_PADDING)
def test_left_padded_parity(model_type: str) -> None:
    """Left-padded batches: the real tokens come after the padding, so only the mask keeps them off it."""
    batches = left_padded(padded_batches(8))
    assert any(bool(batch["attention_mask"][:, 0].eq(0).any()) for batch in batches)
    resident = fit(CausalLMModule(lambda: build_model(model_type)), "auto", batches)
    assert_equal_runs(resident, fit(CausalLMModule(lambda: build_model(model_type)), "blockwise", batches))


@pytest.mark.parametrize("model_type", MASK_BLIND_ON_RIGHT_PADDING)
def test_control_left_padded_parity_sees_a_replay_without_the_mask(
    model_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recompute without the attention mask differs on left-padded batches (on right-padded ones it matched)."""
    rerun = remat.RematLayer.rerun

    def without_mask(self: remat.RematLayer, hidden: Tensor, call: LayerCall) -> Tensor:
        kwargs = {k: v for k, v in call.kwargs.items() if k != "attention_mask"}
        return rerun(self, hidden, dataclasses.replace(call, kwargs=kwargs))

    batches = left_padded(padded_batches(8))
    resident = fit(CausalLMModule(lambda: build_model(model_type)), "auto", batches)
    monkeypatch.setattr(remat.RematLayer, "rerun", without_mask)
    assert runs_differ(resident, fit(CausalLMModule(lambda: build_model(model_type)), "blockwise", batches))
