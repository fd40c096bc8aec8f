"""``CausalLMFineTune(kernels=...)``: which faster layers the recipe installs on its model, checked before it loads."""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise.kernels.fused_lora import use_fused_lora
from lightning_blockwise.kernels.liger import require_liger, use_liger_kernels

#: The names ``kernels`` takes: Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU (CUDA), and the fused LoRA update
#: (any device; kernels/fused_lora.py).
KERNELS = ("liger", "fused_lora")


def kernel_choice(kernels: str | Sequence[str] | None, mlp_tile_tokens: int | None, use_dora: bool) -> frozenset[str]:
    """The set of kernels ``kernels`` names, refused when unknown, clashing, or missing its library.

    Raises:
        MisconfigurationException: If a name is not in :data:`KERNELS`, ``"liger"`` comes with ``mlp_tile_tokens``
            (both replace the MLPs' forward) or without Liger-Kernel installed, or ``"fused_lora"`` with DoRA.
    """
    if kernels is None:
        return frozenset()
    names = [kernels] if isinstance(kernels, str) else list(kernels)
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels={kernels!r}): {', '.join(map(repr, unknown))} is not a kernel choice; choose"
            f" from {', '.join(map(repr, KERNELS))} (one, a list of them, or None)."
        )
    choice = frozenset(names)
    if "liger" in choice and mlp_tile_tokens is not None:
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels={kernels!r}, mlp_tile_tokens={mlp_tile_tokens}): Liger's fused SwiGLU and the"
            " tiled MLP both replace the MLPs' forward, so they are not combined. Keep one: drop 'liger' for long"
            " context, or `mlp_tile_tokens=None`."
        )
    if "fused_lora" in choice and use_dora:
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels={kernels!r}, use_dora=True): the fused LoRA update computes plain LoRA only;"
            " drop 'fused_lora' for DoRA adapters."
        )
    if "liger" in choice:
        require_liger()
    return choice


def check_device(choice: frozenset[str], device_type: str | None) -> None:
    """Refuse Liger's kernels on a device other than CUDA, before the base loads.

    Raises:
        MisconfigurationException: If ``"liger"`` is chosen and the Trainer trains on another device.
    """
    if "liger" in choice and device_type is not None and device_type != "cuda":
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels='liger') needs a CUDA device (Liger-Kernel's Triton kernels), but the"
            f" Trainer trains on {device_type}. Drop 'liger' from `kernels` (YAML: `kernels: null`) or train on a GPU."
        )


def install_kernels(model: nn.Module, choice: frozenset[str]) -> None:
    """Install the chosen kernels on ``model`` (after its adapters), under every strategy alike.

    Like the tiled MLP, they change the rounding, so blockwise and resident runs must train the same function
    (NOTE [ Liger kernels and exactness ] in kernels/liger.py, NOTE [ Fused LoRA update ] in kernels/fused_lora.py).
    """
    if "liger" in choice:
        # The kernels call the adapted linears as they find them (fused or PEFT's).
        use_liger_kernels(model)
    if "fused_lora" in choice:
        use_fused_lora(model)


__all__ = ["KERNELS", "check_device", "install_kernels", "kernel_choice"]
