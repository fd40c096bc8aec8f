"""The forwards :func:`~lightning_blockwise.kernels.liger.use_liger_kernels` installs on a model's modules.

Each is an instance attribute (``module.forward = <LigerForward>``), the class untouched: NOTE [ Liger kernels on one
instance ] in liger.py.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn


@dataclass(frozen=True)
class NormStyle:
    """How Liger's RMSNorm matches an architecture's (Liger's per-architecture settings)."""

    offset: float
    casting_mode: str
    in_place: bool


def _on_cuda(tensor: Tensor, where: str) -> None:
    if tensor.device.type != "cuda":
        raise MisconfigurationException(
            f"use_liger_kernels: `{where}` got a tensor on {tensor.device}, but Liger-Kernel's Triton kernels run on"
            " CUDA only (they do not fall back to the slow path). Train on a GPU, or take the kernels off:"
            " `unuse_liger_kernels(model)` (`CausalLMFineTune(kernels=None)`)."
        )


class LigerForward:
    """A Liger forward installed on one module (an instance attribute; the class is untouched).

    Attributes:
        module: The module it computes for.
        kernel: ``"rms_norm"``, ``"rope"`` or ``"mlp"``.
        name: The module's qualified name in the model (for errors).
    """

    kernel = ""

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name


class LigerRMSNormForward(LigerForward):
    """``LigerRMSNormFunction`` on the norm's own weight and epsilon."""

    kernel = "rms_norm"

    def __init__(self, module: nn.Module, name: str, style: NormStyle, function: Any) -> None:
        super().__init__(module, name)
        eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", None)
        if eps is None or getattr(module, "weight", None) is None:
            raise ValueError(f"`{name}` ({type(module).__name__}) has no weight and epsilon for Liger's RMSNorm.")
        self.eps = float(eps)
        self.style = style
        self._function = function

    def __call__(self, hidden: Tensor) -> Tensor:
        """The normalized ``hidden``, through Liger's Triton RMSNorm."""
        _on_cuda(hidden, self.name)
        style = self.style
        # The weight is read at each call: the blockwise strategy binds it to a streamed slot.
        return self._function.apply(
            hidden, self.module.weight, self.eps, style.offset, style.casting_mode, style.in_place, None
        )


class LigerMLPForward(LigerForward):
    """Liger's MLP forward (SwiGLU, Phi-3's fused SwiGLU or GeGLU) called on the module, its linears as they are."""

    kernel = "mlp"

    def __init__(self, module: nn.Module, name: str, forward: Callable[[nn.Module, Tensor], Tensor]) -> None:
        super().__init__(module, name)
        self._forward = forward

    def __call__(self, hidden: Tensor) -> Tensor:
        """The MLP of ``hidden`` with Liger's fused activation."""
        _on_cuda(hidden, self.name)
        return self._forward(self.module, hidden)


class LigerAttentionForward(LigerForward):
    """The attention class's forward, compiled again with Liger's RoPE (NOTE [ Liger kernels on one instance ])."""

    kernel = "rope"

    def __init__(self, module: nn.Module, name: str, rope: Callable[..., tuple[Tensor, Tensor]]) -> None:
        super().__init__(module, name)

        def liger_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> tuple[Tensor, Tensor]:
            # transformers' signature, mapped onto Liger's (which takes `position_ids` fifth).
            _on_cuda(q, name)
            return rope(q, k, cos, sin, None, unsqueeze_dim)

        self._forward = _with_global(type(module).forward, "apply_rotary_pos_emb", liger_rope, type(module).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The attention of the call's arguments, with Liger's RoPE."""
        return self._forward(self.module, *args, **kwargs)


def _with_global(function: Callable[..., Any], name: str, value: Any, owner: str) -> Callable[..., Any]:
    """``function`` (through its ``functools.wraps`` decorators) with the global ``name`` resolved to ``value``.

    Raises:
        ValueError: If the innermost function does not read the global ``name`` (nothing would change), or a
            decorator does not hold the function it wraps in its closure.
    """
    inner = getattr(function, "__wrapped__", None)
    if inner is None:
        if not isinstance(function, types.FunctionType) or name not in function.__code__.co_names:
            raise ValueError(f"`{owner}.forward` does not call `{name}`: Liger's RoPE cannot be put in its place.")
        namespace = {**function.__globals__, name: value}
        copy = types.FunctionType(function.__code__, namespace, function.__name__, function.__defaults__)
    else:
        rebuilt = _with_global(inner, name, value, owner)
        cells = function.__closure__ or ()
        if not any(cell.cell_contents is inner for cell in cells):
            raise ValueError(f"A decorator of `{owner}.forward` does not keep the function it wraps in its closure.")
        closure = tuple(types.CellType(rebuilt) if cell.cell_contents is inner else cell for cell in cells)
        copy = types.FunctionType(
            function.__code__, function.__globals__, function.__name__, function.__defaults__, closure
        )
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__qualname__ = function.__qualname__
    if inner is not None:
        copy.__wrapped__ = rebuilt  # type: ignore[attr-defined]
    return copy


__all__ = [
    "LigerAttentionForward",
    "LigerForward",
    "LigerMLPForward",
    "LigerRMSNormForward",
    "NormStyle",
]
