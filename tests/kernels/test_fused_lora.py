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
    _add_product,
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


def _projection_outputs(model: nn.Module, autocast: bool) -> dict[str, Tensor]:
    """Every LoRA linear's output for one batch (eval mode: no dropout), by module name."""
    outputs: dict[str, Tensor] = {}
    handles = [
        module.register_forward_hook(lambda m, args, out, n=name: outputs.__setitem__(n, out.detach()))
        for name, module in model.named_modules()
        if module in _lora_layers(model)
    ]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model.eval()(**padded_batches(1)[0])
    for handle in handles:
        handle.remove()
    return outputs


#: Projections whose input is the same with and without the switch (the first layer's attention inputs): later ones
#: see the earlier layers' rounding too.
_FIRST = ("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj")


def _first(outputs: dict[str, Tensor]) -> dict[str, Tensor]:
    chosen = {name: output for name, output in outputs.items() if name.endswith(_FIRST)}
    assert len(chosen) >= 2
    return chosen


def test_an_fp32_output_under_autocast_stays_fp32_as_peft_returns_it(checkpoints: dict[str, Path]) -> None:
    """fp32 hidden states over an NF4 base: PEFT's sum is fp32, so the fused update's must be (not a bf16 GEMM)."""
    model = build_model("llama", checkpoint=checkpoints["llama"], quantized=True)
    peft_outputs = _projection_outputs(model, autocast=True)
    use_fused_lora(model)
    fused_outputs = _projection_outputs(model, autocast=True)
    assert peft_outputs.keys() == fused_outputs.keys() and peft_outputs
    # The case this test is about: q/k/v and the MLP's gate/up take the fp32 normed hidden states.
    assert torch.float32 in {o.dtype for o in peft_outputs.values()}
    for name, output in fused_outputs.items():
        assert output.dtype == peft_outputs[name].dtype, name
    for name, output in _first(fused_outputs).items():
        assert output.dtype == torch.float32
        # Only the update differs: PEFT rounds it to bf16 (its random B makes it ~1 here, so ~4e-3), this keeps fp32.
        torch.testing.assert_close(output, peft_outputs[name], rtol=2**-8, atol=1e-2)


def test_several_active_adapters_and_an_fp32_adapter_on_a_bf16_model() -> None:
    """Two adapters at once (each added in turn), and the cast without autocast: PEFT's function up to rounding."""
    model = build_model("llama")
    model.add_adapter(
        "second", LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    model.base_model.set_adapter(["default", "second"])
    peft_outputs = _projection_outputs(model, autocast=False)
    use_fused_lora(model)
    fused_outputs = _projection_outputs(model, autocast=False)
    for name, output in _first(fused_outputs).items():
        torch.testing.assert_close(output, peft_outputs[name], rtol=1e-5, atol=1e-6)
    # Control: the second adapter contributes (dropping it moves the outputs it adapts).
    model.base_model.set_adapter("default")
    alone = _projection_outputs(model, autocast=False)
    assert any(not torch.allclose(alone[n], fused_outputs[n]) for n in fused_outputs if n.endswith("q_proj"))
    # A bf16 model with fp32 adapters, no autocast: the input is cast for lora_A as PEFT casts it.
    bf16 = build_model("llama").to(torch.bfloat16)
    for name, parameter in bf16.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
    peft_bf16 = _projection_outputs(bf16, autocast=False)
    use_fused_lora(bf16)
    fused_bf16 = _projection_outputs(bf16, autocast=False)
    for name, output in fused_bf16.items():
        assert output.dtype == peft_bf16[name].dtype == torch.bfloat16
    for name, output in _first(fused_bf16).items():
        torch.testing.assert_close(output, peft_bf16[name], rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_update_is_added_in_place_with_the_out_of_place_bits(dtype: torch.dtype) -> None:
    """NOTE [ The update added in place ]: the base output is written, not copied, and the bits are addmm's."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(48, 64, generator=generator).to(dtype)
    product = torch.randn(2, 24, 4, generator=generator).to(dtype)
    weight_b = torch.randn(64, 4, generator=generator)
    expected = torch.addmm(base, product.reshape(-1, 4), weight_b.t().to(dtype), alpha=1.5)
    address = base.data_ptr()
    fused = _add_product(base, product, weight_b, 1.5)
    assert torch.equal(fused, expected) and fused.data_ptr() == address  # no new output
    assert expected.data_ptr() != address  # control: the out-of-place addmm allocates one


class _ViewReturningLinear(torch.autograd.Function):
    """A base that returns a view of its product made inside the Function, as bitsandbytes' 3-D path does."""

    @staticmethod
    def forward(ctx: object, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[override]
        return torch.mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[None, None]:  # type: ignore[override]
        return None, None


def test_a_base_output_made_a_view_in_a_custom_function_is_not_written() -> None:
    """Such a view refuses in-place writes (the control); the update then takes the out-of-place addmm."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    weight, product, weight_b = torch.randn(16, 8), torch.randn(6, 4), torch.randn(16, 4)
    view = _ViewReturningLinear.apply(x, weight).reshape(-1, 16)
    with pytest.raises(RuntimeError, match="view and is being modified inplace"):
        _ViewReturningLinear.apply(x, weight).reshape(-1, 16).addmm_(product, weight_b.t())
    fused = _add_product(view, product, weight_b, 2.0)
    assert torch.equal(fused, torch.addmm(view, product, weight_b.t(), alpha=2.0))
