"""LoRA's update added inside the adapter's second matmul (``torch.addmm``), the module's choice.

Example::

    model = get_peft_model(base, LoraConfig(r=16, target_modules=[...]))
    use_fused_lora(model)  # the same under strategy="auto" and "blockwise"
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import VARIANT_KWARG_KEYS, LoraLayer
from torch import Tensor, nn

# NOTE [ Fused LoRA update ]
# PEFT 0.21 computes a LoRA linear as
#   result = base(x); result = result.clone()  (bitsandbytes layers: a "defensive clone")
#   result = result + lora_B(lora_A(dropout(x))) * scaling
# and, on a dense base, first casts x to the adapters' dtype (an fp32 copy of the layer input under bf16 autocast,
# which autocast casts back to bf16 for the matmul). Beside the two small matmuls that is four passes over the
# d_out-wide output per projection in the forward (the clone, the product with `scaling`, the sum, and the
# fp32 input copy or none) and one more in the backward (the gradient times `scaling`).
# Here the update is one GEMM with the base output as its addend (added in place, NOTE [ The update added in place ]):
#   result = base(x).addmm_(lora_A(dropout(x)), lora_B.weight.T, alpha=scaling)
# so the GEMM adds `scaling * (x A^T) B^T` to the base output in its epilogue, nothing of the output is copied, and
# autograd's addmm backward scales only the d_out x r and N x r gradients. Measured on the H100 at the 7B shape,
# every layer kept: 2% of a step at 4k tokens, 5.5% at 16k (benchmarks/RESULTS.md, session of 2026-11-26). The
# scaled product is rounded once where PEFT rounds the product and then the scaled product: at PEFT's usual
# scaling of 2 (exact in binary) the H100 gave PEFT's bits, at 1.5 other ones. What autograd saves is what PEFT's
# graph saves (x for lora_A, x A^T for the second matmul): the memory model is unchanged. The base layer is called
# as PEFT calls it, so bitsandbytes' dequantization and the blockwise strategy's streamed weights are untouched.
#
# It differs from PEFT's forward by rounding only, so, like the Liger kernels, it is the module's choice: installed
# on the module, it runs under every strategy and blockwise == resident holds for that module
# (tests/kernels/test_fused_lora.py; on the GPU tests/kernels/test_gpu_fused_lora.py). The addmm runs outside autocast
# with its operands in the base output's dtype: a bf16 output gets the bf16 GEMM autocast would run; an fp32 one
# (fp32 hidden states over an NF4 base) stays fp32, as PEFT's sum with an fp32 output does, its update computed in
# fp32 where PEFT's is bf16; an fp32 adapter on a bf16 base without autocast computes its second matmul in bf16,
# where PEFT computes it in fp32 and rounds after. Adapters off, merged
# or chosen per sample (`adapter_names`, inference) run PEFT's own forward: those states add no update to fuse.
# Installed per instance (`layer.forward = FusedLoraForward(layer)`), the classes untouched, like the
# factored DoRA norm (adapters/dora_norm.py).
#
# NOTE [ The update added in place ]
# ``torch.addmm(base, ...)`` with a 2-D addend copies ``base`` into a new output, then runs the GEMM with beta=1 on
# it (cuBLAS reads and writes C in place); ``base.addmm_(...)`` runs the same GEMM on ``base`` itself: the same bits,
# and no copy. The copy was one pass over each projection's output per forward, 7 device-to-device copies per layer
# (0.4 ms each for the MLP's 16k x 18944 outputs at the 7B shape) in which the GPU computed nothing: they were the
# GPU's idle time in the profile of a step (benchmarks/RESULTS.md, session of 2026-11-26 11:42;
# `benchmarks/peer_arms/gaps.py`). Writing into the base output is safe: it is a fresh tensor that no autograd node
# saved (bitsandbytes' ``MatMul4Bit`` and a dense linear keep their input, not their output), and the version
# counter would make autograd refuse any node that had. The base layer gets its input as a 2-D matrix, the same
# GEMM: a linear of a 3-D input returns a view of its 2-D product, and where that view is made inside a custom
# Function (bitsandbytes' dequantize-and-linear path past 1536 rows) autograd forbids writing into it. A base output
# that is a view all the same gets the out-of-place ``addmm``.


class FusedLoraForward:
    """The forward installed on one PEFT LoRA linear (an instance attribute; the class is untouched)."""

    def __init__(self, layer: LoraLayer) -> None:
        self.layer = layer

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """PEFT's LoRA forward with each active adapter's update added inside its second matmul."""
        layer = self.layer
        if layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None:
            return type(layer).forward(layer, x, *args, **kwargs)
        layer._check_forward_args(x, *args, **kwargs)
        for key in VARIANT_KWARG_KEYS:  # as PEFT does: variants' arguments never reach the base layer
            kwargs.pop(key, None)
        # A 2-D input, so that the output is the base's own tensor, not a view it made of it (NOTE [ The update
        # added in place ]); the same GEMM either way.
        result = layer.base_layer(x.reshape(-1, x.shape[-1]), *args, **kwargs)
        for name in layer.active_adapters:
            if name not in layer.lora_A:
                continue
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            if not torch.is_autocast_enabled(x.device.type):
                # PEFT's cast (an fp32 adapter on a bf16 input computes its first matmul in fp32 without autocast;
                # `cast_input_dtype_enabled` turns it off). Under autocast the matmul casts, so x is not copied.
                x = layer._cast_input_dtype(x, lora_a.weight.dtype)
            product = lora_a(layer.lora_dropout[name](x))
            result = _add_product(result, product, lora_b.weight, layer.scaling[name])
        return result.view(*x.shape[:-1], result.shape[-1])


def _add_product(result: Tensor, product: Tensor, weight_b: Tensor, scaling: float) -> Tensor:
    """``result + scaling * product @ weight_b.T`` for a 2-D ``result``, one ``addmm`` in its dtype.

    NOTE [ Fused LoRA update ]; in place where ``result`` is no view (NOTE [ The update added in place ]).
    """
    product = product.reshape(-1, product.shape[-1]).to(result.dtype)
    # Outside autocast: in the base output's own dtype, so an fp32 output (fp32 hidden states over an NF4 base)
    # stays fp32 as under PEFT's forward; a bf16 one runs the bf16 GEMM autocast would have run.
    with torch.autocast(result.device.type, enabled=False):
        if result._is_view():  # autograd forbids writing into a view a custom Function returned
            return torch.addmm(result, product, weight_b.t().to(result.dtype), alpha=scaling)
        return result.addmm_(product, weight_b.t().to(result.dtype), alpha=scaling)


def _lora_linears(model: nn.Module) -> list[LoraLayer]:
    """The PEFT LoRA layers of ``model`` on a linear base (dense, or bitsandbytes' ``Linear4bit``, an ``nn.Linear``)."""
    return [m for m in model.modules() if isinstance(m, LoraLayer) and isinstance(m.base_layer, nn.Linear)]


def lora_variants_in(model: nn.Module) -> list[str]:
    """The PEFT variants (``"DoraLinearVariant"``, ...) of ``model``'s LoRA linears, which the fused update refuses."""
    return sorted(
        {type(variant).__name__ for layer in _lora_linears(model) for variant in (layer.lora_variant or {}).values()}
    )


def use_fused_lora(model: nn.Module) -> int:
    """Add every LoRA linear's update inside its second matmul (NOTE [ Fused LoRA update ]).

    Call it where the module builds its model, after the adapters are added, so that every strategy trains the
    same function: blockwise == resident holds for the module, which differs from PEFT's forward by rounding.
    Installing twice is safe; :func:`unuse_fused_lora` takes it off.

    Args:
        model: A PEFT model (or a module holding one) with LoRA adapters on linear layers (dense or
            bitsandbytes 4-bit bases).

    Returns:
        How many LoRA linears now add their update in one ``addmm``.

    Raises:
        ValueError: If the model has no LoRA linear, or one of them has an adapter this forward does not compute
            (DoRA or another PEFT variant, a ``lora_B`` bias), saying which and the fix.

    Example::

        model = get_peft_model(base, LoraConfig(r=16, target_modules="all-linear"))
        use_fused_lora(model)
        Trainer(strategy="blockwise", precision="bf16-mixed").fit(module)
    """
    layers = _lora_linears(model)
    if not layers:
        raise ValueError(
            "use_fused_lora found no PEFT LoRA linear in the model: add the adapters first"
            " (`get_peft_model(base, LoraConfig(...))`), then call it."
        )
    names = {module: name for name, module in model.named_modules()}
    for layer in layers:
        variants = sorted(getattr(layer, "lora_variant", {}) or {})
        biased = sorted(name for name, b in layer.lora_B.items() if getattr(b, "bias", None) is not None)
        if variants or biased:
            what = f"a PEFT variant (DoRA or another) for {variants}" if variants else f"a lora_B bias for {biased}"
            raise ValueError(
                f"use_fused_lora: `{names[layer]}` has {what}, which the fused update does not compute. Train those"
                " adapters with PEFT's forward (do not call use_fused_lora; `CausalLMFineTune(kernels=...)` without"
                " 'fused_lora'), or use plain LoRA (`LoraConfig(use_dora=False, lora_bias=False)`)."
            )
    for layer in layers:
        layer.forward = FusedLoraForward(layer)
    return len(layers)


def unuse_fused_lora(model: nn.Module) -> int:
    """Give every LoRA linear of ``model`` PEFT's forward back.

    Returns:
        How many had the fused update.
    """
    count = 0
    for layer in _lora_linears(model):
        if isinstance(vars(layer).get("forward"), FusedLoraForward):
            del layer.forward
            count += 1
    return count


def fused_lora_in(model: nn.Module) -> bool:
    """Whether any LoRA linear of ``model`` adds its update with :func:`use_fused_lora`'s forward."""
    return any(isinstance(vars(layer).get("forward"), FusedLoraForward) for layer in _lora_linears(model))


__all__ = ["FusedLoraForward", "fused_lora_in", "lora_variants_in", "unuse_fused_lora", "use_fused_lora"]
