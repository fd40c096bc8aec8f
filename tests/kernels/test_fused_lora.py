"""The fused LoRA update (kernels/fused_lora.py): installed per instance, close to PEFT's forward, exact blockwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.kernels.fused_lora import (
    FusedLoraForward,
    fused_lora_in,
    unuse_fused_lora,
    use_fused_lora,
)
from tests.helpers.models import (
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    padded_batches,
    runs_differ,
)


def _loss_and_grads(model: nn.Module, autocast: bool = False) -> tuple[Tensor, dict[str, Tensor]]:
    batch = padded_batches(1)[0]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # LoRA dropout
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    return [
        m for m in model.modules() if hasattr(m, "lora_A") and isinstance(getattr(m, "base_layer", None), nn.Linear)
    ]


def test_installs_on_every_lora_linear_and_undo_gives_peft_back() -> None:
    model = build_model("llama")
    layers = _lora_layers(model)
    assert fused_lora_in(model) is False
    assert use_fused_lora(model) == len(layers) > 0
    assert use_fused_lora(model) == len(layers)  # twice is once
    assert all(isinstance(vars(layer)["forward"], FusedLoraForward) for layer in layers)
    assert fused_lora_in(model)
    assert unuse_fused_lora(model) == len(layers)
    assert not any("forward" in vars(layer) for layer in layers) and not fused_lora_in(model)


def _worst_error(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    assert grads.keys() == reference.keys() and grads
    return max(((grads[n] - reference[n]).norm() / reference[n].norm()).item() for n in reference)


def test_the_fused_update_is_peft_lora_up_to_rounding() -> None:
    """fp32: PEFT's function to fp32 rounding. bf16 autocast: at least as close to fp32 as PEFT's own forward."""
    reference_loss, reference_grads = _loss_and_grads(build_model("llama"))
    fused = use_fused_lora_on(build_model("llama"))
    fused_loss, fused_grads = _loss_and_grads(fused)
    torch.testing.assert_close(fused_loss, reference_loss, rtol=1e-5, atol=0)
    assert _worst_error(fused_grads, reference_grads) < 1e-5
    peft_bf16_loss, peft_bf16_grads = _loss_and_grads(build_model("llama"), autocast=True)
    fused_bf16_loss, fused_bf16_grads = _loss_and_grads(fused, autocast=True)
    peft_error = _worst_error(peft_bf16_grads, reference_grads)
    assert _worst_error(fused_bf16_grads, reference_grads) <= 1.25 * peft_error
    assert abs(fused_bf16_loss - reference_loss) <= 1.25 * abs(peft_bf16_loss - reference_loss) + 1e-6
    # Control: a wrong scaling is far outside (the comparison sees the update).
    for layer in _lora_layers(fused):
        layer.scaling = {name: 3 * s for name, s in layer.scaling.items()}
    assert _worst_error(_loss_and_grads(fused)[1], reference_grads) > 10 * peft_error


def use_fused_lora_on(model: nn.Module) -> nn.Module:
    use_fused_lora(model)
    return model


def test_disabled_adapters_run_the_base_alone_as_peft_does() -> None:
    model = build_model("llama").eval()
    batch = padded_batches(1)[0]
    with torch.no_grad(), model.disable_adapter():
        peft_base = model(**batch).logits
    use_fused_lora(model)
    with torch.no_grad():
        with model.disable_adapter():
            fused_base = model(**batch).logits
        adapted = model(**batch).logits
    assert torch.equal(fused_base, peft_base)
    assert not torch.equal(adapted, peft_base)  # control: with the adapters on, the update is there


class _FusedModule(CausalLMModule):
    """Installs the switch where the module builds its model: every strategy trains the same function."""

    def configure_model(self) -> None:
        super().configure_model()
        use_fused_lora(self.model)


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "nf4"])
def test_fused_module_blockwise_equals_resident(quantized: bool, checkpoints: dict[str, Path]) -> None:
    """Dropout on, 8 micro-batches: the replay recomputes each layer through the installed forwards."""

    def build() -> nn.Module:
        if quantized:
            return build_model("llama", checkpoint=checkpoints["llama"], quantized=True)
        return build_model("llama")

    # bf16 autocast, where the fused update rounds differently from PEFT's (in fp32 on this CPU it does not).
    resident = fit(_FusedModule(build, in_configure_model=True), "auto", precision="bf16-mixed")
    blockwise = fit(_FusedModule(build, in_configure_model=True), BlockwiseStrategy(), precision="bf16-mixed")
    assert_equal_runs(resident, blockwise)
    # Control: the module without the switch trains another function (PEFT's rounding).
    plain = fit(CausalLMModule(build, in_configure_model=True), "auto", precision="bf16-mixed")
    assert runs_differ(resident, plain)


def test_dora_bias_and_plain_models_are_refused() -> None:
    torch.manual_seed(0)
    dora = build_model("llama", peft=False)
    dora = get_peft_model(dora, LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(ValueError, match=r"q_proj.*DoRA.*use_dora=False"):
        use_fused_lora(dora)
    assert not fused_lora_in(dora)  # refused before anything is installed
    biased = get_peft_model(
        build_model("llama", peft=False), LoraConfig(r=4, target_modules=["v_proj"], lora_bias=True)
    )
    with pytest.raises(ValueError, match=r"v_proj.*lora_B bias"):
        use_fused_lora(biased)
    with pytest.raises(ValueError, match=r"no PEFT LoRA linear.*get_peft_model"):
        use_fused_lora(build_model("llama", peft=False))
