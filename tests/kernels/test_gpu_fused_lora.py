"""GPU: the fused LoRA update (``use_fused_lora``) trains blockwise exactly as resident, on NF4 bases in bf16.

`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/kernels/test_gpu_fused_lora.py -s` (deterministic mode).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.kernels.fused_lora import use_fused_lora
from tests.helpers.models import (
    DEFAULT_TARGETS,
    GPU_SHAPES,
    assert_equal_runs,
    fit_on_gpu,
    nf4_lora_builder,
    runs_differ,
    save_gpu_shape,
)

pytestmark = pytest.mark.gpu

LAYERS = 4  # a few real-shape layers (Qwen2.5-1.5B, Llama-3.2-1B): the forward is per projection
SEQ = 512
STEPS = 4
ACCUMULATE = 2
SCALING = 1.5  # alpha / r; not a power of two, so the scaled product rounds (see _builder)


@pytest.fixture(scope="module", params=sorted(GPU_SHAPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A random-init bf16 checkpoint of a real architecture's shape, ``LAYERS`` decoder layers."""
    return request.param, save_gpu_shape(request.param, LAYERS, tmp_path_factory.mktemp(request.param))


def _builder(path: Path, fused: bool) -> Callable[[], nn.Module]:
    """NF4 base, LoRA r16 with dropout on every projection; the fused update installed when ``fused``.

    ``lora_B`` starts random (seeded), not at PEFT's zeros, and the scaling is 1.5, not PEFT's alpha/r of 2: on the
    H100 both forwards gave the same bits with B from zeros and scaling 2 (the update below a bf16 ulp of the base
    output), and again with random B and scaling 2 (test_fused_lora_rounds_like_peft_on_the_gpu measures this), so
    the control would not see the switch.
    """
    build = nf4_lora_builder(path, DEFAULT_TARGETS, r=16)

    def with_switch() -> nn.Module:
        model = build()
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if ".lora_B." in name:
                    parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
        for layer in model.modules():
            if isinstance(getattr(layer, "scaling", None), dict):
                layer.scaling = dict.fromkeys(layer.scaling, SCALING)
        if fused:
            assert use_fused_lora(model) == LAYERS * len(DEFAULT_TARGETS)
        return model

    return with_switch


def test_deterministic_fused_lora_blockwise_equals_resident_and_control(checkpoint: tuple[str, Path]) -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")
    name, path = checkpoint
    resident = fit_on_gpu(_builder(path, fused=True), "auto", STEPS, ACCUMULATE, SEQ)
    # Every block streamed, every layer recomputed through the installed forwards.
    blockwise = fit_on_gpu(_builder(path, fused=True), "blockwise", STEPS, ACCUMULATE, SEQ)
    assert_equal_runs(resident, blockwise)
    # The card's default budget: these few layers stay resident and keep their graphs.
    kept = fit_on_gpu(_builder(path, fused=True), BlockwiseStrategy(), STEPS, ACCUMULATE, SEQ)
    assert_equal_runs(resident, kept)
    print(f"[gpu fused lora] {name}: streamed and kept blockwise == resident ({STEPS} steps x {ACCUMULATE})")
    # Control: PEFT's forward rounds differently, so the module without the switch trains another function.
    plain = fit_on_gpu(_builder(path, fused=False), "auto", STEPS, ACCUMULATE, SEQ)
    assert runs_differ(resident, plain), "control: the fused update on and off must differ"
    delta = max((a - b).abs().item() for a, b in zip(resident.losses, plain.losses, strict=True))
    print(f"[gpu fused lora] {name}: fused vs PEFT's forward, largest loss difference {delta:.3g} (rounding)")


@pytest.mark.parametrize("scaling", [2.0, 1.5])
def test_fused_lora_rounds_like_peft_on_the_gpu(scaling: float) -> None:
    """One NF4 projection with LoRA r16 under bf16 autocast: how many outputs and input gradients differ from PEFT's.

    A measurement with a bound: the two forwards agree within bf16 rounding of the output; the count of differing
    elements is printed (docs/kernels.md). Control: a wrong scaling is far outside the bound.
    """
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(2048, 8192, bias=False, dtype=torch.bfloat16))
    quantized = nn.Sequential(bnb.nn.Linear4bit(2048, 8192, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4"))
    quantized[0].load_state_dict(base[0].state_dict())
    model = get_peft_model(quantized.cuda(), LoraConfig(r=16, lora_alpha=16, target_modules=["0"])).cuda()
    layer = model.base_model.model[0]
    layer.scaling = dict.fromkeys(layer.scaling, scaling)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.02)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def output_and_grad() -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()
        return y.detach(), x.grad.clone()

    peft_y, peft_dx = output_and_grad()
    use_fused_lora(model)
    fused_y, fused_dx = output_and_grad()
    differing = (fused_y != peft_y).float().mean().item()
    differing_dx = (fused_dx != peft_dx).float().mean().item()
    print(f"[gpu fused lora] scaling {scaling}: {differing:.2%} of outputs, {differing_dx:.2%} of input gradients"
          f" differ from PEFT's; largest output difference {(fused_y - peft_y).abs().max().item():.3g}")  # fmt: skip
    torch.testing.assert_close(fused_y, peft_y, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(fused_dx, peft_dx, rtol=2**-6, atol=1e-6)
    layer.scaling = dict.fromkeys(layer.scaling, 3 * scaling)  # control
    with pytest.raises(AssertionError):
        torch.testing.assert_close(output_and_grad()[0], peft_y, rtol=2**-7, atol=2**-7)
