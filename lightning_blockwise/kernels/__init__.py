"""Faster layers as the module's choice: Liger-Kernel's kernels (``liger.py``), LoRA's update fused (``fused_lora.py``).

Liger-Kernel brings Triton RMSNorm, RoPE and SwiGLU; the fused update adds each LoRA product inside its second matmul.

Like the long-context tools, switches on the model that every strategy then trains, so blockwise == resident holds
for the module that turned them on.
"""

from lightning_blockwise.kernels.fused_lora import fused_lora_in, unuse_fused_lora, use_fused_lora
from lightning_blockwise.kernels.liger import (
    LIGER_MODEL_TYPES,
    liger_kernels_in,
    unuse_liger_kernels,
    use_liger_kernels,
)

__all__ = [
    "LIGER_MODEL_TYPES",
    "fused_lora_in",
    "liger_kernels_in",
    "unuse_fused_lora",
    "unuse_liger_kernels",
    "use_fused_lora",
    "use_liger_kernels",
]
