"""bitsandbytes' 8-bit AdamW (plain and paged): what it stores, where it falls back, what a checkpoint holds of it.

Example::

    optimizer = adamw_8bit(adapter_params, lr=2e-4, weight_decay=0.0, paged=False)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from bitsandbytes.optim import AdamW8bit, PagedAdamW8bit
from torch import nn

#: bitsandbytes' default ``min_8bit_size``: a parameter with fewer elements keeps fp32 moments (NOTE [ 8-bit AdamW ]).
MIN_8BIT_SIZE = 4096

#: Bytes per parameter of AdamW's two moments: fp32 (torch), and 8-bit with an fp32 absmax per 256 values.
MOMENT_BYTES_FP32 = 2 * 4
MOMENT_BYTES_8BIT = 2 * (1 + 4 / 256)

# NOTE [ 8-bit AdamW ]
# `bnb.optim.AdamW8bit` keeps each moment (exp_avg, exp_avg_sq) as uint8 codes into a 256-entry
# dynamic map (`state1`, `state2`, `qmap1`, `qmap2`) with one fp32 absmax per block of 256 values
# (`absmax1`, `absmax2`): ~2.03 bytes per parameter for both moments against AdamW's 8. Parameters
# with fewer than `min_8bit_size` (4096) elements keep fp32 moments, as bitsandbytes' authors
# chose (their quantization error matters most there); a LoRA A or B of rank 16 on a 3584-wide
# projection has 57k elements, so at real shapes every adapter matrix is 8-bit, and only tiny test
# shapes keep fp32 state. The update is deterministic given the gradients and runs on the CPU too
# (bitsandbytes 0.50), so blockwise == resident holds with it as with torch's AdamW.
# `PagedAdamW8bit` allocates the same state in CUDA unified memory, which the driver pages to host
# RAM when the GPU runs short; on the CPU bitsandbytes warns and falls back to ordinary memory (the
# same numbers). `state_dict` wraps the 8-bit tensors under `__bnb_optimizer_quant_state__` in each
# parameter's state and `load_state_dict` unwraps them without casting them to the parameter's
# dtype, so Lightning checkpoints (lean ones included) hold the uint8 codes and absmaxes as they are.


def adamw_8bit(params: Iterable[nn.Parameter], lr: float, weight_decay: float, paged: bool) -> torch.optim.Optimizer:
    """The 8-bit AdamW of bitsandbytes over ``params`` (NOTE [ 8-bit AdamW ]); ``paged``: its paged variant.

    Args:
        params: The parameters to train.
        lr: Learning rate.
        weight_decay: Decoupled weight decay, as ``torch.optim.AdamW``'s.
        paged: ``PagedAdamW8bit`` (state in CUDA unified memory) instead of ``AdamW8bit``.

    Returns:
        The optimizer, with bitsandbytes' defaults otherwise (betas, eps, ``min_8bit_size``).
    """
    optimizer_class = PagedAdamW8bit if paged else AdamW8bit
    return optimizer_class(list(params), lr=lr, weight_decay=weight_decay, min_8bit_size=MIN_8BIT_SIZE)


__all__ = ["MIN_8BIT_SIZE", "MOMENT_BYTES_8BIT", "MOMENT_BYTES_FP32", "adamw_8bit"]
