"""A quantized weight's quant state: the tensors packed with the weight, the code tables left on the device.

See NOTE [ NF4 bytes ] in compat/bitsandbytes/formats.py for what each tensor holds.
"""

from __future__ import annotations

import torch
from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Params4bit
from torch import Tensor, nn


def quant_state_tensors(state: QuantState) -> list[tuple[object, str, str]]:
    """The tensors of a 4-bit weight's quant state that are packed with the weight, not the ``code`` tables.

    ``absmax`` and, with double quantization, the nested ``offset`` and ``state2.absmax``.

    Returns:
        ``(owner, attribute, name suffix)`` per tensor, in slab order: ``getattr(owner, attribute)`` is
        the tensor, and the suffix (``quant_state.absmax``, ...) follows the weight's name.
    """
    parts: list[tuple[object, str, str]] = [(state, "absmax", "quant_state.absmax")]
    if state.nested:
        parts += [(state, "offset", "quant_state.offset"), (state.state2, "absmax", "quant_state.state2.absmax")]
    return [(owner, attr, suffix) for owner, attr, suffix in parts if isinstance(getattr(owner, attr), Tensor)]


def move_code_tables(module: nn.Module, device: torch.device) -> None:
    """Move the code tables of every 4-bit weight in ``module`` to ``device``; nothing else moves."""
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if isinstance(weight, Params4bit) and weight.quant_state is not None:
            state = weight.quant_state
            state.code = state.code.to(device)
            if state.nested:
                state.state2.code = state.state2.code.to(device)


def move_to_host(weight: Params4bit) -> None:
    """Move a quantized weight and its quant state to the CPU, keeping the ``Params4bit`` and ``QuantState`` objects."""
    if weight.device.type == "cpu":
        return
    weight.data = weight.data.to("cpu")
    # `QuantState.to` moves absmax, code, offset and the nested state in place.
    weight.quant_state.to(torch.device("cpu"))
