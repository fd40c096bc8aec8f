"""A random-init base built one decoder layer at a time straight into the host arena (``random_blockwise``).

``recipes.random_init.random_nf4_model`` builds a random NF4 model whole on its device: 68 GB at the
Mistral-Large-2 shape, more than a capped card holds. :func:`random_blockwise` builds the same bytes the way
``load_blockwise`` loads a checkpoint: the model on the meta device, the arena sized from the config and
checked against the host RAM before anything is drawn, then per decoder layer each linear drawn and quantized
on the device and moved to the host, each block packed into the arena, shared between the processes of a
machine as ``load_blockwise(share=True)`` shares a loaded one.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
from typing import Any

import torch
from accelerate import init_empty_weights
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from lightning_blockwise.architectures import decoder_layers, no_decoder_stack
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.compat.flags import check_flag
from lightning_blockwise.loading.packing import (
    bind_shared_block,
    block_ranges,
    pack_block,
    predict_block_bytes,
    predict_slabs,
)
from lightning_blockwise.loading.random_draws import draw_in_order, random_linear
from lightning_blockwise.loading.sharing import scoped, share_enabled
from lightning_blockwise.residency import arena as arena_module
from lightning_blockwise.residency.arena import HostArena, slab_offsets
from lightning_blockwise.residency.placement import HostCopy, attach_host_copy
from lightning_blockwise.residency.sharing import attach_or_own, serve_or_release

log = logging.getLogger(__name__)

#: Bumped when what a shared random copy holds for the same key changes (the draws, their order, the fill rule).
_RANDOM_LAYOUT_VERSION = 1


def random_share_key(
    config: PretrainedConfig,
    seed: int,
    std: float,
    compute_dtype: torch.dtype,
    block_size: int,
    quantize: bool,
    device: torch.device,
) -> str:
    """What a random base's host copy is shared under: every input of its bytes (``load_blockwise``'s, for a config).

    The config (all of it, defaults included), the seed, ``std``, the dtype, the block size, NF4 or dense, the
    kind of device that draws and quantizes (a CPU and a GPU draw different numbers) and torch's version. Peers
    still compare every block's bytes (``bind_shared_block``).
    """
    parts: list[object] = [_RANDOM_LAYOUT_VERSION, "random", config.to_json_string(use_diff=False), seed, std]
    parts += [compute_dtype, block_size, "nf4" if quantize else "dense", device.type, torch.__version__]
    return hashlib.sha256("\n".join(map(str, parts)).encode()).hexdigest()


def random_blockwise(
    config: PretrainedConfig,
    *,
    seed: int = 0,
    compute_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    block_size: int = 1,
    std: float = 0.02,
    share: bool = True,
    progress: bool = True,
    quantize: bool = True,
    share_scope: str | None = None,
) -> PreTrainedModel:
    """A random-init model of ``config``'s shape, its decoder layers built one at a time straight into a host arena.

    The result keeps :func:`~lightning_blockwise.loading.load.load_blockwise`'s contract: every decoder layer's
    frozen tensors are views of a host arena laid out in blocks of ``block_size`` layers, every other module is on
    the CPU, the model is in train mode with ``is_loaded_in_4bit`` set (unless ``quantize=False``), and
    ``BlockwiseStrategy(block_size=block_size)`` reuses the arena instead of packing again. At most one linear's
    unquantized weight exists at a time (on ``device``), and the layers not built yet stay on the meta device.

    Its bytes are those of ``random_nf4_model(config, device, compute_dtype, std)`` built after
    ``torch.manual_seed(seed)``, for every architecture (NOTE [ Random draw order ] in random_draws.py). Layers
    holding other random parameters than linears (``qwen3_moe``'s fused 3-D experts) cost one extra pass of draws
    over the linears.
    The caller's RNG state is left as it was.

    Args:
        config: The model's config (a transformers config class or ``AutoConfig.from_pretrained(dir)``); not changed.
        seed: Seed of ``device``'s default generator for the draws.
        compute_dtype: The 4-bit linears' compute dtype and the dtype of every other parameter (as ``from_config``).
        device: Where to draw and quantize; defaults to the current CUDA device if there is one, else the CPU. The
            CPU and a GPU draw different numbers.
        block_size: Decoder layers per block; must equal the strategy's ``block_size`` for it to reuse the arena.
        std: Standard deviation of the random weights.
        share: Share the host copy with the other processes of this user on the machine that build the same base
            (same config, seed, std, dtype, block size, device kind: :func:`random_share_key`), as
            ``load_blockwise(share=True)`` does (NOTE [ One host copy per machine ] in residency/shared_arena.py).
        progress: Show a progress bar over the layers (bytes).
        quantize: NF4 linears (default); ``False``: dense linears holding the same draws, in ``compute_dtype``.
        share_scope: With ``share``, share only with the processes that build with the same scope (as
            ``load_blockwise``'s); ``None``: with any.

    Returns:
        The model, in train mode.

    Raises:
        MisconfigurationException: If ``share``, ``progress`` or ``quantize`` is not a bool (NOTE [ A string is not
            a flag ] in compat/flags.py), ``block_size`` is below 1, the model has no decoder stack or linears outside
            it other than the LM head, or the arena does not fit the available host RAM (checked before anything is
            drawn; the message says how many layers would fit).

    Example::

        config = transformers.MistralConfig(hidden_size=12288, num_hidden_layers=88, ...)  # Mistral-Large-2
        model = random_blockwise(config, seed=0, block_size=1)
        Trainer(strategy=BlockwiseStrategy(block_size=1), accelerator="gpu").fit(Module(model))
    """
    for name, flag in (("share", share), ("progress", progress), ("quantize", quantize)):
        check_flag("random_blockwise", name, flag)
    if block_size < 1:
        raise MisconfigurationException(
            f"random_blockwise(block_size={block_size}): a block holds at least 1 decoder layer; pass the strategy's"
            " `block_size`."
        )
    device = _resolve_device(device)
    key = (
        scoped(random_share_key(config, seed, std, compute_dtype, block_size, quantize, device), share_scope)
        if share_enabled(share)
        else None
    )
    # Not placed explicitly (the non-layer modules, computed buffers, the arena) is host memory, whatever the
    # caller's default device (Lightning's `configure_model` runs under `torch.device(root_device)`).
    with torch.device("cpu"):
        return _random_blockwise(
            copy.deepcopy(config), seed, compute_dtype, device, block_size, std, quantize, key, progress
        )


def _random_blockwise(
    config: PretrainedConfig,
    seed: int,
    compute_dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    std: float,
    quantize: bool,
    key: str | None,
    progress: bool,
) -> PreTrainedModel:
    start = time.perf_counter()
    # As `random_nf4_model`: parameters on the meta device, buffers computed by the model's own constructor.
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype)
    layers = _decoder_layers(model)
    linears = [[name for name, sub in layer.named_modules() if isinstance(sub, nn.Linear)] for layer in layers]
    meta = torch.device("meta")
    for layer, names in zip(layers, linears, strict=True):
        for name in names:  # the meta layers predict the arena: their linears converted as they will be
            layer.set_submodule(name, random_linear(layer.get_submodule(name), meta, compute_dtype, std, quantize))
    ranges = block_ranges(len(layers), block_size)
    share_claim, shared = attach_or_own(key, pin=device.type == "cuda")
    sizes, predicted = _predict(config, layers, ranges, check_ram=shared is None)
    host = shared if shared is not None else HostArena(sizes, pin=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    bar = tqdm(total=predicted, unit="B", unit_scale=True, desc="random_blockwise", disable=not progress)
    layouts = []
    last_of_block = {r[-1]: b for b, r in enumerate(ranges)}

    def pack(index: int) -> None:
        """Layer ``index`` is on the host: pack its block if it is the block's last (the arena, plus one block)."""
        bar.update(sum(t.nbytes for t in _frozen(layers[index])))
        if index in last_of_block:
            block = last_of_block[index]
            layouts.append(_pack(layers, ranges[block], host.slabs[block], shared is not None))

    generator = _generator(device)
    caller_state = generator.get_state()
    try:
        generator.manual_seed(seed)
        draw_in_order(model, layers, linears, device, compute_dtype, std, quantize, generator, pack)
    finally:
        generator.set_state(caller_state)
    bar.close()

    if getattr(model.config, "tie_word_embeddings", False) or getattr(
        model.config.get_text_config(), "tie_word_embeddings", False
    ):
        model.tie_weights()
    owner = serve_or_release(share_claim, host, {"random": type(config).__name__, "seed": seed, "blocks": len(ranges)})
    host_copy = HostCopy(layer_ranges=ranges, layouts=tuple(layouts), arena=host, block_size=block_size, serving=owner)
    attach_host_copy(model, host_copy)
    if quantize:
        model.is_loaded_in_4bit = True  # what PEFT reads to pick its bitsandbytes LoRA layer
        model.config.quantization_config = nf4_config(compute_dtype)
    model.train()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    log.info(
        f"random_blockwise: {len(layers)} random {'NF4' if quantize else 'dense'} {type(config).__name__} layers"
        f" (seed {seed}) in {time.perf_counter() - start:.1f} s; host arena {host.nbytes / 1e9:.3f} GB"
        f" ({len(ranges)} blocks of {block_size}, pinned={host.pinned},"
        f" {'not shared' if share_claim is None else 'mapped from another process' if shared else 'shared'});"
        f" build peak {peak / 1e9:.3f} GB allocated on {device}."
    )
    return model


def _frozen(layer: nn.Module) -> list[torch.Tensor]:
    return [*layer.parameters(), *layer.buffers()]


def _pack(layers: nn.ModuleList, layer_range: range, slab: torch.Tensor, shared: bool) -> Any:
    """Pack one built block into its slab, or check it against another process's copy and bind it."""
    if not shared:
        return pack_block(layers, layer_range, slab)
    try:
        return bind_shared_block(layers, layer_range, slab)
    except RuntimeError as error:
        raise RuntimeError(
            f"random_blockwise: the block of layers {layer_range[0]}-{layer_range[-1]} built here differs from the"
            " host copy another process shares under the same config, seed and settings (another bitsandbytes, or"
            " another kind of GPU?). Pass `share=False` to build a copy of this process's own."
        ) from error


def _predict(config: Any, layers: nn.ModuleList, ranges: tuple[range, ...], check_ram: bool) -> tuple[list[int], int]:
    """The arena's slab sizes (``predict_slabs``, the loader's one check); refused with the most layers that fit."""
    name = f"a random {type(config).__name__}"
    try:
        return predict_slabs(name, layers, ranges, check_ram=check_ram)  # type: ignore[arg-type]
    except MisconfigurationException as error:
        sizes = [predict_block_bytes([layers[i] for i in r]) for r in ranges]
        room = arena_module.available_host_memory() - arena_module.HOST_RAM_RESERVE
        blocks = max((b for b in range(len(ranges) + 1) if slab_offsets(sizes[:b])[-1] <= room), default=0)
        fit = ranges[blocks - 1].stop if blocks else 0
        raise MisconfigurationException(
            f"random_blockwise: {str(error).removeprefix('load_blockwise: ')} At this shape at most {fit} of the"
            f" {len(layers)} decoder layers fit: build `num_hidden_layers={fit}` (or fewer), or free host memory."
        ) from None


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = decoder_layers(model)
    if layers is None:
        raise MisconfigurationException(f"random_blockwise {no_decoder_stack(model, type(model).__name__)}.")
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    head = model.get_output_embeddings()
    outside = [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head and id(m) not in inside
    ]
    if outside:
        raise MisconfigurationException(
            f"random_blockwise: {', '.join(outside[:5])} are linears outside the decoder layers, which the host arena"
            " does not hold and `random_nf4_model` would quantize. Use `random_nf4_model` for this architecture."
        )
    return layers


def _resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` with its index (the generator is per device); default the current CUDA device, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _generator(device: torch.device) -> torch.Generator:
    """The default generator that ``torch.randn(..., device=device)`` draws from."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index]
    if device.type != "cpu":
        raise MisconfigurationException(f"random_blockwise(device={device}): draw on the CPU or a CUDA device.")
    return torch.default_generator


__all__ = ["random_blockwise", "random_share_key"]
