"""``use_liger_kernels``'s plumbing on the CPU: what it replaces, that it undoes, that nothing leaks, and its refusals.

Liger's Triton kernels cannot run here; the tests that compute swap them for torch references of the same signature
(``reference_kernels``), so the installed forwards, the attention's rebuilt forward and the replay's recompute run for
real. The kernels themselves: tests/kernels/test_gpu_kernels.py.
"""

from __future__ import annotations

import sys
import types
from collections import Counter
from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from transformers.models.llama import modeling_llama
from transformers.models.phi3 import modeling_phi3

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.kernels import forwards, liger
from lightning_blockwise.kernels.liger import (
    LIGER_MODEL_TYPES,
    liger_kernels_in,
    unuse_liger_kernels,
    use_liger_kernels,
)
from lightning_blockwise.longcontext.tiling import TiledMLP, tile_mlps
from tests.helpers.models import (
    CONFIGS,
    NUM_LAYERS,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    moe_config,
    padded_batches,
    runs_differ,
)

#: RMSNorms per decoder layer the switch replaces (the final norm comes on top).
NORMS_PER_LAYER = {"qwen3": 4, "gemma2": 4, "gemma3_text": 6}


def _counts(model_type: str) -> dict[str, int]:
    return {"rms_norm": NUM_LAYERS * NORMS_PER_LAYER.get(model_type, 2) + 1, "rope": NUM_LAYERS, "mlp": NUM_LAYERS}


class _ReferenceRMSNorm:
    """``LigerRMSNormFunction.apply``'s signature, Hugging Face's arithmetic (bit for bit on the CPU)."""

    shift = 0.0  # the control's perturbation

    @classmethod
    def apply(
        cls, x: Tensor, weight: Tensor, eps: float, offset: float, casting: str, in_place: bool, row_mode: Any
    ) -> Tensor:
        if casting == "llama":
            hidden = x.to(torch.float32)
            hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
            return weight * hidden.to(x.dtype) + cls.shift
        hidden = x.float()
        out = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
        return (out * (offset + weight.float())).type_as(x) + cls.shift


@pytest.fixture
def calls() -> Counter[str]:
    return Counter()


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch, calls: Counter[str]) -> type[_ReferenceRMSNorm]:
    """Liger's kernels replaced by torch references that count their calls; CPU tensors allowed."""

    class Norm(_ReferenceRMSNorm):
        @classmethod
        def apply(cls, *args: Any) -> Tensor:
            calls["rms_norm"] += 1
            return super().apply(*args)

    def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Any, unsqueeze_dim: int) -> Any:
        calls["rope"] += 1
        # Phi-3's rotates the first cos.shape[-1] features: the same arithmetic as Llama's on a full rotation.
        return modeling_phi3.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    def mlp(module: nn.Module, hidden: Tensor) -> Tensor:
        calls["mlp"] += 1
        return type(module).forward(module, hidden)

    namespace = types.SimpleNamespace(rms_norm=Norm, rope=rope, mlp_forwards={"swiglu": mlp, "phi3": mlp, "geglu": mlp})
    monkeypatch.setattr(liger, "_liger", lambda: namespace)
    monkeypatch.setattr(forwards, "_on_cuda", lambda tensor, where: None)
    return Norm


def _loss_and_grads(model: nn.Module, seed: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    batch = padded_batches(1)[0]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # LoRA dropout
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in vars(module)]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_switch_replaces_the_norms_ropes_and_mlps_of_every_layer(model_type: str) -> None:
    model = build_model(model_type)
    use_liger_kernels(model)
    assert liger_kernels_in(model) == _counts(model_type)
    # Only the decoder's modules, and the class forwards untouched.
    decoder = model.get_base_model().model
    assert all(name.startswith("base_model.model.model.") for name in _instance_forwards(model))
    assert type(decoder.layers[0].mlp).forward is not decoder.layers[0].mlp.forward


def test_each_kernel_has_its_flag() -> None:
    model = build_model("llama")
    use_liger_kernels(model, rms_norm=False, rope=False)
    assert liger_kernels_in(model) == {"rms_norm": 0, "rope": 0, "mlp": NUM_LAYERS}
    use_liger_kernels(model, swiglu=False)
    assert liger_kernels_in(model) == {"rms_norm": 2 * NUM_LAYERS + 1, "rope": NUM_LAYERS, "mlp": 0}


def test_moe_gets_norms_and_rope_and_its_experts_keep_their_forward() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_config(moe_config()), LoraConfig(target_modules=["q_proj"]))
    use_liger_kernels(model)
    assert liger_kernels_in(model) == {"rms_norm": 4 * NUM_LAYERS + 1, "rope": NUM_LAYERS, "mlp": 0}


