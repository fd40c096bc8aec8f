"""Block-streamed loading: a local checkpoint straight into the host arena, one decoder layer at a time.

The standard path (``AutoModelForCausalLM.from_pretrained(path, quantization_config=...)``)
materializes the whole quantized model on the GPU before the strategy moves its decoder
layers to the host. :func:`load_blockwise` never does: it builds the model on the meta
device, then per decoder layer reads the layer's tensors from the memory-mapped shards,
quantizes each 4-bit weight on the device, moves the result to the host and packs each
block into a :class:`~lightning_blockwise.residency.arena.HostArena` sized from ``config.json``
before anything is read. The device holds one weight at a time; host memory holds the
arena plus one block.

The steps live beside this module: the checkpoint directory (``files``), the 4-bit settings
(``policy``), the meta model (``meta_model``), one 4-bit weight (``nf4``) and the arena
(``packing``); this module runs them in order.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import BitsAndBytesConfig, PreTrainedModel

from lightning_blockwise.compat.bitsandbytes import is_4bit_weight
from lightning_blockwise.compat.flags import check_flag
from lightning_blockwise.loading.conversions import CheckpointMap
from lightning_blockwise.loading.files import checkpoint_files, load_config, open_checkpoint
from lightning_blockwise.loading.meta_model import build_meta_model, check_keys, load_rest, load_tensors, tensor_names
from lightning_blockwise.loading.nf4 import deserialize_weight, quantize_weight
from lightning_blockwise.loading.packing import (
    bind_shared_block,
    block_ranges,
    pack_block,
    predict_block_bytes,
    predict_slabs,
)
from lightning_blockwise.loading.policy import resolve_quantization, saved_dtype
from lightning_blockwise.loading.sharing import scoped, share_enabled, share_key
from lightning_blockwise.residency.arena import HostArena
from lightning_blockwise.residency.placement import HostCopy, attach_host_copy
from lightning_blockwise.residency.shared_arena import ArenaClaim
from lightning_blockwise.residency.sharing import attach_or_own, serve_or_release

log = logging.getLogger(__name__)


def load_blockwise(
    path: str | Path,
    *,
    compute_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    block_size: int = 1,
    quantization_config: BitsAndBytesConfig | None = None,
    progress: bool = True,
    share: bool = True,
    quantize: bool = True,
    share_scope: str | None = None,
) -> PreTrainedModel:
    """Load a local causal-LM checkpoint as NF4 (or dense), its decoder layers straight into a host arena.

    The result is the model ``AutoModelForCausalLM.from_pretrained(path, quantization_config=...,
    dtype=compute_dtype)`` gives, byte for byte (NOTE [ Same bytes as from_pretrained ] in nf4.py), except
    that every decoder layer's frozen tensors already are views of a host arena laid out in
    blocks of ``block_size`` layers and every other module is on the CPU.
    ``BlockwiseStrategy(block_size=block_size)`` reuses that arena instead of packing again
    and moves the rest to its device. The model is returned in train mode (NOTE [ bitsandbytes
    CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py); attach PEFT adapters to it as usual.

    With ``quantize=False`` (a dense base) nothing is quantized: every tensor loads in the dtype
    ``from_pretrained(path, dtype=compute_dtype)`` gives it, read from the memory-mapped shards on
    the host, never on the device, and the result is that model byte for byte, its layers in the
    arena. Tensors bitsandbytes does not quantize load the same way in a 4-bit load: a ``qwen3_moe``
    base is mixed, attention NF4 and its fused 3-D experts in ``compute_dtype`` (the checkpoint's
    per-expert weights are fused as ``from_pretrained`` fuses them: ``loading/conversions.py``).

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
        share: Share the host copy with the other processes of this user on the machine that load the same
            checkpoint with the same settings (data-parallel ranks, concurrent jobs): the first one loads it into
            the arena, the others wait for it, load block by block to check the bytes, and map its pages
            read-only instead of keeping copies of their own (NOTE [ One host copy per machine ] in
            residency/shared_arena.py). Linux only; elsewhere every process keeps its own copy.
        quantize: Quantize the 4-bit linears to NF4 (default). ``False``: a dense base, every tensor in
            ``compute_dtype`` (about 3.6x the host bytes of NF4); an unquantized checkpoint only.
        share_scope: With ``share``, share only with the processes that load with the same scope; ``None``: with any
            (``CausalLMFineTune`` passes its run's :func:`~lightning_blockwise.loading.sharing.run_scope` for
            ``BlockwiseStrategy(share_host_copy=None)``: the run's ranks share, other jobs do not).

    Returns:
        The model, in train mode, with ``is_loaded_in_4bit`` set unless ``quantize=False``.

    Raises:
        MisconfigurationException: If ``progress``, ``share`` or ``quantize`` is not a bool (NOTE [ A string is not a
            flag ] in compat/flags.py), the checkpoint is missing or incomplete, the settings are not
            4-bit NF4, ``quantize=False`` meets a ``quantization_config`` or a pre-quantized checkpoint,
            or the arena does not fit the available host RAM (checked from ``config.json``
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
    for name, flag in (("progress", progress), ("share", share), ("quantize", quantize)):
        check_flag("load_blockwise", name, flag)
    # Lightning calls `configure_model` under `torch.device(root_device)`; what is not placed explicitly here
    # (the non-layer modules, computed buffers such as rotary frequencies, the arena) is host memory, whatever
    # the caller's default device.
    with torch.device("cpu"):
        return _load_blockwise(
            Path(path), compute_dtype, device, block_size, quantization_config, progress, share, quantize, share_scope
        )


def _load_blockwise(
    path: Path,
    compute_dtype: torch.dtype,
    device: torch.device | str | None,
    block_size: int,
    quantization_config: BitsAndBytesConfig | None,
    progress: bool,
    share: bool,
    quantize: bool,
    share_scope: str | None,
) -> PreTrainedModel:
    start = time.perf_counter()
    if block_size < 1:
        raise ValueError(f"load_blockwise: block_size={block_size} must be at least 1.")
    device = torch.device(device) if device is not None else _default_device()
    config = load_config(path)
    bnb_config, pre_quantized = resolve_quantization(config, quantization_config, compute_dtype, quantize)
    if pre_quantized and bnb_config is not None:
        compute_dtype = saved_dtype(config, bnb_config)
        if compute_dtype != bnb_config.bnb_4bit_compute_dtype:
            log.warning(
                f"load_blockwise: `{path}` is quantized with compute dtype {bnb_config.bnb_4bit_compute_dtype} but"
                f" saved in {compute_dtype}; loading it as `from_pretrained` does."
            )

    model, layers, prefixes = build_meta_model(config, bnb_config, compute_dtype)
    ranges = block_ranges(len(layers), block_size)
    # NOTE [ One host copy per machine ]: a peer waits for the owner's copy (the owner: None, it loads one).
    key = (
        scoped(share_key(path, block_size, bnb_config, compute_dtype, pre_quantized), share_scope)
        if share_enabled(share)
        else None
    )
    share_claim, shared = attach_or_own(key, pin=device.type == "cuda")
    # Refused from config.json alone, before any shard is opened; a copy another process holds counts once.
    sizes, predicted = predict_slabs(path, layers, ranges, check_ram=shared is None)

    with open_checkpoint(checkpoint_files(path)) as keys:
        found = check_keys(model, keys, prefixes, pre_quantized)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        load_rest(model, found, keys, prefixes)
        host = shared if shared is not None else HostArena(sizes, pin=device.type == "cuda")
        if [slab.numel() for slab in host.slabs] != sizes:
            raise RuntimeError(f"load_blockwise: the shared host copy of `{path}` has other block sizes; a bug.")
        layouts = []
        bar = tqdm(total=predicted, unit="B", unit_scale=True, desc="load_blockwise", disable=not progress)
        for layer_range, slab in zip(ranges, host.slabs, strict=True):
            for index in layer_range:
                _load_layer(layers[index], prefixes[index], found, keys, device, compute_dtype, pre_quantized)
                bar.update(predict_block_bytes([layers[index]]))
            bind_or_pack = bind_shared_block if shared is not None else pack_block
            layouts.append(bind_or_pack(layers, layer_range, slab))
        bar.close()

    owner = serve_or_release(share_claim, host, {"path": str(path), "blocks": len(ranges)})
    copy = HostCopy(layer_ranges=ranges, layouts=tuple(layouts), arena=host, block_size=block_size, serving=owner)
    attach_host_copy(model, copy)
    if bnb_config is not None:
        model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
        model.config.quantization_config = bnb_config
    model.train()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    log.info(
        f"load_blockwise: {len(layers)} {'dense' if bnb_config is None else 'NF4'} layers of `{path}` in"
        f" {time.perf_counter() - start:.1f} s; host arena"
        f" {host.nbytes / 1e9:.3f} GB ({host.bytes_needed / 1e9:.3f} GB needed, {len(ranges)} blocks of"
        f" {block_size}, pinned={host.pinned}, {_sharing(share_claim, shared)});"
        f" {'device' if device.type == 'cuda' else 'no device'} load peak"
        f" {peak / 1e9:.3f} GB allocated on {device}."
    )
    return model


def _sharing(share_claim: ArenaClaim | None, shared: HostArena | None) -> str:
    if share_claim is None:
        return "not shared"
    return "mapped read-only from another process" if shared is not None else "shared with other processes"


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _load_layer(
    layer: nn.Module,
    prefix: str,
    found: CheckpointMap,
    keys: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    pre_quantized: bool,
) -> None:
    """Materialize one decoder layer on the host: 4-bit weights quantized on ``device`` (or deserialized).

    Every other tensor (all of them in a dense load) is read on the host in its meta dtype, as
    ``from_pretrained(device_map="cpu")`` reads it.
    """
    tensors = tensor_names(layer, prefix)
    rest = {}
    for name, (owner, attr, is_param) in tensors.items():
        if not is_4bit_weight(owner, attr):
            rest[name] = (owner, attr, is_param)
        elif pre_quantized:
            deserialize_weight(owner, found.sources[name].inputs[0][0], keys)
        else:
            (value,) = found.sources[name].read(keys, device, dtype).values()
            quantize_weight(owner, value, device)
    # Frozen: the arena holds a copy that training would not update (PEFT freezes them anyway).
    load_tensors(found, rest, keys, torch.device("cpu"), frozen=True)


# `predict_block_bytes` lived here before the load was split into steps; it stays importable from here.
__all__ = ["load_blockwise", "predict_block_bytes"]
