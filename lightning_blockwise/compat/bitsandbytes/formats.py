"""What an NF4 weight is stored as: its tensors' dtypes, shapes and bytes, predicted from the weight's size."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from bitsandbytes.nn import Params4bit
from torch import Tensor, nn

from lightning_blockwise.compat.bitsandbytes.config import DOUBLE_QUANT

# NOTE [ NF4 bytes ]
# bitsandbytes stores an NF4 weight of n elements as (with its default blocksize of 64 and
# `bnb_4bit_use_double_quant=True`): the packed weight, two 4-bit codes per byte, ceil(n / 2)
# uint8 of shape (ceil(n / 2), 1); one absmax per 64 elements, itself quantized to uint8
# (ceil(n / 64) bytes); the fp32 offset (the absmax mean, a scalar); and the nested absmax
# of those, one fp32 per 256 of them. Without double quantization the absmax are fp32 and
# there is no nested state. The 16-entry NF4 code table (fp32) and, with double
# quantization, the 256-entry nested code table (fp32) of every linear stay on the compute
# device (`move_code_tables`): they are not packed with the weight.
_NESTED_BLOCKSIZE = 256
_CODE_ENTRIES = 16
_NESTED_CODE_ENTRIES = 256


@dataclass(frozen=True)
class Nf4Format:
    """How bitsandbytes quantizes a weight to NF4 (NOTE [ NF4 bytes ]).

    Attributes:
        blocksize: Elements per absmax (bitsandbytes' default 64).
        double_quant: Whether the absmax are quantized again (``bnb_4bit_use_double_quant``).
    """

    blocksize: int = 64
    double_quant: bool = DOUBLE_QUANT

    def tensor_specs(self, numel: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name suffix, dtype, shape)`` of each tensor stored for a weight of ``numel`` elements, in slab order.

        The suffixes are those of :func:`~lightning_blockwise.compat.bitsandbytes.quant_state_tensors`,
        ``""`` for the packed weight itself.
        """
        blocks = -(-numel // self.blocksize)
        packed = ("", torch.uint8, (-(-numel // 2), 1))
        if not self.double_quant:
            return [packed, ("quant_state.absmax", torch.float32, (blocks,))]
        return [
            packed,
            ("quant_state.absmax", torch.uint8, (blocks,)),
            ("quant_state.offset", torch.float32, ()),
            ("quant_state.state2.absmax", torch.float32, (-(-blocks // _NESTED_BLOCKSIZE),)),
        ]


def nf4_tensor_bytes(numel: int, double_quant: bool = DOUBLE_QUANT, blocksize: int = 64) -> list[int]:
    """The bytes of each tensor bitsandbytes stores for one NF4 weight of ``numel`` elements, in slab order.

    Args:
        numel: Elements of the weight (``out_features * in_features``).
        double_quant: Whether the absmax are quantized again (``bnb_4bit_use_double_quant``).
        blocksize: Elements per absmax (bitsandbytes' default 64).

    Returns:
        ``[packed, absmax, offset, nested absmax]`` with double quantization, else ``[packed, absmax]``
        (see NOTE [ NF4 bytes ]).
    """
    specs = Nf4Format(blocksize, double_quant).tensor_specs(numel)
    return [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]


def pending_nf4(module: nn.Module, name: str, tensor: Tensor) -> Nf4Format | None:
    """The format a bitsandbytes weight not yet quantized (on the meta device, before loading) will take, else ``None``.

    Args:
        module: The module that holds the parameter.
        name: The parameter's name in ``module``.
        tensor: The parameter.
    """
    if isinstance(tensor, Params4bit) and tensor.is_meta and tensor.quant_state is None:
        return Nf4Format(tensor.blocksize, tensor.compress_statistics)
    return None


def code_table_bytes(double_quant: bool = DOUBLE_QUANT) -> int:
    """Bytes of the code tables one NF4 linear keeps on the compute device (NOTE [ NF4 bytes ])."""
    entries = _CODE_ENTRIES + (_NESTED_CODE_ENTRIES if double_quant else 0)
    return entries * torch.float32.itemsize
