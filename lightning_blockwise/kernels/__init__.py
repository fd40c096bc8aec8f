"""Faster layers as the module's choice: Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU (``liger.py``).

Like the long-context tools, a switch on the model that every strategy then trains, so blockwise == resident holds
for the module that turned it on.
"""

from lightning_blockwise.kernels.liger import (
    LIGER_MODEL_TYPES,
    liger_kernels_in,
    unuse_liger_kernels,
    use_liger_kernels,
)

__all__ = ["LIGER_MODEL_TYPES", "liger_kernels_in", "unuse_liger_kernels", "use_liger_kernels"]