def test_installing_twice_is_installing_once_and_undo_restores_the_class_forwards(
    reference_kernels: type[_ReferenceRMSNorm],
) -> None:
    model = build_model("qwen3")
    before = _loss_and_grads(model)
    use_liger_kernels(model)
    use_liger_kernels(model)
    assert liger_kernels_in(model) == _counts("qwen3")
    assert unuse_liger_kernels(model) == sum(_counts("qwen3").values())
    assert _instance_forwards(model) == []
    for module in model.modules():
        assert module.forward.__func__ is type(module).forward
    reference_kernels.shift = 1e-3  # were a Liger forward still installed, the loss would move
    after = _loss_and_grads(model)
    assert torch.equal(before[0], after[0])
    assert all(torch.equal(before[1][name], after[1][name]) for name in before[1])
    assert unuse_liger_kernels(model) == 0


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_installed_forwards_compute_what_the_model_does_with_reference_kernels(
    model_type: str, reference_kernels: type[_ReferenceRMSNorm], calls: Counter[str]
) -> None:
    """Every call goes through the installed forwards; with Hugging Face's arithmetic inside, nothing changes."""
    model = build_model(model_type)
    plain_loss, plain_grads = _loss_and_grads(model)
    use_liger_kernels(model)
    loss, grads = _loss_and_grads(model)
    assert dict(calls) == _counts(model_type)  # one forward: each installed module once
    assert torch.equal(loss, plain_loss)
    assert plain_grads.keys() == grads.keys() and grads
    for name in grads:
        assert torch.equal(grads[name], plain_grads[name]), name
    # Control: a kernel that computes otherwise shows in the loss, so the equality above is the forwards' doing.
    reference_kernels.shift = 1e-3
    assert not torch.equal(_loss_and_grads(model)[0], plain_loss)


def test_generation_with_a_cache_goes_through_the_rebuilt_attention(
    reference_kernels: type[_ReferenceRMSNorm], calls: Counter[str]
) -> None:
    """The attention's forward is rebuilt with its decorator (``deprecate_kwarg``): the cache path works as before."""
    model = build_model("llama").eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    use_liger_kernels(model)
    patched = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(plain, patched)
    assert calls["rope"] == 4 * NUM_LAYERS  # the prompt, then one call per new token but the last


def test_nothing_leaks_into_another_instance_or_the_modeling_module(
    reference_kernels: type[_ReferenceRMSNorm], calls: Counter[str]
) -> None:
    rope = modeling_llama.apply_rotary_pos_emb
    classes = {cls: cls.forward for cls in (modeling_llama.LlamaRMSNorm, modeling_llama.LlamaMLP)}
    attention = modeling_llama.LlamaAttention.forward
    other = build_model("llama", seed=1)
    other_before = _loss_and_grads(other)
    use_liger_kernels(build_model("llama"))
    assert modeling_llama.apply_rotary_pos_emb is rope and modeling_llama.LlamaAttention.forward is attention
    assert all(cls.forward is forward for cls, forward in classes.items())
    assert modeling_llama.LlamaRMSNorm.__name__ == "LlamaRMSNorm"
    assert _instance_forwards(other) == []
    reference_kernels.shift = 1e-3  # a leaked kernel would move the other model's loss
    other_after = _loss_and_grads(other)
    assert calls == Counter()
    assert torch.equal(other_before[0], other_after[0])
    # Control: the patched instance itself does call them.
    patched = use_liger_kernels(build_model("llama"))
    _loss_and_grads(patched)
    assert calls["rope"] == NUM_LAYERS


class _LigerModule(CausalLMModule):
    """Installs the switch where the module builds its model: every strategy trains the same function."""

    def configure_model(self) -> None:
        super().configure_model()
        use_liger_kernels(self.model)


def test_liger_module_blockwise_equals_resident_with_reference_kernels(
    reference_kernels: type[_ReferenceRMSNorm], calls: Counter[str]
) -> None:
    """The replay recomputes each layer through the installed forwards, with the call arguments it captured."""
    reference_kernels.shift = 1e-3  # the "kernels" differ from Hugging Face's, as Liger's do in rounding
    resident = fit(_LigerModule(lambda: build_model("llama"), in_configure_model=True), "auto")
    resident_ropes = calls["rope"]
    assert resident_ropes == 8 * NUM_LAYERS  # `fit`: 8 micro-batches
    blockwise = fit(_LigerModule(lambda: build_model("llama"), in_configure_model=True), BlockwiseStrategy())
    assert calls["rope"] - resident_ropes == 2 * 8 * NUM_LAYERS  # no-grad forward, then the recompute
    assert_equal_runs(resident, blockwise)
    # Control: the module without the switch trains another function.
    plain = fit(CausalLMModule(lambda: build_model("llama")), "auto")
    assert runs_differ(resident, plain)


