"""Everything lightning_blockwise knows about bitsandbytes: on a bitsandbytes upgrade, this is the file to check.

- The NF4 settings the package loads with: :func:`nf4_config`, :func:`is_supported_config`, :func:`nf4_linear`.
- What an NF4 weight is stored as: the quant-state tensors packed with it (:func:`quant_state_tensors`),
  their dtypes, shapes and bytes predicted from the weight's size (:class:`Nf4Format`,
  :func:`nf4_tensor_bytes`), and the code tables left on the compute device (:func:`code_table_bytes`,
  :func:`move_code_tables`).
- Loading: converting a meta model's linears (:func:`replace_with_4bit_linears`), quantizing
  (:func:`quantize_like`), deserializing a saved weight (:func:`deserialize`, :func:`saved_quant_type`), moving
  one to the host (:func:`move_to_host`).
- The state-dict entries ``save_pretrained`` writes next to a 4-bit weight (:data:`SAVED_WEIGHT_ENTRIES`), and
  what checkpoints read from them (:func:`saved_nested_offsets`, :func:`is_saved_quantization_metadata`).
- The CPU inference kernel: :func:`disable_cpu_repack`, :func:`restore_cpu_repack`, :func:`is_repacked_for_cpu`.

Example::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4_config(torch.bfloat16)).train()
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Linear4bit, Params4bit
from bitsandbytes.utils import unpack_tensor_to_dict
from torch import Tensor, nn
from transformers import BitsAndBytesConfig, PreTrainedModel
from transformers.integrations import replace_with_bnb_linear
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

# The 4-bit data type, and whether the absmax are quantized again: NF4 with double quantization.
_QUANT_TYPE = "nf4"
_DOUBLE_QUANT = True

#: What ``save_pretrained`` writes next to each ``<linear>.weight`` of a 4-bit model, as key suffixes.
SAVED_STATE_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
#: The prefix of the state-dict entry that packs a quant state's non-tensor fields (and the nested
#: offset) as JSON; the 4-bit type (``nf4``, ``fp4``) follows it.
SAVED_STATE_JSON_PREFIX = "quant_state.bitsandbytes__"
#: The JSON entry of an NF4 weight (it also carries the nested offset).
SAVED_STATE_JSON = f"{SAVED_STATE_JSON_PREFIX}{_QUANT_TYPE}"
# The 4-bit types whose JSON entry a saved weight may have.
_SAVED_QUANT_TYPES = ("nf4", "fp4")
#: Every key suffix ``save_pretrained`` may write next to a 4-bit weight (NF4 or FP4), in the order they are read.
SAVED_WEIGHT_ENTRIES = (*SAVED_STATE_SUFFIXES, *(f"{SAVED_STATE_JSON_PREFIX}{kind}" for kind in _SAVED_QUANT_TYPES))


def nf4_config(compute_dtype: torch.dtype = torch.float32) -> BitsAndBytesConfig:
    """The package's 4-bit settings: bitsandbytes NF4 with double quantization, computing in ``compute_dtype``.

    Args:
        compute_dtype: The dtype the 4-bit layers compute in (bitsandbytes' default, float32, if not given).
    """
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=_QUANT_TYPE,
        bnb_4bit_use_double_quant=_DOUBLE_QUANT,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def is_supported_config(config: BitsAndBytesConfig) -> bool:
    """Whether ``config`` is 4-bit NF4 with ``uint8`` storage, the format the host arena lays out."""
    return (
        bool(config.load_in_4bit)
        and config.bnb_4bit_quant_type == _QUANT_TYPE
        and config.bnb_4bit_quant_storage == torch.uint8
    )


def nf4_linear(linear: nn.Linear, weight: Tensor, compute_dtype: torch.dtype) -> Linear4bit:
    """The NF4 ``Linear4bit`` that loading with :func:`nf4_config` makes of ``linear``, holding ``weight`` quantized.

    The weight is quantized on its own device; the bias, if ``linear`` has one, is left on the
    meta device for the caller to set.

    Args:
        linear: The linear to replace (only its shape and whether it has a bias are read).
        weight: The unquantized weight, ``(out_features, in_features)``.
        compute_dtype: The dtype the layer computes in.
    """
    quantized = Linear4bit(
        linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=compute_dtype,
        compress_statistics=_DOUBLE_QUANT, quant_type=_QUANT_TYPE, device="meta",
    )  # fmt: skip
    quantized.weight = Params4bit(
        weight, requires_grad=False, compress_statistics=_DOUBLE_QUANT, quant_type=_QUANT_TYPE, module=quantized
    ).to(weight.device)
    return quantized


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
    double_quant: bool = _DOUBLE_QUANT

    def tensor_specs(self, numel: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name suffix, dtype, shape)`` of each tensor stored for a weight of ``numel`` elements, in slab order.

        The suffixes are those of :func:`quant_state_tensors`, ``""`` for the packed weight itself.
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


def nf4_tensor_bytes(numel: int, double_quant: bool = _DOUBLE_QUANT, blocksize: int = 64) -> list[int]:
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


def code_table_bytes(double_quant: bool = _DOUBLE_QUANT) -> int:
    """Bytes of the code tables one NF4 linear keeps on the compute device (NOTE [ NF4 bytes ])."""
    entries = _CODE_ENTRIES + (_NESTED_CODE_ENTRIES if double_quant else 0)
    return entries * torch.float32.itemsize


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


def replace_with_4bit_linears(model: PreTrainedModel, config: BitsAndBytesConfig) -> None:
    """Convert a meta model's linears to ``Linear4bit`` in place, as ``from_pretrained(quantization_config=config)``.

    With transformers' own skip list, so ``lm_head``, the model's fp32 modules and
    ``config.llm_int8_skip_modules`` stay unquantized (NOTE [ Same bytes as from_pretrained ] in
    loading/nf4.py).
    """
    skip = Bnb4BitHfQuantizer(config).get_modules_to_not_convert(
        model, config.llm_int8_skip_modules, model._keep_in_fp32_modules
    )
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=config, pre_quantized=False)


def named_4bit_linears(module: nn.Module) -> Iterator[tuple[str, Linear4bit]]:
    """``(name, module)`` of every bitsandbytes 4-bit linear in ``module``, as ``named_modules`` gives them."""
    return ((name, sub) for name, sub in module.named_modules() if isinstance(sub, Linear4bit))


def is_4bit_weight(owner: nn.Module, attr: str) -> bool:
    """Whether ``owner.<attr>`` is the weight of a bitsandbytes 4-bit linear (quantized, or to be quantized)."""
    return isinstance(owner, Linear4bit) and attr == "weight"


def quantize_like(meta_weight: Params4bit, value: Tensor, device: torch.device) -> Params4bit:
    """Quantize ``value`` on ``device`` with the settings of ``meta_weight``, as transformers' ``Bnb4bitQuantize``.

    ``Params4bit(value, **meta_param.__dict__).to(device)`` carries the meta parameter's blocksize,
    quant type, double quantization and storage dtype.
    """
    return Params4bit(value, requires_grad=False, **meta_weight.__dict__).to(device)


def deserialize(module: Linear4bit, data: Tensor, stats: Mapping[str, Tensor]) -> Params4bit:
    """A saved 4-bit weight rebuilt on the host, as transformers' ``Bnb4bitDeserialize`` does.

    Args:
        module: The ``Linear4bit`` the weight belongs to.
        data: The packed weight as saved.
        stats: Its saved statistics by key suffix (:data:`SAVED_WEIGHT_ENTRIES`).
    """
    return Params4bit.from_prequantized(
        data=data, quantized_stats=dict(stats), requires_grad=False, device="cpu", module=module
    )


def saved_quant_type(stats: Mapping[str, Tensor]) -> str | None:
    """The 4-bit type (``"nf4"``, ``"fp4"``) a saved weight's statistics declare, or ``None`` if they are incomplete.

    Args:
        stats: The entries saved next to the weight, by key suffix (:data:`SAVED_WEIGHT_ENTRIES`).
    """
    if "absmax" not in stats:
        return None
    return next((kind for kind in _SAVED_QUANT_TYPES if f"{SAVED_STATE_JSON_PREFIX}{kind}" in stats), None)


def move_to_host(weight: Params4bit) -> None:
    """Move a quantized weight and its quant state to the CPU, keeping the ``Params4bit`` and ``QuantState`` objects."""
    if weight.device.type == "cpu":
        return
    weight.data = weight.data.to("cpu")
    # `QuantState.to` moves absmax, code, offset and the nested state in place.
    weight.quant_state.to(torch.device("cpu"))


def saved_nested_offsets(module: nn.Module, state: Mapping[str, Any]) -> list[tuple[Tensor, Tensor]]:
    """Each 4-bit linear's current nested-quantization ``offset`` tensor, with its value saved in ``state``.

    bitsandbytes folds the offset into ``<linear>.weight.quant_state.bitsandbytes__nf4``, a JSON
    tensor of the state dict, instead of saving it as a tensor of its own.

    Args:
        module: The module whose state dict ``state`` is.
        state: A state dict of ``module``; linears whose JSON tensor it lacks are skipped.
    """
    found = []
    for name, sub in named_4bit_linears(module):
        if sub.weight.quant_state is None or not sub.weight.quant_state.nested:
            continue
        key = f"{name}.weight.{SAVED_STATE_JSON}"
        if key in state:
            current = sub.weight.quant_state.offset
            saved = unpack_tensor_to_dict(state[key])["nested_offset"]
            found.append((current, torch.tensor(saved, dtype=current.dtype).reshape(current.shape)))
    return found


def is_saved_quantization_metadata(key: str) -> bool:
    """Whether ``key`` is a bitsandbytes state-dict entry that no module tensor is loaded from.

    The code tables (``quant_map``, ``nested_quant_map``) are constants of the NF4 format and the
    JSON tensor describes the quantization (its offset is read by :func:`saved_nested_offsets`).
    """
    return key.endswith((".quant_map", ".nested_quant_map", f".{SAVED_STATE_JSON}"))


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
