"""The model on the meta device: built from the config, checked against the checkpoint's keys, filled tensor by tensor.

:func:`~lightning_blockwise.loading.load.load_blockwise` compares the checkpoint's keys with the
model (:func:`check_keys`) before it reads any tensor, then fills the decoder layers one at a
time and everything else with :func:`load_rest`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

from lightning_blockwise.architectures import decoder_layers, no_decoder_stack
from lightning_blockwise.compat.bitsandbytes import (
    SAVED_WEIGHT_ENTRIES,
    is_4bit_weight,
    named_4bit_linears,
    replace_with_4bit_linears,
)
from lightning_blockwise.loading.conversions import CheckpointMap, map_checkpoint

# Float dtypes a weight may have in the checkpoint to be quantized (safetensors' dtype names).
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Checkpoint keys of buffers that transformers computes at init and ignores when found.
_IGNORED_KEYS = ("rotary_emb.inv_freq",)


def build_meta_model(
    config: Any, bnb_config: BitsAndBytesConfig | None, dtype: torch.dtype
) -> tuple[PreTrainedModel, nn.ModuleList, list[str]]:
    """The model of ``config`` on the meta device, its linears converted to 4-bit as ``from_pretrained`` does.

    Its unquantized tensors have the dtype they will be loaded in, so that the arena can be sized
    from it before anything is read. Without ``bnb_config`` (a dense load) nothing is converted and
    every tensor keeps the dtype ``from_config(config, dtype=dtype)`` gives it.

    Returns:
        The model, its decoder layers, and each layer's state-dict key prefix (``model.layers.0.``, ...).

    Raises:
        MisconfigurationException: If the model has no decoder stack, or a linear outside it would be quantized.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if bnb_config is not None:
        replace_with_4bit_linears(model, bnb_config)
    layers = _decoder_layers(model)
    names = {id(module): name for name, module in model.named_modules()}
    prefixes = [names[id(layer)] + "." for layer in layers]
    if bnb_config is not None:
        _check_no_quantized_outside(model, layers)
        _cast_unquantized(layers, dtype)
    return model, layers, prefixes


def check_keys(model: nn.Module, keys: dict[str, Any], prefixes: list[str], pre_quantized: bool) -> CheckpointMap:
    """Every checkpoint key is a model tensor (or a 4-bit weight's statistics); every layer tensor is there.

    Keys are mapped to tensors as ``from_pretrained`` maps them (``map_checkpoint`` in conversions.py:
    renamings, and per-expert weights fused into one 3-D tensor for MoE models).

    Args:
        model: The meta model.
        keys: Checkpoint key -> the open shard that holds it.
        prefixes: The decoder layers' key prefixes.
        pre_quantized: Whether the checkpoint holds 4-bit weights (``U8``, with their statistics).

    Returns:
        Where each model tensor comes from.

    Raises:
        ValueError: If a key is unexpected or missing, or a 4-bit weight has an unsupported dtype.
    """
    found = map_checkpoint(model, keys)
    expected = set(model.state_dict().keys())
    quantized = {f"{name}.weight" for name, _ in named_4bit_linears(model)}
    statistics: set[str] = set()
    if pre_quantized:
        for weight in quantized:
            statistics.update(f"{weight}.{entry}" for entry in SAVED_WEIGHT_ENTRIES)
    unexpected = [k for k in found.unmatched if k not in statistics and not k.endswith(_IGNORED_KEYS)]
    if unexpected:
        raise ValueError(
            f"load_blockwise: the checkpoint holds tensors the config does not explain: {', '.join(unexpected[:8])}"
            f"{' ...' if len(unexpected) > 8 else ''}. The checkpoint and config.json do not match (another"
            " architecture or size?); fix config.json or use the matching checkpoint."
        )
    in_layers = tuple(prefixes)
    missing = sorted(k for k in expected if k.startswith(in_layers) and k not in found.sources)
    if missing:
        raise ValueError(
            f"load_blockwise: the checkpoint lacks decoder-layer tensors: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete or does not match config.json."
        )
    for weight in quantized:
        source = found.sources[weight]
        if source.converter is not None:
            raise ValueError(
                f"load_blockwise: the 4-bit weight `{weight}` is made of {len(source.inputs)} checkpoint tensors by a"
                " transformers conversion; only weights stored as they are can be quantized here. Load with"
                " `quantize=False`, or with `from_pretrained`."
            )
        key = source.inputs[0][0]
        dtype = keys[key].get_slice(key).get_dtype()
        wanted = {"U8"} if pre_quantized else set(_FLOAT_DTYPES)
        if dtype not in wanted:
            raise ValueError(
                f"load_blockwise: `{key}` is {dtype} in the checkpoint, but a"
                f" {'pre-quantized 4-bit weight must be U8' if pre_quantized else 'weight to quantize must be one of'}"
                f"{'' if pre_quantized else ' ' + ', '.join(sorted(_FLOAT_DTYPES))}. Use an unquantized bf16/fp32"
                " checkpoint or one saved by bitsandbytes in 4-bit NF4."
            )
    return found


