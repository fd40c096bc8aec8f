"""Qwen3-MoE trains blockwise bit-identically to resident training (CPU), with a mixed NF4 / bf16 base.

In transformers 5 the experts of ``qwen3_moe`` are fused 3-D parameters (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``) that bitsandbytes does not quantize: the attention linears are NF4, the
experts and the router stay bf16 in the host arena. Each run: 4 optimizer steps of 2 accumulated
micro-batches, attention and LoRA dropout on, right-padded batches with -100 labels; compared with
``torch.equal``: every micro-batch loss, every adapter gradient, the adapter weights and the AdamW state.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

import lightning_blockwise.architectures
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.replay import hooks as replay_hooks
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import NUM_LAYERS, CausalLMModule, assert_equal_runs, fit, moe_config, runs_differ

_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config(), dtype=torch.bfloat16).save_pretrained(path)
    return path


def _builder(
    path: Path, loader: str = "standard", experts: bool = False, router_logits: bool = False
) -> Callable[[], nn.Module]:
    """NF4 attention and bf16 experts, from `from_pretrained` or `load_blockwise`; LoRA on attention (and experts)."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        if loader == "standard":
            model = AutoModelForCausalLM.from_pretrained(
                path, quantization_config=nf4_config(torch.bfloat16), dtype=torch.bfloat16, device_map="cpu"
            ).train()
        else:
            model = load_blockwise(path, device="cpu", block_size=2, progress=False, share=False)
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
        assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
        model.config.output_router_logits = router_logits
        lora = LoraConfig(
            r=4,
            lora_alpha=8,
            # PEFT's `target_parameters` (LoRA on an `nn.Parameter`) has no dropout of its own.
            lora_dropout=0.0 if experts else 0.1,
            target_modules=_ATTENTION,
            target_parameters=_EXPERTS if experts else None,
            init_lora_weights=False,
        )
        return get_peft_model(model, lora)

    return build


def test_attention_lora_parity_and_control(moe_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validated: no `allow_unvalidated`; from the strategy's own packing and from `load_blockwise`'s arena."""
    resident = fit(CausalLMModule(_builder(moe_checkpoint)), "auto")
    assert_equal_runs(resident, fit(CausalLMModule(_builder(moe_checkpoint)), BlockwiseStrategy(block_size=2)))

    loaded = CausalLMModule(_builder(moe_checkpoint, loader="blockwise"))
    arena = host_copy_of(loaded.model.base_model.model)
    strategy = BlockwiseStrategy(block_size=2)
    assert_equal_runs(resident, fit(loaded, strategy))
    assert strategy.host_copy is arena  # the mixed arena trained as loaded, not repacked

    # Control: the recompute without the forward's RNG state draws other dropout masks.
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    assert runs_differ(resident, fit(CausalLMModule(_builder(moe_checkpoint)), BlockwiseStrategy(block_size=2)))


def test_expert_lora_through_target_parameters_parity_and_control(
    moe_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT's `target_parameters` puts LoRA on the fused 3-D experts; blockwise == resident, expert grads included."""
    build = _builder(moe_checkpoint, experts=True)
    resident = fit(CausalLMModule(build), "auto")
    expert_grads = [name for name in resident.grads[0] if ".mlp.experts." in name and "lora_B" in name]
    assert len(expert_grads) == 2 * NUM_LAYERS
    assert all(resident.grads[0][name].abs().sum() > 0 for name in expert_grads)
    assert_equal_runs(resident, fit(CausalLMModule(build), BlockwiseStrategy(block_size=2)))

    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    assert runs_differ(resident, fit(CausalLMModule(build), BlockwiseStrategy(block_size=2)))


def test_router_logits_are_refused_because_training_would_differ(
    moe_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`output_router_logits=True` is refused at fit start, or else at the first backward; let through, the losses
    agree until the first step only.

    NOTE [ Router logits ] in architectures.py.
    """
    build = _builder(moe_checkpoint, router_logits=True)
    with pytest.raises(MisconfigurationException, match=r"`config\.output_router_logits=True`: the router logits"):
        fit(CausalLMModule(build), BlockwiseStrategy(block_size=2))

    resident = fit(CausalLMModule(build), "auto")
    monkeypatch.setattr(lightning_blockwise.architectures, "_refuse_router_logits", lambda stack: None)
    # Past the config check (as a per-call `output_router_logits=True` is), the first backward refuses it: the logits
    # are recorded by a hook on the router (NOTE [ Forward hooks inside a rematerialized layer ] in replay/hooks.py).
    refusal = r"forward hook on `layers\.\d+\.mlp\.gate` \(the hook `transformers\.[^`]+`\) received"
    with pytest.raises(MisconfigurationException, match=refusal):
        fit(CausalLMModule(build), BlockwiseStrategy(block_size=2))
    monkeypatch.setattr(replay_hooks, "_refusing", lambda value, name, anchor: value)
    blockwise = fit(CausalLMModule(build), BlockwiseStrategy(block_size=2))
    # The first optimizer step's two losses are equal (forward values), the gradients are not: no aux-loss gradient.
    assert [torch.equal(a, b) for a, b in zip(resident.losses[:2], blockwise.losses[:2], strict=True)] == [True, True]
    assert runs_differ(resident, blockwise)
    assert not all(torch.equal(resident.grads[0][n], blockwise.grads[0][n]) for n in resident.grads[0])
