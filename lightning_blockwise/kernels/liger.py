"""Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU/GeGLU in one model instance's decoder, the module's choice.

Example::

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(...), LoraConfig(...))
    use_liger_kernels(model)  # the same under strategy="auto" and "blockwise"
"""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.kernels.forwards import (
    LigerAttentionForward,
    LigerForward,
    LigerMLPForward,
    LigerRMSNormForward,
    NormStyle,
)

# NOTE [ Liger kernels on one instance ]
# Liger's own `apply_liger_kernel_to_<arch>(model=...)` patches the instance AND the transformers
# modeling module: it replaces `modeling_llama.LlamaRMSNorm`, `LlamaMLP` and `apply_rotary_pos_emb`
# for the whole process (every Llama built or run afterwards computes with Liger's kernels, a
# reference model of a parity test included), and by default swaps the causal LM's forward for its
# fused linear cross-entropy. So we do not call it. We install Liger's autograd functions on the
# instance's modules only, as instance attributes (`module.forward = <callable>`), the classes and
# the modeling modules untouched (the house pattern of `tile_mlps`):
# - each RMSNorm of the decoder layers and the final norm: `LigerRMSNormFunction` with the
#   architecture's offset, casting mode and in-place choice (Liger's per-architecture settings);
# - each dense MLP: Liger's `LigerSwiGLUMLP.forward` (or Phi-3's fused gate-up, or Gemma's GeGLU)
#   called on the module, so PEFT's LoRA linears inside run as before;
# - each attention: the class's own forward, compiled again with `apply_rotary_pos_emb` resolved to
#   Liger's RoPE in a copy of the modeling module's globals (a copy taken at install), so the
#   modeling module's global is never written; decorators around the forward (transformers'
#   `deprecate_kwarg`) are rebuilt around the copy.
# Nothing is cached but the choice: the weights are read from the module at each call, so the
# blockwise strategy's streamed slots are what the kernels see. `unuse_liger_kernels` deletes the
# instance attributes and the class's forward is back, the exact function it was.
#
# The fused linear cross-entropy is left out on purpose: it changes the loss's rounding against the
# model's own loss and our chunked loss (longcontext/loss.py), which are the module's loss choices.
#
# NOTE [ Liger kernels and exactness ]
# The kernels change the rounding against the unpatched model (a fused SiLU*up, an RMSNorm that
# reduces in another order), so, like the chunked loss and the tiled MLP, they are the module's
# choice: installed on the module, they run under `strategy="auto"` and `"blockwise"` alike, and
# blockwise == resident holds for that module (tests/kernels/test_gpu_kernels.py). The replay captures the
# layer's call arguments; the kernels read the position embeddings and never write them, so the
# replayed forward sees what the first one saw. Liger's Triton kernels need CUDA: every installed
# forward refuses a tensor elsewhere at its first call, never falling back to the slow path in silence.

_INSTALL = 'pip install "lightning-blockwise[kernels]"'


_LLAMA_NORM = NormStyle(offset=0.0, casting_mode="llama", in_place=True)
# Gemma scales by (1 + weight) in fp32; Liger keeps its backward out of place for Gemma.
_GEMMA_NORM = NormStyle(offset=1.0, casting_mode="gemma", in_place=False)


@dataclass(frozen=True)
class _Architecture:
    """What the switch replaces in one architecture's decoder layers.

    Attributes:
        norms: Paths of the RMSNorms inside a decoder layer.
        norm_style: How they normalize.
        mlp: ``"swiglu"``, ``"phi3"`` (fused ``gate_up_proj``), ``"geglu"``, or ``None`` (an MoE's experts are
            left as they are).
        activations: The ``hidden_act``/``hidden_activation`` values the MLP kernel computes.
    """

    norms: tuple[str, ...]
    norm_style: NormStyle
    mlp: str | None
    activations: tuple[str, ...] = ("silu", "swish")


_PAIR = ("input_layernorm", "post_attention_layernorm")
_QK = ("self_attn.q_norm", "self_attn.k_norm")
_GEMMA_FOUR = (*_PAIR, "pre_feedforward_layernorm", "post_feedforward_layernorm")
_GELU_TANH = ("gelu_pytorch_tanh",)