def named_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, bool]]:
    """(owner, attribute, is_parameter) of every parameter and persistent buffer of ``module`` and its children."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                yield sub, name, True
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield sub, name, False


def tensor_names(module: nn.Module, prefix: str = "") -> dict[str, tuple[nn.Module, str, bool]]:
    """:func:`named_tensors` by state-dict name (``prefix`` first): name -> (owner, attribute, is_parameter)."""
    names = {id(sub): name for name, sub in module.named_modules()}
    return {
        prefix + ".".join(filter(None, (names[id(owner)], attr))): (owner, attr, is_param)
        for owner, attr, is_param in named_tensors(module)
    }


def load_tensors(
    found: CheckpointMap,
    tensors: dict[str, tuple[nn.Module, str, bool]],
    keys: dict[str, Any],
    device: torch.device,
    frozen: bool = False,
) -> None:
    """Read ``tensors`` (by state-dict name) from the checkpoint on ``device``, each in its meta dtype, and set them.

    Each in the dtype its meta tensor has, as ``from_pretrained`` casts to the empty parameter's dtype.
    Names the checkpoint does not hold are left alone.

    Raises:
        ValueError: If a conversion makes a tensor of another shape than the model's.
    """
    for source in found.groups(tensors):
        owner, attr, _ = tensors[source.targets[0]]
        for name, value in source.read(keys, device, getattr(owner, attr).dtype).items():
            owner, attr, is_param = tensors[name]
            shape = tuple(getattr(owner, attr).shape)
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"load_blockwise: `{name}` is {tuple(value.shape)} in the checkpoint but {shape} in the model; the"
                    " checkpoint does not match config.json."
                )
            set_tensor(owner, attr, is_param, value, frozen=frozen)


def set_tensor(owner: nn.Module, attr: str, is_param: bool, value: Tensor, frozen: bool = False) -> None:
    """Replace a (meta) tensor of ``owner`` by ``value``, marked initialized; ``frozen`` drops its ``requires_grad``."""
    if is_param:
        old = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad and not frozen)
    else:
        owner._buffers[attr] = value
    # transformers' init functions skip tensors marked initialized (see `_init_rest_buffers`).
    getattr(owner, attr)._is_hf_initialized = True


def load_rest(model: PreTrainedModel, found: CheckpointMap, keys: dict[str, Any], prefixes: list[str]) -> None:
    """Load all but the decoder layers on the CPU in their meta dtypes, tie weights, compute non-persistent buffers.

    Args:
        model: The meta model.
        found: Where each model tensor comes from (:func:`check_keys`).
        keys: Checkpoint key -> the open shard that holds it.
        prefixes: The decoder layers' key prefixes.

    Raises:
        ValueError: If a tensor outside the decoder layers is neither in the checkpoint nor tied nor computed.
    """
    layer_ids = {id(m) for layer in _decoder_layers(model) for m in layer.modules()}
    outside = {
        name: entry for name, entry in tensor_names(model).items() if id(entry[0]) not in layer_ids
    }  # a name missing from the checkpoint is a tied weight, tied below
    load_tensors(found, outside, keys, torch.device("cpu"))
    model.tie_weights()
    # Non-persistent buffers (rotary inverse frequencies, embedding scales) are computed, not loaded:
    # materialize them on the CPU and let the model's own init compute them, as `from_pretrained` does.
    for sub in model.modules():
        meta = [n for n, b in sub._buffers.items() if b is not None and b.is_meta]
        for name in meta:
            sub._buffers[name] = torch.empty_like(sub._buffers[name], device="cpu")
        if meta:
            model._init_weights(sub)
    leftover = [f"{n}" for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    leftover = [n for n in leftover if not n.startswith(tuple(prefixes))]
    if leftover:
        raise ValueError(
            f"load_blockwise: the checkpoint lacks {', '.join(leftover[:8])}; it is incomplete or does not match"
            " config.json."
        )


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = decoder_layers(model)
    if layers is None:
        # The strategy's words, which name where the layers are (GPT-2: `transformer.h`).
        raise MisconfigurationException(f"load_blockwise {no_decoder_stack(model, type(model).__name__)}.")
    return layers


def _check_no_quantized_outside(model: nn.Module, layers: nn.ModuleList) -> None:
    inside = {id(m) for layer in layers for m in layer.modules()}
    outside = [name for name, m in named_4bit_linears(model) if id(m) not in inside]
    if outside:
        raise MisconfigurationException(
            f"load_blockwise: {', '.join(outside)} would be quantized outside the decoder layers, which the host arena"
            " does not hold. Add them to `BitsAndBytesConfig(llm_int8_skip_modules=[...])`."
        )


def _cast_unquantized(layers: nn.ModuleList, dtype: torch.dtype) -> None:
    """Give the meta layers' floating tensors other than 4-bit weights the dtype they are loaded in.

    The arena is sized from the meta model before anything is read, so it must have the loaded
    dtypes: ``replace_with_bnb_linear`` creates each ``Linear4bit`` bias in float32, while the
    loaded bias is cast to ``dtype`` as ``from_pretrained`` does (a Qwen2.5-14B layer's three
    biases would be predicted 14,336 bytes too large).
    """
    for owner, attr, is_param in list(named_tensors(layers)):
        tensor = getattr(owner, attr)
        if not is_4bit_weight(owner, attr) and tensor.is_floating_point() and tensor.dtype != dtype:
            set_tensor(owner, attr, is_param, tensor.to(dtype))
