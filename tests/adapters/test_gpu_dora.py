"""DoRA's factored row norm on the GPU: blockwise == resident bit for bit, and how far it is from PEFT's dense norm.

One command, deterministic mode (cuBLAS reads its workspace setting once per process):
`CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m pytest tests/adapters/test_gpu_dora.py -s`.
The parity runs train real-architecture shapes cut to a few layers (Qwen2.5-1.5B and Llama-3.2-1B widths,
random-init NF4 base, DoRA with dropout 0.1 on the seven projections); the norm test measures the factored
norm against PEFT's in bf16 at real projection shapes (docs/dora-norm.md has the CPU table).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.dora import DoraLinearLayer
from peft.utils.integrations import dequantize_module_weight
from torch import nn

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise.adapters.dora_norm import FactoredDoraNorm, factor_dora_norms
from lightning_blockwise.compat.bitsandbytes import nf4_linear
from lightning_blockwise.recipes.random_init import random_nf4_model
from tests.adapters.test_dora_norm import BOUNDS
from tests.helpers.models import DEFAULT_TARGETS, GPU_SHAPES, RunResult, assert_equal_runs, fit_on_gpu, runs_differ

pytestmark = pytest.mark.gpu

LAYERS = 3
SEQ = 512
STEPS = 6
ACCUMULATE = 2
SCALING = 2.0


def _deterministic_or_skip() -> None:
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        pytest.skip("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set for the whole process")


def _builder(shape: str, rank: int, factored: bool) -> Callable[[], nn.Module]:
    """A random-init NF4 base of ``shape``'s widths, ``LAYERS`` deep, with DoRA at ``rank`` (seed 0)."""

    def build() -> nn.Module:
        config = GPU_SHAPES[shape]()
        config.num_hidden_layers = LAYERS
        torch.manual_seed(0)
        base = random_nf4_model(config, "cuda")
        lora = LoraConfig(
            r=rank, lora_alpha=2 * rank, lora_dropout=0.1, target_modules=DEFAULT_TARGETS, use_dora=True
        )  # fmt: skip
        model = get_peft_model(base, lora)
        if factored:
            assert factor_dora_norms(model) == len(DEFAULT_TARGETS) * LAYERS
        return model

    return build


def _fit(shape: str, rank: int, strategy: str, factored: bool = True) -> RunResult:
    return fit_on_gpu(_builder(shape, rank, factored), strategy, STEPS, ACCUMULATE, SEQ, deterministic=True)


@pytest.mark.parametrize(("shape", "rank"), [("qwen2", 64), ("llama", 8)], ids=["qwen2-r64", "llama-r8"])
def test_factored_blockwise_equals_resident_and_control(shape: str, rank: int) -> None:
    _deterministic_or_skip()
    resident = _fit(shape, rank, "auto")
    magnitudes = [name for name in resident.grads[0] if "lora_magnitude_vector" in name]
    assert len(magnitudes) == len(DEFAULT_TARGETS) * LAYERS
    # PEFT starts B at 0, so A's first gradients are 0: the last step's must not be, or the comparison is vacuous.
    assert all(g.any() for name, g in resident.grads[-1].items() if "lora_A" in name)
    blockwise = _fit(shape, rank, "blockwise")
    assert_equal_runs(resident, blockwise)
    print(f"[gpu dora] {shape} r {rank}: {len(resident.losses)} micro-batches, {STEPS} steps: torch.equal on all")
    # Control: the same run on PEFT's dense norm differs (by rounding), so the comparison can fail.
    dense = _fit(shape, rank, "blockwise", factored=False)
    assert runs_differ(resident, dense), "control: PEFT's dense norm must give another run than the factored one"
    gap = max((a.float() - b.float()).abs().item() for a, b in zip(resident.losses, dense.losses, strict=True))
    print(f"[gpu dora] {shape} r {rank}: largest loss difference, factored vs PEFT's dense norm: {gap:.3e}")


def _relative(norm: torch.Tensor, reference: torch.Tensor) -> float:
    return ((norm.double() - reference.double()).abs() / reference.double()).max().item()


@pytest.mark.parametrize(
    ("d_out", "d_in", "rank"), [(1536, 8960, 64), (8192, 29568, 384)], ids=["1.5b-down-r64", "72b-down-r384"]
)
@pytest.mark.parametrize("delta", ["small", "half"], ids=["B-std-0.01", "sBA-half-of-W"])
def test_factored_norm_deviation_from_peft_in_bf16(d_out: int, d_in: int, rank: int, delta: str) -> None:
    """PEFT's norm as its training forward takes it (bf16 autocast, NF4 base) against the factored one."""
    torch.manual_seed(0)
    with torch.device("meta"):
        linear = nn.Linear(d_in, d_out, bias=False)
    base = nf4_linear(linear, torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02, torch.bfloat16)
    # B as docs/dora-norm.md's table (0.01), or sized so that s B A's rows are half as long as W's (0.02 sqrt(d_in)).
    std_b = 0.01 if delta == "small" else 0.5 * 0.02 * d_in**0.5 / (SCALING * rank**0.5)
    lora_a = nn.Linear(d_in, rank, bias=False, device="cuda")
    lora_b = nn.Linear(rank, d_out, bias=False, device="cuda")
    nn.init.normal_(lora_a.weight, std=d_in**-0.5)
    nn.init.normal_(lora_b.weight, std=std_b)
    layer = DoraLinearLayer(fan_in_fan_out=False)
    layer.weight = nn.Parameter(torch.ones(d_out, device="cuda"))  # the magnitude: where the base term is kept
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        weight = dequantize_module_weight(base).to(torch.bfloat16)
        lora_weight = layer.get_lora_weight(lora_A=lora_a, lora_B=lora_b).to(torch.bfloat16)
        dense = layer.get_weight_norm(weight, lora_weight, SCALING)
        factored = FactoredDoraNorm(layer).norm(weight, lora_a.weight, lora_b.weight, SCALING)
        # Control: a norm without the adapter's terms (scaling 0) is far from PEFT's.
        without = FactoredDoraNorm(layer).norm(weight, lora_a.weight, lora_b.weight, 0.0)
    exact = (weight.double() + SCALING * lora_b.weight.double() @ lora_a.weight.double()).norm(dim=1)
    deviation = _relative(factored, dense)
    print(
        f"[gpu dora norm] {d_out}x{d_in} r {rank} ({delta} delta, bf16): factored vs PEFT {deviation:.2e}, PEFT vs"
        f" exact {_relative(dense, exact):.2e}, factored vs exact {_relative(factored, exact):.2e} (bound"
        f" {BOUNDS[torch.bfloat16]:.0e})"
    )
    assert dense.dtype == torch.bfloat16 and factored.dtype == torch.float32
    assert 0 < deviation <= BOUNDS[torch.bfloat16]
    # The deviation is PEFT's rounding (its norm in bf16): the factored norm is the closer one to the exact value.
    assert _relative(factored, exact) < _relative(dense, exact)
    if delta == "half":
        assert _relative(without, dense) > 10 * BOUNDS[torch.bfloat16]
