"""DoRA's row norm ``||W + s B A||_row`` from factors, never the dense ``B A`` product (arXiv 2603.22276)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from peft.tuners.lora.dora import DoraLinearLayer
from peft.utils.integrations import dequantize_module_weight
from peft.utils.other import transpose
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

# NOTE [ Factored DoRA norm ]
# PEFT 0.21's DoRA forward (``DoraLinearLayer.forward``) forms the dense ``B A`` (``d_out x d_in``, whatever the
# rank) and takes ``||W + s B A||`` row by row, detached. Its square splits into
#   base  ||W||_row^2                         fixed for a frozen W: computed once, kept as a d_out fp32 vector,
#   cross 2 s rowsum(B * (W A^T))             one d_out x r product with the dequantized W,
#   gram  s^2 rowsum((B (A A^T)) * B)         O(d_out r + r^2),
# so the widest intermediate is d_out x r. W is only readable while its block is resident under blockwise
# (NOTE [ Graphs do not outlive residency ]), so the base term is taken where PEFT dequantizes W, inside the
# forward, on the first call; the cross term is formed there on every call. Nothing of W outlives the call.
#
# Numerics. The three terms are summed in fp32 (W A^T in W's dtype, then fp32) and clamped at 0 before the sqrt:
# the sum can round below 0 only where the true norm is ~0, and there PEFT's dense norm is 0 too. For magnitudes
# near 1 (the magnitude starts equal to the norm, so m/n starts at 1 and stays near it), PEFT's ``m/n - 1``
# cancels: its absolute error is an ulp of 1 (2^-24 in fp32, 2^-9 in bf16), whole as a fraction of a small
# m/n - 1. ``(m - n)/n`` has no such loss: m - n is exact when m and n are within a factor of 2 of each other
# (Sterbenz), and only the division rounds. The gradient to m is 1/n either way; the norm stays detached, as in
# PEFT (DoRA section 4.3). So the factored module differs from PEFT's by rounding (docs/dora-norm.md has the
# measured deviation); it is the module's choice, applied under every strategy, and blockwise == resident holds
# for it.

# NOTE [ The cached base norm follows the base ]
# ``||W||_row^2`` is kept because W is frozen, but frozen is not constant: a full-state checkpoint of another base
# loaded into the module (`BlockwiseStrategy(save_frozen_base=True)` writes its decoder tensors into the host copy,
# then loads the rest with `load_state_dict`), or a weight copied in place, changes W under the cache, and the
# norm of the old base would rescale every row of the new one. So the cache is dropped (1) by a load-state-dict
# post-hook on the base layer, which every `load_state_dict` that reaches the base runs (whichever of its tensors
# the state dict holds, and whether they were written into the module or, under blockwise, into the host copy),
# and (2) when the base weight is another object or its version counter moved (an in-place `copy_`). Streaming
# rebinds a weight's data (`param.data = view`), which moves neither, so the cache survives the blocks' refills.
# Dropping it costs one norm of W at the next forward and gives the same bits while W is unchanged.


class FactoredDoraNorm:
    """The forward installed on one ``DoraLinearLayer`` (an instance attribute; the class is untouched).

    Args:
        layer: The DoRA layer (its ``weight`` is the magnitude vector).
        base_layer: The frozen linear it scales; its loads drop the cached base norm
            (NOTE [ The cached base norm follows the base ]). ``None``: only a new or changed weight does.
    """

    def __init__(self, layer: DoraLinearLayer, base_layer: nn.Module | None = None) -> None:
        self.layer = layer
        #: ``||W||_row^2`` (fp32, ``d_out``) of the frozen base, on the magnitude's device; ``None`` until the
        #: first forward reads W, and again after the base changed.
        self.base_sq: Tensor | None = None
        # The base weight `base_sq` was taken from, and its version counter then.
        self._source: tuple[weakref.ref[Tensor], int] | None = None
        self._load_hook: RemovableHandle | None = None
        if base_layer is not None:
            self._load_hook = base_layer.register_load_state_dict_post_hook(self._base_loaded)

    def __call__(
        self,
        x: Tensor,
        *,
        lora_A: nn.Module,
        lora_B: nn.Module,
        scaling: float,
        base_layer: nn.Module,
        base_result: Tensor | None = None,
        adapter_name: str = "default",
    ) -> Tensor:
        """PEFT's DoRA output on top of the base output, the row norm from factors (NOTE [ Factored DoRA norm ])."""
        magnitude = self.layer.weight
        self._follow(base_layer.weight)
        weight = dequantize_module_weight(base_layer).to(x.dtype)
        weight_norm = self.norm(transpose(weight, self.layer.fan_in_fan_out), lora_A.weight, lora_B.weight, scaling)
        weight_norm = weight_norm.to(x.dtype)
        mag_norm_scale = (magnitude / weight_norm).view(1, -1)
        scale_minus_one = ((magnitude - weight_norm) / weight_norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            bias = base_layer.bias
            if bias is not None:
                base_result = base_result - bias
        else:
            base_result = F.linear(x, transpose(weight, self.layer.fan_in_fan_out))
        return scale_minus_one * base_result + mag_norm_scale * lora_result * scaling

    def norm(self, weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
        """``||W + s B A||_row`` (fp32, detached) of ``weight`` (``d_out x d_in``), ``lora_a`` (A), ``lora_b`` (B)."""
        with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
            if self.base_sq is None:
                base_sq = torch.linalg.vector_norm(weight, dim=1, dtype=torch.float32).square()
                self.base_sq = base_sq.to(self.layer.weight.device)
            a = lora_a.detach()
            b = lora_b.detach().float()
            cross = (b * (weight @ a.to(weight.dtype).T).float()).sum(dim=1)
            a = a.float()
            gram = ((b @ (a @ a.T)) * b).sum(dim=1)
            squared = self.base_sq.to(weight.device) + 2 * scaling * cross + scaling**2 * gram
            return squared.clamp_min(0).sqrt()

    def remove(self) -> None:
        """Remove the load hook from the base layer (when the layer gets PEFT's dense norm back)."""
        if self._load_hook is not None:
            self._load_hook.remove()
            self._load_hook = None

    def _follow(self, weight: Tensor) -> None:
        """Drop the cached base norm if ``weight`` is not the tensor, or not the version, it was taken from."""
        source = self._source
        if source is None or source[0]() is not weight or source[1] != weight._version:
            self.base_sq = None
            self._source = (weakref.ref(weight), weight._version)

    def _base_loaded(self, module: nn.Module, incompatible_keys: Any) -> None:
        # NOTE [ The cached base norm follows the base ]: a load may have written W without touching the module.
        self.base_sq = None
        self._source = None


def factor_dora_norms(model: nn.Module) -> int:
    """Compute every PEFT DoRA linear module's row norm from factors (NOTE [ Factored DoRA norm ]).

    Call it where the module builds its model, after the adapters are added, so that every strategy trains the
    same function. Installing twice is safe; :func:`unfactor` undoes it for one layer.

    Args:
        model: A PEFT model (or a module holding one) with DoRA adapters (``LoraConfig(use_dora=True)``).

    Returns:
        How many DoRA linear modules now use the factored norm (0 if the model has none).

    Example:
        >>> model = get_peft_model(base, LoraConfig(r=256, use_dora=True))  # doctest: +SKIP
        >>> factor_dora_norms(model)  # doctest: +SKIP
    """
    count = 0
    for lora in model.modules():
        magnitudes = getattr(lora, "lora_magnitude_vector", None)
        if not isinstance(magnitudes, nn.ModuleDict):
            continue
        for layer in magnitudes.values():
            if type(layer) is DoraLinearLayer:
                unfactor(layer)
                layer.forward = FactoredDoraNorm(layer, lora.get_base_layer())
                count += 1
    return count


def unfactor(layer: nn.Module) -> None:
    """Give a DoRA layer PEFT's dense norm back (no-op if it is not factored)."""
    factored = vars(layer).get("forward")
    if isinstance(factored, FactoredDoraNorm):
        factored.remove()
        del layer.forward


__all__ = ["FactoredDoraNorm", "factor_dora_norms", "unfactor"]
