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
#
# A user's own `strategy="auto"` run, the reference blockwise is compared against, has no such
# guard: one validation pass (the sanity check included) or `generate` repacks every layer it
# reaches, and each later training step computes another function (another loss, other
# gradients) or raises. `keep_4bit_trainable_on_cpu` is that guard as one public call. It is
# not made automatic on `import lightning_blockwise`: the flag is set per layer when the layer
# is built, so an import-time switch would have to patch bitsandbytes globally (its
# `has_avx512bf16` or `Linear4bit.forward`), changing the inference speed of every other 4-bit
# model in the process, ours or not, and missing layers built before the import. And the
# repacking cannot be undone exactly (bitsandbytes' inverse rounds the absmax through bf16 and
# quantizes it again), so the call refuses a model that is already repacked.


def keep_4bit_trainable_on_cpu(model: nn.Module) -> nn.Module:
    """Keep the 4-bit layers of ``model`` trainable on the CPU through validation and generation, for good.

    Call it right after loading a 4-bit model that will train on the CPU, before any validation, sanity check
    or ``generate``, under any strategy: bitsandbytes otherwise repacks an eval-mode layer's weight in place for
    an inference-only kernel, and every later training step computes another function or raises (NOTE
    [ bitsandbytes CPU inference kernel ]). Under ``strategy="blockwise"`` the strategy does this for its run
    already; under ``strategy="auto"`` (the run you compare against) nothing else does. It changes nothing on a
    CPU without AVX512-BF16 nor on CUDA, where bitsandbytes never repacks.

    Args:
        model: A model holding bitsandbytes ``Linear4bit`` layers (a PEFT model around one, too).

    Returns:
        ``model``, so that the call can wrap a ``from_pretrained``.

    Raises:
        ValueError: If a layer was repacked already: that cannot be undone exactly; load the model again.

    Example::

        model = lightning_blockwise.keep_4bit_trainable_on_cpu(
            AutoModelForCausalLM.from_pretrained(path, quantization_config=bnb_config)
        ).train()
    """
    repacked = [name for name, sub in model.named_modules() if isinstance(sub, Linear4bit) and _repacked(sub)]
    if repacked:
        raise ValueError(
            f"keep_4bit_trainable_on_cpu: {len(repacked)} 4-bit layers (e.g. `{repacked[0]}`) were already repacked"
            " by bitsandbytes for its CPU inference kernel, by an eval-mode forward without grad (a validation"
            " pass, `generate`), which cannot be undone exactly. Load the model again and make this call right"
            " after loading, before any validation or generation."
        )
    disable_cpu_repack(model)
    return model


def _repacked(layer: Linear4bit) -> bool:
    state = getattr(layer.weight, "quant_state", None)
    return state is not None and is_repacked_for_cpu(state)


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
