"""``CausalLMFineTune(kernels=...)``: which faster layers the recipe installs on its model, checked before it loads."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.kernels.fused_lora import lora_variants_in, use_fused_lora
from lightning_blockwise.kernels.liger import LIGER_MODEL_TYPES, require_liger, use_liger_kernels

#: The names ``kernels`` takes: Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU (CUDA), and the fused LoRA update
#: (any device; kernels/fused_lora.py).
KERNELS = ("liger", "fused_lora")
#: ``kernels="auto"`` (the recipe's default): every kernel that applies, decided when the model is built.
AUTO = "auto"


def kernel_choice(
    kernels: str | Sequence[str] | None, mlp_tile_tokens: int | None, use_dora: bool
) -> frozenset[str] | None:
    """The set of kernels ``kernels`` names (``None`` for ``"auto"``), refused when unknown, clashing, or missing.

    With ``mlp_tile_tokens``, ``"liger"`` means Liger's RMSNorm and RoPE: the tiled MLPs keep their forward
    (:func:`install_kernels`).

    Raises:
        MisconfigurationException: If a name is not in :data:`KERNELS`, ``"liger"`` comes without Liger-Kernel
            installed, or ``"fused_lora"`` with DoRA.
    """
    if kernels == AUTO:
        return None
    if kernels is None:
        return frozenset()
    names = [kernels] if isinstance(kernels, str) else list(kernels)
    unknown = [name for name in names if name not in KERNELS]
    if unknown:
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels={kernels!r}): {', '.join(map(repr, unknown))} is not a kernel choice; choose"
            f" 'auto', None, or from {', '.join(map(repr, KERNELS))} (one or a list)."
        )
    choice = frozenset(names)
    if "fused_lora" in choice and use_dora:
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels={kernels!r}, use_dora=True): the fused LoRA update computes plain LoRA only;"
            " drop 'fused_lora' for DoRA adapters."
        )
    if "liger" in choice:
        require_liger()
    return choice


def check_fused_lora_adapter(choice: frozenset[str] | None, adapter_path: str) -> None:
    """Refuse ``"fused_lora"``, asked for by name, for a DoRA adapter directory, before the base loads.

    Raises:
        MisconfigurationException: If the adapter's ``adapter_config.json`` says ``use_dora``.
    """
    if choice is None or "fused_lora" not in choice:
        return
    config = json.loads((Path(adapter_path) / "adapter_config.json").read_text())
    if config.get("use_dora"):
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels={sorted(choice)!r}, adapter_path={adapter_path!r}): the adapter is DoRA"
            " (its adapter_config.json says use_dora), and the fused LoRA update computes plain LoRA only. Drop"
            " 'fused_lora' (or use kernels='auto', which leaves DoRA on PEFT's forward)."
        )


def check_kernels_device(choice: frozenset[str] | None, device_type: str | None) -> None:
    """Refuse Liger's kernels, asked for by name, on a device other than CUDA, before the base loads.

    Raises:
        MisconfigurationException: If ``"liger"`` is chosen and the Trainer trains on another device.
    """
    if choice is not None and "liger" in choice and device_type is not None and device_type != "cuda":
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels='liger') needs a CUDA device (Liger-Kernel's Triton kernels), but the"
            f" Trainer trains on {device_type}. Drop 'liger' from `kernels` (YAML: `kernels: null`) or train on a GPU."
        )


def resolve_auto(model: nn.Module, device_type: str | None, mlp_tile_tokens: int | None) -> frozenset[str]:
    """What ``kernels="auto"`` installs on ``model`` (after its adapters), and a log line saying what and why.

    The fused LoRA update wherever the adapters are plain LoRA; Liger-Kernel's where it is installed, the Trainer
    trains on CUDA and the architecture is one Liger knows (with tiled MLPs its RMSNorm and RoPE only: the long
    context where its RMSNorm, keeping no fp32 copies, saves the most memory). Each changes the rounding against
    the model's and PEFT's own layers, under every strategy alike (NOTE [ Liger kernels and exactness ] in
    kernels/liger.py): decided here once, so a resident and a blockwise run of the module train the same function.
    """
    choice, reasons = set(), []
    variants = lora_variants_in(model)
    if variants:
        reasons.append(f"no fused LoRA update ({variants} adapters)")
    else:
        choice.add("fused_lora")
    liger_missing = importlib.util.find_spec("liger_kernel") is None
    model_type = find_decoder_stack(model, allow_unvalidated=True).model_type
    if liger_missing:
        reasons.append('no Liger-Kernel: not installed (`pip install "lightning-blockwise[kernels]"`)')
    elif device_type != "cuda":
        reasons.append(f"no Liger-Kernel: its kernels need CUDA, the Trainer trains on {device_type}")
    elif model_type not in LIGER_MODEL_TYPES:
        reasons.append(f"no Liger-Kernel: it does not know model_type {model_type!r}")
    else:
        choice.add("liger")
        if mlp_tile_tokens is not None:
            reasons.append("Liger's RMSNorm and RoPE, not its SwiGLU: the MLPs are tiled (mlp_tile_tokens)")
    chosen = " and ".join(sorted(choice)) or "none"
    rank_zero_info(f"CausalLMFineTune(kernels='auto'): {chosen}" + (f"; {'; '.join(reasons)}" if reasons else ""))
    return frozenset(choice)


def install_kernels(model: nn.Module, choice: frozenset[str], mlp_tiled: bool = False) -> None:
    """Install the chosen kernels on ``model`` (after its adapters), under every strategy alike.

    Like the tiled MLP, they change the rounding, so blockwise and resident runs must train the same function
    (NOTE [ Liger kernels and exactness ] in kernels/liger.py, NOTE [ Fused LoRA update ] in kernels/fused_lora.py).

    Args:
        model: The PEFT model.
        choice: The kernels' names (:data:`KERNELS`).
        mlp_tiled: The MLPs are to be tiled (``tile_mlps``, after this): Liger's SwiGLU is left out, its RMSNorm and
            RoPE installed.
    """
    if "liger" in choice:
        # The kernels call the adapted linears as they find them (fused or PEFT's).
        use_liger_kernels(model, swiglu=not mlp_tiled)
    if "fused_lora" in choice:
        use_fused_lora(model)


def check_resumed_kernels(saved: list[str] | None, installed: list[str] | None, given: Any) -> None:
    """Refuse a resume whose ``kernels="auto"`` chose other kernels than the checkpoint's run computed with.

    ``"auto"`` depends on the machine (Liger-Kernel installed, CUDA): resuming elsewhere would train another function
    from the restored state, not the run's. An explicit ``kernels`` is the user's choice and only warned about.

    Args:
        saved: The kernels the checkpoint records (``None``: it records none).
        installed: The kernels this model computes with (``None``: not built yet).
        given: ``CausalLMFineTune(kernels=...)`` as given (``"auto"`` chose them on this machine).

    Raises:
        MisconfigurationException: Naming both choices and the ``kernels`` to pass.
    """
    if saved is None or installed is None or saved == installed:
        return
    what = f"this run was trained with kernels {saved} and this model computes with {installed}"
    if given == AUTO:
        raise MisconfigurationException(
            f"CausalLMFineTune(kernels='auto'): {what}, so the resumed run would not continue the same function."
            f" Pass `kernels={saved}` (YAML: `kernels: {saved}`; with 'liger': on CUDA, with"
            ' `pip install "lightning-blockwise[kernels]"`) to resume it exactly.'
        )
    rank_zero_warn(f"CausalLMFineTune(kernels={given!r}): {what}, as asked.")


__all__ = [
    "AUTO",
    "KERNELS",
    "check_fused_lora_adapter",
    "check_kernels_device",
    "check_resumed_kernels",
    "install_kernels",
    "kernel_choice",
    "resolve_auto",
]
