"""Block-streamed loading: a local checkpoint straight into the host arena, one decoder layer at a time.

The standard path (``AutoModelForCausalLM.from_pretrained(path, quantization_config=...)``)
materializes the whole quantized model on the GPU before the strategy moves its decoder
layers to the host. :func:`load_blockwise` never does: it builds the model on the meta
device, then per decoder layer reads the layer's tensors from the memory-mapped shards,
quantizes each 4-bit weight on the device, moves the result to the host and packs each
block into a :class:`~lightning_blockwise.residency.arena.HostArena` sized from ``config.json``
before anything is read. The device holds one weight at a time; host memory holds the
arena plus one block.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from bitsandbytes.nn import Linear4bit, Params4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from safetensors import safe_open
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel
from transformers.integrations import replace_with_bnb_linear
from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

from lightning_blockwise.compat.bitsandbytes import (
    SAVED_STATE_JSON_PREFIX,
    SAVED_STATE_SUFFIXES,
    deserialize,
    is_supported_config,
    move_to_host,
    nf4_config,
    quantize_like,
)
from lightning_blockwise.residency import arena as arena_module
from lightning_blockwise.residency.arena import slab_offsets
from lightning_blockwise.residency.layout import ALIGNMENT, bind, frozen_tensors, layout_block, pack, tensor_offsets
from lightning_blockwise.residency.placement import HostCopy, attach_host_copy

log = logging.getLogger(__name__)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
# Float dtypes a weight may have in the checkpoint to be quantized (safetensors' dtype names).
_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Checkpoint keys of buffers that transformers computes at init and ignores when found.
_IGNORED_KEYS = ("rotary_emb.inv_freq",)


def load_blockwise(
    path: str | Path,
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    block_size: int = 1,
    quantization_config: BitsAndBytesConfig | None = None,
    progress: bool = True,
) -> PreTrainedModel:
    """Load a local causal-LM checkpoint as NF4, its decoder layers straight into a host arena.

    The result is the model ``AutoModelForCausalLM.from_pretrained(path, quantization_config=...,
    dtype=compute_dtype)`` gives, byte for byte (NOTE [ Same bytes as from_pretrained ]), except
    that every decoder layer's frozen tensors already are views of a host arena laid out in
    blocks of ``block_size`` layers and every other module is on the CPU.
    ``BlockwiseStrategy(block_size=block_size)`` reuses that arena instead of packing again
    and moves the rest to its device. The model is returned in train mode (NOTE [ bitsandbytes
    CPU inference kernel ] in compat_bitsandbytes.py); attach PEFT adapters to it as usual.

    Args:
        path: A local Hugging Face checkpoint directory: ``config.json`` and ``model.safetensors``,
            or shards listed in ``model.safetensors.index.json``. Unquantized (fp32, bf16, fp16) or
            saved quantized by bitsandbytes (NF4, ``*-bnb-4bit`` style).
        compute_dtype: The dtype of the unquantized modules and of the 4-bit layers' compute;
            unquantized weights are cast to it before quantizing, as ``from_pretrained(dtype=...)`` does.
            A pre-quantized checkpoint loads in its saved dtype and compute dtype instead, as there.
        device: Where to quantize; defaults to the current CUDA device if there is one, else the CPU.
            Quantizing on the CPU and on a GPU can give different bytes; use the device the
            standard path would use to compare with it.
        block_size: Decoder layers per block; must equal the strategy's ``block_size`` for it to
            reuse the arena.
        quantization_config: NF4 settings; defaults to NF4 with double quantization and
            ``compute_dtype``. Ignored (but checked) for a pre-quantized checkpoint, whose own
            settings apply.
        progress: Show a progress bar over the layers (bytes and ETA).

    Returns:
        The model, in train mode, with ``is_loaded_in_4bit`` set.

    Raises:
        MisconfigurationException: If the checkpoint is missing or incomplete, the settings are not
            4-bit NF4, or the arena does not fit the available host RAM (checked from ``config.json``
            before any tensor is read).
        ValueError: If a shard is corrupt, or a tensor is unexpected, missing or of an unsupported dtype.

    Example::

        from lightning_blockwise import BlockwiseStrategy, load_blockwise

        class Module(LightningModule):
            def configure_model(self):
                model = load_blockwise("/ckpt/Qwen2.5-32B", compute_dtype=torch.bfloat16, block_size=1)
                self.model = get_peft_model(model, LoraConfig(r=16, target_modules=[...]))

        Trainer(strategy=BlockwiseStrategy(block_size=1), accelerator="gpu", precision="bf16-mixed").fit(Module())
    """
    # Lightning calls `configure_model` under `torch.device(root_device)`; what is not placed explicitly here
    # (the non-layer modules, computed buffers such as rotary frequencies, the arena) is host memory, whatever
    # the caller's default device.
    with torch.device("cpu"):
        return _load_blockwise(Path(path), compute_dtype, device, block_size, quantization_config, progress)


def _load_blockwise(
    path: Path,
    compute_dtype: torch.dtype,
    device: torch.device | str | None,
    block_size: int,
    quantization_config: BitsAndBytesConfig | None,
    progress: bool,
) -> PreTrainedModel:
    start = time.perf_counter()
    if block_size < 1:
        raise ValueError(f"load_blockwise: block_size={block_size} must be at least 1.")
    device = torch.device(device) if device is not None else _default_device()
    config = _load_config(path)
    bnb_config, pre_quantized = _resolve_quantization(config, quantization_config, compute_dtype)
    if pre_quantized:
        # `from_pretrained` loads a pre-quantized checkpoint in its saved dtype, whatever `dtype` it is given.
        saved_dtype = getattr(config, "dtype", None)
        compute_dtype = saved_dtype if isinstance(saved_dtype, torch.dtype) else bnb_config.bnb_4bit_compute_dtype
        if compute_dtype != bnb_config.bnb_4bit_compute_dtype:
            log.warning(
                f"load_blockwise: `{path}` is quantized with compute dtype {bnb_config.bnb_4bit_compute_dtype} but"
                f" saved in {compute_dtype}; loading it as `from_pretrained` does."
            )

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    skip = Bnb4BitHfQuantizer(bnb_config).get_modules_to_not_convert(
        model, bnb_config.llm_int8_skip_modules, model._keep_in_fp32_modules
    )
    replace_with_bnb_linear(model, modules_to_not_convert=skip, quantization_config=bnb_config, pre_quantized=False)
    layers = _decoder_layers(model)
    prefixes = _layer_prefixes(model, layers)
    _check_no_quantized_outside(model, layers)
    _cast_unquantized(layers, compute_dtype)

    ranges = tuple(range(s, min(s + block_size, len(layers))) for s in range(0, len(layers), block_size))
    sizes = [predict_block_bytes([layers[i] for i in r]) for r in ranges]
    predicted = slab_offsets(sizes)[-1]
    available = arena_module.available_host_memory()
    if predicted > available - arena_module.HOST_RAM_RESERVE:
        raise MisconfigurationException(
            f"load_blockwise: the NF4 decoder layers of `{path}` need a {predicted / 1e9:.2f} GB host arena (predicted"
            f" from config.json), but only {available / 1e9:.2f} GB of host RAM are available (keeping"
            f" {arena_module.HOST_RAM_RESERVE / 1e9:.1f} GB in reserve). Free host memory or use a machine with more"
            " RAM."
        )

    files = _checkpoint_files(path)
    with ExitStack() as stack:
        handles = {file: stack.enter_context(_open_shard(file)) for file in sorted(set(files.values()))}
        keys = {key: handles[file] for key, file in files.items()}
        _check_keys(model, keys, prefixes, pre_quantized)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _load_rest(model, keys, prefixes, compute_dtype)
        host = arena_module.HostArena(sizes, pin=device.type == "cuda")
        layouts = []
        bar = tqdm(total=predicted, unit="B", unit_scale=True, desc="load_blockwise", disable=not progress)
        for layer_range, slab in zip(ranges, host.slabs, strict=True):
            for index in layer_range:
                _load_layer(layers[index], prefixes[index], keys, device, compute_dtype, pre_quantized)
                bar.update(predict_block_bytes([layers[index]]))
            layout = layout_block([layers[i] for i in layer_range], first_index=layer_range[0])
            if layout.nbytes != slab.numel():
                raise RuntimeError(
                    f"load_blockwise: block of layers {layer_range[0]}-{layer_range[-1]} needs {layout.nbytes} bytes"
                    f" but {slab.numel()} were predicted from config.json; this is a bug, please report it."
                )
            pack(layout, slab)
            # Binding drops the block's freshly loaded host tensors: memory holds the arena plus one block.
            bind(layout, slab)
            layouts.append(layout)
        bar.close()

    attach_host_copy(model, HostCopy(layer_ranges=ranges, layouts=tuple(layouts), arena=host, block_size=block_size))
    model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
    model.config.quantization_config = bnb_config
    model.train()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    log.info(
        f"load_blockwise: {len(layers)} layers of `{path}` in {time.perf_counter() - start:.1f} s; host arena"
        f" {host.nbytes / 1e9:.3f} GB ({host.bytes_needed / 1e9:.3f} GB needed, {len(ranges)} blocks of"
        f" {block_size}, pinned={host.pinned}); {'device' if device.type == 'cuda' else 'no device'} load peak"
        f" {peak / 1e9:.3f} GB allocated on {device}."
    )
    return model


def predict_block_bytes(layers: Sequence[nn.Module], alignment: int = ALIGNMENT) -> int:
    """The exact slab bytes of one block of a meta model: its ``layout_block(...).nbytes`` once loaded.

    The block's :func:`~lightning_blockwise.residency.layout.frozen_tensors` at their aligned offsets, every
    4-bit weight not quantized yet counted as the tensors bitsandbytes will store for it
    (NOTE [ NF4 bytes ] in compat_bitsandbytes.py). Needs shapes and dtypes only, so it works
    on the meta device, before anything is read.

    Args:
        layers: The decoder layers of one block, their linears converted to ``Linear4bit`` (on the
            meta device, or loaded).
        alignment: The layout's alignment.
    """
    return tensor_offsets((tensor.nbytes for tensor in frozen_tensors(layers)), alignment)[-1]


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _load_config(path: Path) -> Any:
    """The checkpoint's config, from its directory and never from the network."""
    if not path.exists():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` does not exist; pass a local Hugging Face checkpoint directory (as written by"
            " `save_pretrained`)."
        )
    if not path.is_dir():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` is a file; pass the checkpoint directory that holds it and config.json."
        )
    if not (path / "config.json").is_file():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` has no config.json; pass a local Hugging Face checkpoint directory (as written"
            " by `save_pretrained`)."
        )
    # A path transformers does not find locally must be an error, never a Hub repo id to download.
    return AutoConfig.from_pretrained(path, local_files_only=True)


def _resolve_quantization(
    config: Any, requested: BitsAndBytesConfig | None, compute_dtype: torch.dtype
) -> tuple[BitsAndBytesConfig, bool]:
    """The 4-bit settings to load with, and whether the checkpoint is already quantized; refuses all but NF4."""
    saved = getattr(config, "quantization_config", None)
    if saved is not None:
        saved = saved if isinstance(saved, dict) else saved.to_dict()
        if saved.get("quant_method") != "bitsandbytes" or not saved.get("load_in_4bit"):
            raise MisconfigurationException(
                f"load_blockwise: the checkpoint is quantized with {saved.get('quant_method')!r}"
                f" (load_in_8bit={saved.get('load_in_8bit', False)}); only bitsandbytes 4-bit NF4 checkpoints or"
                " unquantized ones are supported. Use an unquantized (bf16) checkpoint."
            )
        # As in `from_pretrained`, the checkpoint's own settings (its compute dtype too) win.
        bnb_config = BitsAndBytesConfig.from_dict(saved)
    elif requested is not None:
        bnb_config = requested
    else:
        bnb_config = nf4_config(compute_dtype)
    for checked in (bnb_config, requested):
        if checked is not None and not is_supported_config(checked):
            raise MisconfigurationException(
                "load_blockwise: only bitsandbytes 4-bit NF4 with uint8 storage is supported, got"
                f" load_in_4bit={checked.load_in_4bit}, load_in_8bit={checked.load_in_8bit},"
                f" bnb_4bit_quant_type={checked.bnb_4bit_quant_type!r},"
                f" bnb_4bit_quant_storage={checked.bnb_4bit_quant_storage}. Use"
                " `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True)`."
            )
    return bnb_config, saved is not None


def _checkpoint_files(path: Path) -> dict[str, Path]:
    """Checkpoint key -> the safetensors file holding it; every file must exist."""
    index = path / _INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"load_blockwise: `{index}` is not a safetensors index ({err}).") from err
        files = {key: path / name for key, name in weight_map.items()}
        missing = sorted({str(file) for file in files.values() if not file.is_file()})
        if missing:
            raise MisconfigurationException(
                f"load_blockwise: `{index}` lists shards that do not exist: {', '.join(missing)}. Download or copy the"
                " whole checkpoint."
            )
        return files
    single = path / _SINGLE_FILE
    if not single.is_file():
        raise MisconfigurationException(
            f"load_blockwise: `{path}` has neither `{_SINGLE_FILE}` nor `{_INDEX_FILE}`. Only safetensors checkpoints"
            " are supported; convert .bin checkpoints with `save_pretrained(..., safe_serialization=True)`."
        )
    with _open_shard(single) as handle:
        return dict.fromkeys(handle.keys(), single)


@contextmanager
def _open_shard(file: Path) -> Iterator[Any]:
    """``safe_open`` (memory-mapped) that names the file when its header or size is corrupt."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except Exception as err:
        # safetensors checks the header and that the data covers it: a truncated file fails here.
        raise ValueError(
            f"load_blockwise: cannot read `{file}`: {err}. The file is corrupt or truncated; download or copy it again."
        ) from err
    with handle as opened:
        yield opened


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise MisconfigurationException(
            f"load_blockwise: `{type(model).__name__}` has no decoder stack (`model.get_decoder().layers`); only"
            " decoder-only causal LMs are supported."
        )
    return layers


def _layer_prefixes(model: nn.Module, layers: nn.ModuleList) -> list[str]:
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(layer)] + "." for layer in layers]


def _check_no_quantized_outside(model: nn.Module, layers: nn.ModuleList) -> None:
    inside = {id(m) for layer in layers for m in layer.modules()}
    outside = [name for name, m in model.named_modules() if isinstance(m, Linear4bit) and id(m) not in inside]
    if outside:
        raise MisconfigurationException(
            f"load_blockwise: {', '.join(outside)} would be quantized outside the decoder layers, which the host arena"
            " does not hold. Add them to `BitsAndBytesConfig(llm_int8_skip_modules=[...])`."
        )


def _quantized_weights(model: nn.Module) -> set[str]:
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, Linear4bit)}


def _check_keys(model: nn.Module, keys: dict[str, Any], prefixes: list[str], pre_quantized: bool) -> None:
    """Every checkpoint key is a model tensor (or a 4-bit weight's statistics); every layer tensor is there."""
    expected = set(model.state_dict().keys())
    quantized = _quantized_weights(model)
    allowed = set(expected)
    if pre_quantized:
        for weight in quantized:
            allowed.update(f"{weight}.{suffix}" for suffix in SAVED_STATE_SUFFIXES)
            allowed.update(f"{weight}.{SAVED_STATE_JSON_PREFIX}{kind}" for kind in ("nf4", "fp4"))
    unexpected = sorted(k for k in keys if k not in allowed and not k.endswith(_IGNORED_KEYS))
    if unexpected:
        raise ValueError(
            f"load_blockwise: the checkpoint holds tensors the config does not explain: {', '.join(unexpected[:8])}"
            f"{' ...' if len(unexpected) > 8 else ''}. The checkpoint and config.json do not match (another"
            " architecture or size?); fix config.json or use the matching checkpoint."
        )
    in_layers = tuple(prefixes)
    missing = sorted(k for k in expected if k.startswith(in_layers) and k not in keys)
    if missing:
        raise ValueError(
            f"load_blockwise: the checkpoint lacks decoder-layer tensors: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}. The checkpoint is incomplete or does not match config.json."
        )
    for weight in quantized:
        dtype = keys[weight].get_slice(weight).get_dtype()
        wanted = {"U8"} if pre_quantized else set(_FLOAT_DTYPES)
        if dtype not in wanted:
            raise ValueError(
                f"load_blockwise: `{weight}` is {dtype} in the checkpoint, but a"
                f" {'pre-quantized 4-bit weight must be U8' if pre_quantized else 'weight to quantize must be one of'}"
                f"{'' if pre_quantized else ' ' + ', '.join(sorted(_FLOAT_DTYPES))}. Use an unquantized bf16/fp32"
                " checkpoint or one saved by bitsandbytes in 4-bit NF4."
            )


def _named_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, bool]]:
    """(owner, attribute, is_parameter) of every parameter and persistent buffer of ``module`` and its children."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                yield sub, name, True
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield sub, name, False


def _set(owner: nn.Module, attr: str, is_param: bool, value: Tensor, frozen: bool = False) -> None:
    if is_param:
        old = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(value, requires_grad=old.requires_grad and not frozen)
    else:
        owner._buffers[attr] = value
    # transformers' init functions skip tensors marked initialized (see `_init_rest_buffers`).
    getattr(owner, attr)._is_hf_initialized = True


def _load_rest(model: PreTrainedModel, keys: dict[str, Any], prefixes: list[str], dtype: torch.dtype) -> None:
    """Load all but the decoder layers on the CPU in ``dtype``, tie weights, compute non-persistent buffers."""
    layer_ids = {id(m) for layer in _decoder_layers(model) for m in layer.modules()}
    names = {id(module): name for name, module in model.named_modules()}
    for owner, attr, is_param in list(_named_tensors(model)):
        if id(owner) in layer_ids:
            continue
        key = ".".join(filter(None, (names[id(owner)], attr)))
        if key not in keys:
            continue  # a tied weight, tied below
        tensor = keys[key].get_tensor(key)
        _set(owner, attr, is_param, tensor.to(dtype) if tensor.is_floating_point() else tensor)
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


def _cast_unquantized(layers: nn.ModuleList, dtype: torch.dtype) -> None:
    """Give the meta layers' floating tensors other than 4-bit weights the dtype ``_load_layer`` loads them in.

    The arena is sized from the meta model before anything is read, so it must have the loaded
    dtypes: ``replace_with_bnb_linear`` creates each ``Linear4bit`` bias in float32, while the
    loaded bias is cast to ``dtype`` as ``from_pretrained`` does (a Qwen2.5-14B layer's three
    biases would be predicted 14,336 bytes too large).
    """
    for owner, attr, is_param in list(_named_tensors(layers)):
        tensor = getattr(owner, attr)
        if not isinstance(tensor, Params4bit) and tensor.is_floating_point() and tensor.dtype != dtype:
            _set(owner, attr, is_param, tensor.to(dtype))


def _load_layer(
    layer: nn.Module, prefix: str, keys: dict[str, Any], device: torch.device, dtype: torch.dtype, pre_quantized: bool
) -> None:
    """Materialize one decoder layer on the host: 4-bit weights quantized on ``device`` (or deserialized)."""
    names = {id(module): name for name, module in layer.named_modules()}
    for owner, attr, is_param in list(_named_tensors(layer)):
        key = prefix + ".".join(filter(None, (names[id(owner)], attr)))
        if isinstance(owner, Linear4bit) and attr == "weight":
            if pre_quantized:
                _deserialize_4bit(owner, key, keys)
            else:
                _quantize_4bit(owner, key, keys, device, dtype)
            continue
        tensor = keys[key].get_tensor(key)
        # Frozen: the arena holds a copy that training would not update (PEFT freezes them anyway).
        _set(owner, attr, is_param, tensor.to(dtype) if tensor.is_floating_point() else tensor, frozen=True)


# NOTE [ Same bytes as from_pretrained ]
# Every step that decides bytes is transformers' own: the meta model is converted with
# `replace_with_bnb_linear` and the skip list of `Bnb4BitHfQuantizer` (so `lm_head` and the
# model's fp32 modules stay unquantized), each weight is cast to the load dtype on the
# device in one `.to(device, dtype)` as `core_model_loading._materialize_copy` does, and
# quantized as `Bnb4bitQuantize` does: `Params4bit(value, **meta_param.__dict__).to(device)`,
# which carries the meta parameter's blocksize, quant type, double quantization and
# storage dtype. Pre-quantized weights go through `Params4bit.from_prequantized` as
# `Bnb4bitDeserialize` does. Only the placement differs: the results are moved to the host
# (the same `Params4bit` and `QuantState` objects) and packed into the arena.
def _quantize_4bit(
    module: Linear4bit, key: str, keys: dict[str, Any], device: torch.device, dtype: torch.dtype
) -> None:
    """Quantize one weight on ``device`` as transformers' ``Bnb4bitQuantize`` does, then move it to the host."""
    # NOTE [ Same bytes as from_pretrained ]: cast on the device in one `.to`, then quantize.
    value = keys[key].get_tensor(key).to(device=device, dtype=dtype)
    weight = quantize_like(module.weight, value, device)
    del value
    move_to_host(weight)
    module._parameters["weight"] = weight


def _deserialize_4bit(module: Linear4bit, key: str, keys: dict[str, Any]) -> None:
    """Rebuild a pre-quantized weight on the host as transformers' ``Bnb4bitDeserialize`` does."""
    stats = {}
    for suffix in (*SAVED_STATE_SUFFIXES, *(f"{SAVED_STATE_JSON_PREFIX}{kind}" for kind in ("nf4", "fp4"))):
        name = f"{key}.{suffix}"
        if name in keys:
            stats[suffix] = keys[name].get_tensor(name)
    if not any(s.startswith(SAVED_STATE_JSON_PREFIX) for s in stats) or "absmax" not in stats:
        raise ValueError(
            f"load_blockwise: the pre-quantized weight `{key}` lacks its bitsandbytes statistics (`{key}.absmax`,"
            f" `{key}.{SAVED_STATE_JSON_PREFIX}nf4`); the checkpoint is incomplete."
        )
    if f"{SAVED_STATE_JSON_PREFIX}nf4" not in stats:
        raise MisconfigurationException(
            f"load_blockwise: `{key}` is quantized as FP4; only NF4 is supported. Use an NF4 or unquantized checkpoint."
        )
    module._parameters["weight"] = deserialize(module, keys[key].get_tensor(key), stats)
