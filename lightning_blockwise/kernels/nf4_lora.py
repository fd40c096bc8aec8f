"""An NF4 base projection and its LoRA update as one autograd node, the input's gradient summed inside a GEMM.

Used by :func:`~lightning_blockwise.kernels.fused_lora.use_fused_lora` (``one_node=True``) where a LoRA linear's
base is bitsandbytes' ``Linear4bit`` and its adapter has no dropout (NOTE [ One node per NF4 projection ]).
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import bitsandbytes.functional as bnb_functional
import torch
from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module
from torch import Tensor

# NOTE [ One node per NF4 projection ]
# Under PEFT (and the fused update, NOTE [ Fused LoRA update ] in fused_lora.py) a LoRA projection on an NF4 base
# is three autograd nodes: bitsandbytes' ``MatMul4Bit`` for the base, a linear for ``lora_A`` and an ``addmm`` for
# ``lora_B``. Their backward computes the input's gradient twice, ``G W`` from the base and ``(s G B) A`` from the
# adapter, each a fresh N x d_in tensor, and autograd then adds them: one more pass over N x d_in, 4.7 GB of traffic
# per layer at 16k tokens of the 7B shape (the MLP's down projection alone is N x 18944). Here the projection is one
# node whose backward writes ``G W`` and adds ``(s G B) A`` to it in the second GEMM's epilogue (``addmm_``), as
# Unsloth's LoRA autograd functions do. The forward computes the very ops of the fused update (bitsandbytes'
# ``matmul_4bit``, then ``x A^T`` and one ``addmm``), so the forward's bits are the fused update's; the input's
# gradient is rounded once where autograd rounds both terms and then their sum, so this is the module's choice,
# exact blockwise vs resident (tests/kernels/test_nf4_lora.py, tests/gpu/test_gpu_fused_lora.py).
#
# It keeps what the three nodes keep: x and x A^T through ``save_for_backward`` (so saved-tensor hooks, activation
# offload, and the planner's kept-graph sizes see the same tensors), the adapters' weights, and, as ``MatMul4Bit``
# does, a view of the packed weight made in the forward and the ``QuantState`` object as plain ``ctx`` attributes
# (NOTE [ Graphs do not outlive residency ] in replay/remat.py, NOTE [ Kept graphs of streamed blocks ] in
# replay/kept.py): the backward dequantizes the weight again, as ``MatMul4Bit.backward`` does.
#
# Where it does not apply (dropout on the adapter's input, which feeds the adapter another tensor than the base; an
# input not in the base's compute dtype; several active adapters; outside training), the fused update's forward runs.


class Nf4LoraFunction(torch.autograd.Function):
    """``base(x) + scaling * (x A^T) B^T`` for a 2-D ``x`` (NOTE [ One node per NF4 projection ])."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: Tensor, weight_a: Tensor, weight_b: Tensor, packed: Tensor, quant_state: Any,
        bias: Tensor | None, scaling: float,
    ) -> Tensor:  # fmt: skip
        """The fused update's ops: bitsandbytes' 4-bit matmul, ``x A^T``, and one ``addmm`` adding the update."""
        base = bnb.matmul_4bit(x, packed, quant_state=quant_state, bias=bias)
        product = torch.mm(x, weight_a.t())
        ctx.save_for_backward(x, product, weight_a, weight_b)
        ctx.packed, ctx.quant_state, ctx.scaling = packed.view(-1, 1), quant_state, scaling
        return torch.addmm(base, product, weight_b.t(), alpha=scaling)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        """The gradients of the three nodes, the input's two terms summed by the second GEMM (``addmm_``)."""
        x, product, weight_a, weight_b = ctx.saved_tensors
        grad = grad.contiguous()
        # What addmm's backward computes for its first operand and its second (``alpha`` times each product).
        grad_product = torch.mm(grad, weight_b) * ctx.scaling
        grad_b = torch.mm(grad.t(), product) * ctx.scaling if ctx.needs_input_grad[2] else None
        grad_a = torch.mm(grad_product.t(), x) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            weight = bnb_functional.dequantize_4bit(ctx.packed, ctx.quant_state).to(grad.dtype)
            grad_x = torch.mm(grad, weight).addmm_(grad_product, weight_a)
        return grad_x, grad_a, grad_b, None, None, None, None


def nf4_lora(x: Tensor, base_layer: Any, weight_a: Tensor, weight_b: Tensor, scaling: float) -> Tensor:
    """One NF4 projection and its LoRA update, the adapters cast to ``x``'s dtype (autocast's cast, made explicit).

    Runs outside autocast: every operand is in ``x``'s dtype already, and ``addmm`` must not be cast.

    Args:
        x: The projection's input, in the base's compute dtype (:func:`takes_one_node`), any leading shape.
        base_layer: bitsandbytes' ``Linear4bit``.
        weight_a: ``lora_A``'s weight, ``r x d_in``.
        weight_b: ``lora_B``'s weight, ``d_out x r``.
        scaling: The adapter's scaling.

    Returns:
        ``base_layer(x) + scaling * (x A^T) B^T``, shaped like the base layer's output.
    """
    bias = base_layer.bias
    if bias is not None:
        bias = bias.to(x.dtype)  # what Linear4bit passes (its bias in the compute dtype)
    weight_a, weight_b = weight_a.to(x.dtype), weight_b.to(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        out = Nf4LoraFunction.apply(
            x.reshape(-1, x.shape[-1]), weight_a, weight_b, base_layer.weight, base_layer.weight.quant_state, bias,
            scaling,
        )  # fmt: skip
    return out.view(*x.shape[:-1], out.shape[-1])


def takes_one_node(base_layer: Any, x: Tensor) -> bool:
    """Whether ``base_layer`` on input ``x`` runs as one node: a training ``Linear4bit`` computing in ``x``'s dtype.

    Replays the start of ``Linear4bit.forward`` first (bitsandbytes 0.50, pinned): its quant state recovered, and its
    compute dtype taken from the first input, so the decision does not depend on whether the layer ran before (the
    streamed forward pass runs a layer before its recompute does; resident training does not). Outside training
    bitsandbytes may repack the weight for its CPU inference kernel, so those calls keep its own forward.
    """
    if not isinstance(base_layer, bnb.nn.Linear4bit) or not base_layer.training:
        return False
    fix_4bit_weight_quant_state_from_module(base_layer)
    if not base_layer.compute_type_is_set:
        base_layer.set_compute_type(x)
        base_layer.compute_type_is_set = True
    return base_layer.compute_dtype == x.dtype


__all__ = ["Nf4LoraFunction", "nf4_lora", "takes_one_node"]