_ARCHITECTURES: dict[str, _Architecture] = {
    "llama": _Architecture(_PAIR, _LLAMA_NORM, "swiglu"),
    "mistral": _Architecture(_PAIR, _LLAMA_NORM, "swiglu"),
    "qwen2": _Architecture(_PAIR, _LLAMA_NORM, "swiglu"),
    "qwen3": _Architecture((*_PAIR, *_QK), _LLAMA_NORM, "swiglu"),
    "qwen3_moe": _Architecture((*_PAIR, *_QK), _LLAMA_NORM, None),
    "phi3": _Architecture(_PAIR, _LLAMA_NORM, "phi3"),
    "gemma2": _Architecture(_GEMMA_FOUR, _GEMMA_NORM, "geglu", _GELU_TANH),
    "gemma3_text": _Architecture((*_GEMMA_FOUR, *_QK), _GEMMA_NORM, "geglu", _GELU_TANH),
}
# Gemma 3's multimodal checkpoints (configs/gemma-3-27b.yaml): the language model's layers are gemma3_text's.
_ARCHITECTURES["gemma3"] = _ARCHITECTURES["gemma3_text"]

#: ``config.model_type`` values :func:`use_liger_kernels` knows: the validated architectures
#: (``lightning_blockwise.architectures.VALIDATED_MODEL_TYPES``) Liger-Kernel supports, and Gemma 3's multimodal
#: ``gemma3`` (its language model). ``qwen3_moe``: RMSNorm and RoPE only (its experts keep their forward).
LIGER_MODEL_TYPES: frozenset[str] = frozenset(_ARCHITECTURES)


def _liger() -> types.SimpleNamespace:
    """Liger-Kernel's pieces the switch uses, imported on first use (an optional dependency)."""
    try:
        importlib.import_module("liger_kernel")
        ops = importlib.import_module("liger_kernel.ops")
        rope = importlib.import_module("liger_kernel.transformers.rope")
        swiglu = importlib.import_module("liger_kernel.transformers.swiglu")
        geglu = importlib.import_module("liger_kernel.transformers.geglu")
    except ImportError as error:
        raise MisconfigurationException(
            f"use_liger_kernels needs Liger-Kernel, which is not installed ({error}). Install it: `{_INSTALL}`."
        ) from None
    return types.SimpleNamespace(
        rms_norm=ops.LigerRMSNormFunction,
        rope=rope.liger_rotary_pos_emb,
        mlp_forwards={
            "swiglu": swiglu.LigerSwiGLUMLP.forward,
            "phi3": swiglu.LigerPhi3SwiGLUMLP.forward,
            "geglu": geglu.LigerGEGLUMLP.forward,
        },
    )


def require_liger() -> None:
    """Check that Liger-Kernel imports (before a model is built for it).

    Raises:
        MisconfigurationException: If it does not, naming the install command.
    """
    _liger()


