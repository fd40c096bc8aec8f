"""``lightning-blockwise plan --kernels``: the layers the plan counts, as the choice and this machine decide."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

#: ``--kernels``: the layers the plan counts (NOTE [ The kernels plan counts ]).
KERNEL_CHOICES = ("auto", "liger", "none")
#: The types of :data:`~lightning_blockwise.kernels.liger.LIGER_MODEL_TYPES` whose MLPs Liger leaves alone (an MoE's
#: experts keep their forward; kernels/liger.py's architecture table): RMSNorm and RoPE only.
_LIGER_WITHOUT_MLP = frozenset({"qwen3_moe"})

# NOTE [ The kernels plan counts ]
# `CausalLMFineTune(kernels="auto")`, the recipe's default, installs Liger-Kernel's RMSNorm and RoPE
# on CUDA where Liger-Kernel is installed and knows the architecture, and its SwiGLU too where the
# MLPs are untiled (recipes/kernel_choice.py). Liger's RMSNorm keeps no fp32 upcasts, which at long
# context is most of a layer's backward peak (NOTE [ A layer's backward peak ] in
# planning/activation_constants.py), so a plan without it answers for a run users do not get. `--kernels auto`
# models what the recipe's default takes on a CUDA card: Liger's kernels where `liger_kernel` imports
# on the machine that plans (plan does not see the training machine: where it differs, name the
# choice), `liger` models them whatever is installed, `none` the model's own layers (the answers of
# plan before this option, byte for byte). Architectures Liger does not know get their own layers in
# every case. The fused LoRA update the default also takes is not counted: the measured points do not
# tell it apart (step_shape.py).


@dataclass(frozen=True)
class ModelledKernels:
    """The layers ``plan`` counts, as ``--kernels`` and this machine decide (NOTE [ The kernels plan counts ]).

    Attributes:
        liger: Liger's RMSNorm and RoPE are counted (``StepShape.fused_norm``).
        fused_mlp: Liger's SwiGLU (GeGLU on Gemma) is counted where the MLPs are untiled (``StepShape.fused_mlp``).
        reason: What is counted and why, one line for the report.
    """

    liger: bool
    fused_mlp: bool
    reason: str


def modelled_kernels(choice: str, model_type: str, mlp_tiled: bool = False) -> ModelledKernels:
    """What ``--kernels choice`` counts for a model of ``model_type`` (NOTE [ The kernels plan counts ]).

    Args:
        choice: One of :data:`KERNEL_CHOICES`.
        model_type: The config's ``model_type``.
        mlp_tiled: ``--mlp-tile-tokens`` is given: every MLP is tiled, so Liger's SwiGLU is never installed.

    Raises:
        ValueError: If ``choice`` is not one of :data:`KERNEL_CHOICES`.
    """
    from lightning_blockwise.kernels.liger import LIGER_MODEL_TYPES  # imports torch: not for `plan --help`

    if choice not in KERNEL_CHOICES:
        raise ValueError(f"kernels={choice!r} is not a choice; choose one of {', '.join(KERNEL_CHOICES)}.")
    own = "the model's own RMSNorm, RoPE and MLP"
    if choice == "none":
        return ModelledKernels(False, False, f"{own} (--kernels none)")
    if model_type not in LIGER_MODEL_TYPES:
        return ModelledKernels(False, False, f"{own}: Liger-Kernel does not know model_type {model_type!r}")
    if choice == "auto" and importlib.util.find_spec("liger_kernel") is None:
        return ModelledKernels(
            False,
            False,
            f"{own} (--kernels auto: Liger-Kernel is not installed here; --kernels liger plans for a machine"
            " that has it)",
        )
    fused_mlp = model_type not in _LIGER_WITHOUT_MLP and not mlp_tiled
    what = "Liger-Kernel's RMSNorm and RoPE" + (", and its SwiGLU where the MLPs are untiled" if fused_mlp else "")
    why = (
        "--kernels liger"
        if choice == "liger"
        else "--kernels auto: Liger-Kernel is installed here, and CausalLMFineTune(kernels='auto') takes it on CUDA;"
        " --kernels none plans without"
    )
    return ModelledKernels(True, fused_mlp, f"{what} ({why})")


__all__ = ["KERNEL_CHOICES", "ModelledKernels", "modelled_kernels"]
