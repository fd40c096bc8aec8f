"""How the module computes a step, as far as its memory goes: the loss, the MLPs, attention and Liger's kernels.

One object for the planner's signatures (``StepShape.for_config``, ``StepBudget``, ``ModelSizes``, ``recommend``):
the strategy reads it from the module it sets up (``strategy/module_budget.py``), ``plan`` from its flags.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class StepKernels:
    """How the module computes a training step, in what its activation memory depends on.

    Attributes:
        loss_chunk_tokens: Rows of logits the module's loss builds at a time
            (:func:`~lightning_blockwise.longcontext.loss.chunked_causal_lm_loss`); ``None``: all of them at once,
            as Hugging Face's loss does.
        mlp_tile_tokens: Tokens per tile of the decoder layers' MLPs
            (:func:`~lightning_blockwise.longcontext.tiling.tile_mlps`); ``None``: untiled.
        attention_tile_tokens: Queries per tile of the decoder layers' attention
            (:func:`~lightning_blockwise.longcontext.attention.tile_attention`); ``None``: untiled.
        fused_norm: The RMSNorms run Liger's kernel (``kernels/liger.py``), which keeps and makes no fp32 upcasts of
            its input (``StepShape.fused_norm``); ``False``: the model's own.
        fused_mlp: The MLPs compute their gated activation with a fused kernel that recomputes it in the backward
            (Liger's SwiGLU/GeGLU): a kept graph holds one MLP-sized tensor less (``StepShape.fused_mlp``);
            ``False``: the model's own.
    """

    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    attention_tile_tokens: int | None = None
    fused_norm: bool = False
    fused_mlp: bool = False

    def as_installed(self) -> StepKernels:
        """These kernels as ``CausalLMFineTune`` installs them: the fused gated activation on untiled MLPs only.

        The recipe installs Liger's SwiGLU only on untiled MLPs: with ``mlp_tile_tokens`` the tiles keep the MLP's
        own forward and Liger gives its RMSNorm and RoPE alone (``install_kernels(mlp_tiled=True)`` in
        recipes/kernel_choice.py), so a plan that chooses the tile drops the fused activation with it. What a
        plan from a config alone counts (``ModelSizes``, ``recommend``); the strategy reads what a module runs.
        """
        return replace(self, fused_mlp=self.fused_mlp and self.mlp_tile_tokens is None)


#: The step as a plain Hugging Face model computes it: its loss over all rows, untiled, its own layers (the default).
PLAIN_KERNELS = StepKernels()

__all__ = ["PLAIN_KERNELS", "StepKernels"]
