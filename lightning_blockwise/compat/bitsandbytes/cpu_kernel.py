"""bitsandbytes' CPU inference kernel: keeping 4-bit layers off it, and telling when a weight was repacked for it."""

from __future__ import annotations

from collections.abc import Mapping

from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Linear4bit
from torch import nn

# NOTE [ bitsandbytes CPU inference kernel ]
# On the CPU, bitsandbytes' `Linear4bit.forward` in eval mode, with an input that does not
# require grad and where the CPU has AVX512-BF16 (`support_avx512bf16_for_cpu`), repacks its
# weight in place and for good into the format of an inference-only kernel, and marks its
# quant state `packing_format_for_cpu`. Every later call, training included, then takes that
# kernel, which has no backward: gradients through the frozen base are lost, or with a bias
# (Qwen2's q/k/v) the forward raises "a view of a leaf Variable that requires grad is being
# used in an in-place operation". The repacked weight is a new tensor, which detaches the
# layer from the host arena, and a format bitsandbytes converts back on `.cuda()` or
# `state_dict()`, which packing it would freeze (`layout_block` refuses it). And a
# rematerialized forward runs without grad where the resident one does not, so an eval-mode
# layer would take another kernel than under `strategy="auto"`, and results would differ.
# Hence: models go to train mode right after loading (`from_pretrained` returns eval mode),
# the strategy refuses eval-mode 4-bit layers at the start of training, and
# `disable_cpu_repack` clears the flag for the whole run, so that validation's eval-mode,
# no-grad forwards stay on the generic, differentiable kernel. CUDA has no such switch.


def disable_cpu_repack(module: nn.Module) -> dict[Linear4bit, bool]:
    """Keep bitsandbytes from repacking the 4-bit weights in ``module`` for its CPU inference kernel.

    See NOTE [ bitsandbytes CPU inference kernel ].

    Args:
        module: A model, or any module holding ``Linear4bit`` layers (e.g. a decoder stack's ``layers``).

    Returns:
        Each layer's previous setting, for :func:`restore_cpu_repack`.
    """
    flags = {}
    for sub in module.modules():
        if isinstance(sub, Linear4bit):
            flags[sub] = sub.support_avx512bf16_for_cpu
            sub.support_avx512bf16_for_cpu = False
    return flags


def restore_cpu_repack(flags: Mapping[Linear4bit, bool]) -> None:
    """Undo :func:`disable_cpu_repack`."""
    for module, flag in flags.items():
        module.support_avx512bf16_for_cpu = flag


def is_repacked_for_cpu(state: QuantState) -> bool:
    """Whether bitsandbytes repacked the weight of ``state`` for its CPU inference kernel.

    See NOTE [ bitsandbytes CPU inference kernel ].
    """
    return bool(getattr(state, "packing_format_for_cpu", False))