def test_a_cpu_tensor_is_refused_at_the_first_call() -> None:
    model = use_liger_kernels(build_model("llama"))
    with pytest.raises(MisconfigurationException, match=r"run on CUDA only.*unuse_liger_kernels\(model\)"):
        model(**padded_batches(1)[0])
    # Control: without the switch the same call runs.
    unuse_liger_kernels(model)
    model(**padded_batches(1)[0])


def test_missing_liger_kernel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_model("llama")
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(MisconfigurationException, match=r'pip install "lightning-blockwise\[kernels\]"'):
        use_liger_kernels(model)
    assert _instance_forwards(model) == []
    monkeypatch.undo()  # control: with the library there, the same call installs
    use_liger_kernels(model)
    assert liger_kernels_in(model)["rope"] == NUM_LAYERS


def test_unknown_model_type_and_activation_are_refused() -> None:
    from transformers import AutoModelForCausalLM, GraniteConfig

    granite = AutoModelForCausalLM.from_config(
        GraniteConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    with pytest.raises(ValueError, match=r"model_type 'granite'.*llama"):
        use_liger_kernels(granite)
    gelu = build_model("llama", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"activation 'gelu'.*swiglu=False"):
        use_liger_kernels(gelu)
    assert _instance_forwards(gelu) == []  # refused before anything changed
    use_liger_kernels(gelu, swiglu=False)  # control: its norms and RoPE are Liger's
    assert liger_kernels_in(gelu) == {"rms_norm": 2 * NUM_LAYERS + 1, "rope": NUM_LAYERS, "mlp": 0}
    assert {"llama", "qwen2", "gemma3_text", "phi3"} <= LIGER_MODEL_TYPES


def test_tiled_mlps_are_refused_for_swiglu_and_kept_without_it() -> None:
    model = build_model("llama")
    tile_mlps(model, 5)
    with pytest.raises(ValueError, match=r"TiledMLP.*tile_mlps replaced it.*swiglu=False"):
        use_liger_kernels(model)
    assert liger_kernels_in(model) == {"rms_norm": 0, "rope": 0, "mlp": 0}
    use_liger_kernels(model, swiglu=False)
    layers = model.get_base_model().model.layers
    assert all(isinstance(vars(layer.mlp)["forward"], TiledMLP) for layer in layers)
    assert liger_kernels_in(model)["rope"] == NUM_LAYERS


def test_gemma3_multimodal_gets_its_language_model_only() -> None:
    """configs/gemma-3-27b.yaml's model_type: the language model's layers are gemma3_text's, the vision tower stays."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4,
    )  # fmt: skip
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
        eoi_token_index=298,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config)
    use_liger_kernels(model)
    assert liger_kernels_in(model) == {"rms_norm": 2 * 6 + 1, "rope": 2, "mlp": 2}
    assert all(name.startswith("model.language_model.") for name in _instance_forwards(model))


def test_the_planner_counts_the_fused_activation_out_of_a_kept_graph() -> None:
    """A kept layer with Liger's MLP keeps one MLP-sized tensor less (StepShape.layer_graph); control: without it.

    Only the MLP kernel is installed here: Liger's RMSNorm takes hidden-sized tensors out of the graph too (the
    planner's ``fused_norm``, tested in tests/planning), which would blur the one MLP-sized tensor this checks.
    """
    from lightning_blockwise.planning.step_budget import StepBudget
    from lightning_blockwise.strategy.module_budget import module_budget

    def budget(model: nn.Module) -> StepBudget:
        return module_budget(model, model.get_base_model(), [1000] * NUM_LAYERS, torch.device("cpu"), 2, None, None)

    model = build_model("llama")
    plain = budget(model)
    use_liger_kernels(model, rms_norm=False, rope=False)
    fused = budget(model)
    assert fused.kernels.fused_mlp and not plain.kernels.fused_mlp
    assert not fused.kernels.fused_norm
    tokens = 4096
    config = model.get_base_model().config
    saved = plain.layer_graph(tokens) - fused.layer_graph(tokens)
    one_mlp_tensor = tokens * config.intermediate_size * plain.activation_bytes
    assert one_mlp_tensor <= saved <= one_mlp_tensor * 1.05  # the allocator's rounding on top (2%)
    unuse_liger_kernels(model)
    assert not budget(model).kernels.fused_mlp