def use_liger_kernels(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True) -> nn.Module:
    """Compute ``model``'s decoder with Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU (GeGLU on Gemma).

    Installed on this instance's modules only, never on the transformers classes or modeling modules, so no other
    model in the process changes (NOTE [ Liger kernels on one instance ]). Call it where the module builds its model,
    after PEFT's adapters or before (the kernels call the adapted linears as they find them), so that every strategy
    trains the same function: blockwise == resident holds for the patched module, which differs from the unpatched
    one in rounding (NOTE [ Liger kernels and exactness ]). Calling it again replaces what it installed with what
    the new call asks for. Liger's fused linear cross-entropy is not part of it: it would change the loss's rounding
    against the model's loss and ``chunked_causal_lm_loss``, the module's loss choices.

    Liger's kernels need CUDA: each installed forward refuses a tensor elsewhere at its first call.

    Args:
        model: A (PEFT-wrapped) Hugging Face causal LM of a type in :data:`LIGER_MODEL_TYPES`, or a module holding one.
        rms_norm: Liger's RMSNorm for every RMSNorm of the decoder layers and the final norm.
        rope: Liger's RoPE inside every attention.
        swiglu: Liger's fused SwiGLU (Gemma: GeGLU) in every dense MLP; it replaces the MLP's forward, so it
            refuses MLPs that :func:`~lightning_blockwise.longcontext.tiling.tile_mlps` tiled.

    Returns:
        ``model``.

    Raises:
        MisconfigurationException: If Liger-Kernel is not installed (naming ``pip install
            "lightning-blockwise[kernels]"``).
        ValueError: If the model type is not in :data:`LIGER_MODEL_TYPES`, the MLP's activation is not the one
            Liger's kernel computes, or a module already has another forward of its own (tiled MLPs, Liger's own
            monkey patch).

    Example::

        use_liger_kernels(model)
        Trainer(strategy="blockwise", precision="bf16-mixed").fit(module)
    """
    liger = _liger()
    stack = find_decoder_stack(model, allow_unvalidated=True)
    architecture = _ARCHITECTURES.get(stack.model_type)
    if architecture is None:
        raise ValueError(
            f"use_liger_kernels does not know model_type {stack.model_type!r}; it knows"
            f" {', '.join(sorted(LIGER_MODEL_TYPES))}."
        )
    names = {module: name for name, module in stack.model.named_modules()}
    plan: list[LigerForward] = []
    if rms_norm:
        final = getattr(stack.model.get_decoder(), "norm", None)
        norms = [layer.get_submodule(path) for layer in stack.layers for path in architecture.norms]
        for norm in [*norms, *([final] if final is not None else [])]:
            plan.append(LigerRMSNormForward(norm, names[norm], architecture.norm_style, liger.rms_norm))
    if rope:
        for layer in stack.layers:
            plan.append(LigerAttentionForward(layer.self_attn, names[layer.self_attn], liger.rope))
    if swiglu and architecture.mlp is not None:
        activation = _activation(stack.model.config)
        if activation not in architecture.activations:
            raise ValueError(
                f"use_liger_kernels(swiglu=True): {stack.model_type!r} with activation {activation!r} is not what"
                f" Liger's kernel computes ({', '.join(architecture.activations)}). Pass swiglu=False."
            )
        forward = liger.mlp_forwards[architecture.mlp]
        plan.extend(LigerMLPForward(layer.mlp, names[layer.mlp], forward) for layer in stack.layers)
    for installed in plan:
        _check_free(installed.module, installed.name)
    # Everything checked before anything changes: a refused call leaves the model as it was.
    unuse_liger_kernels(stack.model)
    for installed in plan:
        installed.module.forward = installed
    return model


def unuse_liger_kernels(model: nn.Module) -> int:
    """Give every module of ``model`` its class's forward back where :func:`use_liger_kernels` replaced it.

    Args:
        model: The model (or a module holding it); one without Liger's kernels is left as it is.

    Returns:
        How many forwards were restored.
    """
    restored = 0
    for module in model.modules():
        if isinstance(vars(module).get("forward"), LigerForward):
            del module.forward
            restored += 1
    return restored


def liger_kernels_in(model: nn.Module) -> dict[str, int]:
    """How many modules of ``model`` compute with each Liger kernel (``rms_norm``, ``rope``, ``mlp``)."""
    counts = {"rms_norm": 0, "rope": 0, "mlp": 0}
    for module in model.modules():
        installed = vars(module).get("forward")
        if isinstance(installed, LigerForward):
            counts[installed.kernel] += 1
    return counts


def _check_free(module: nn.Module, name: str) -> None:
    """Refuse a module whose forward someone else already replaced on the instance (tiled MLPs, Liger's patch)."""
    own = vars(module).get("forward")
    if own is None or isinstance(own, LigerForward):
        return
    kind = type(own).__name__
    fix = (
        "tile_mlps replaced it: pass use_liger_kernels(swiglu=False) to keep the tiled MLPs (or untile them)"
        if kind == "TiledMLP"
        else "take that patch off first (Liger's own apply_liger_kernel_to_* is refused: it patches the process)"
    )
    raise ValueError(f"use_liger_kernels: `{name}` already has a forward of its own ({kind}); {fix}.")


def _activation(config: Any) -> str | None:
    # A multimodal config keeps it in its text config; Gemma names it `hidden_activation`, the others `hidden_act`.
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", None)


__all__ = [
    "LIGER_MODEL_TYPES",
    "liger_kernels_in",
    "require_liger",
    "unuse_liger_kernels",
    "use_liger_kernels",
]
