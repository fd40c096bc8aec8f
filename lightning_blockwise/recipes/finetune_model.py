"""The fine-tuning recipe's model: its frozen base, loaded (or built) for the strategy, and its adapters.

What :meth:`~lightning_blockwise.recipes.finetune.CausalLMFineTune.configure_model` builds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.loading.random_base import random_blockwise
from lightning_blockwise.loading.sharing import run_scope
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy


def load_base(
    checkpoint: str, loader: str, compute_dtype: str, quantize: bool, random_init: bool, strategy: Strategy | None
) -> torch.nn.Module:
    """The frozen base of ``checkpoint``: random (``random_init``), packed for ``BlockwiseStrategy``, or standard.

    A random base for ``BlockwiseStrategy`` (unless ``loader="standard"``) is built by ``random_blockwise``, one
    layer at a time into the host arena; other strategies get ``random_nf4_model`` on their device. Both draw the
    same bytes from ``torch.initial_seed()`` (``seed_everything``'s seed) and leave the global RNGs as they found
    them, so the adapters' initialisation and the dropout masks that follow are the same under every strategy
    (blockwise == resident for the recipe's module).

    Args are ``CausalLMFineTune``'s; ``strategy`` is the Trainer's (``None``: no Trainer, the CPU).

    Raises:
        MisconfigurationException: If ``loader="blockwise"`` is asked for under another strategy.
    """
    device = strategy.root_device if strategy is not None else torch.device("cpu")
    dtype = getattr(torch, compute_dtype)
    blockwise = isinstance(strategy, BlockwiseStrategy)
    if loader == "blockwise" and not blockwise:
        raise MisconfigurationException(
            "CausalLMFineTune(loader='blockwise') packs the decoder layers into host memory, which only"
            " `BlockwiseStrategy` trains from. Use `strategy: blockwise`, or `loader: auto`."
        )
    if random_init:
        config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
        if blockwise and loader != "standard":
            assert isinstance(strategy, BlockwiseStrategy)
            # Layer by layer into the host arena, never the whole model on the device; seeded by `seed_everything`
            # (its seed, so that the ranks of a machine build one copy, and share it as the strategy says).
            return random_blockwise(
                config,
                seed=torch.initial_seed(),
                compute_dtype=dtype,
                device=device,
                block_size=strategy.options.block_size,
                quantize=quantize,
                **host_copy_sharing(strategy),
            )
        # What `random_blockwise` does: seeded by `seed_everything`'s seed, the caller's RNG state left as it was.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(torch.initial_seed())
            return random_nf4_model(config, device, compute_dtype=dtype, quantize=quantize)
    if blockwise and loader != "standard":
        assert isinstance(strategy, BlockwiseStrategy)
        return load_blockwise(
            checkpoint,
            compute_dtype=dtype,
            device=device,
            block_size=strategy.options.block_size,
            quantize=quantize,
            **host_copy_sharing(strategy),
        )
    return AutoModelForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=nf4_config(dtype) if quantize else None,
        device_map={"": device},
        dtype=dtype,
        local_files_only=True,
    )


def host_copy_sharing(strategy: BlockwiseStrategy) -> dict[str, Any]:
    """``load_blockwise``'s sharing arguments for what ``BlockwiseStrategy(share_host_copy=...)`` asks.

    The loader packs the host copy the strategy then trains from, so the strategy's option decides whether it is
    shared (NOTE [ One host copy per machine ] in residency/shared_arena.py): ``False``, never (each process its own
    copy, which a checkpoint carrying the frozen base can be written into); ``True``, with any process of this user
    that loads the same base; ``None``, with this run's other ranks only, and not at all in a run of one process.
    """
    option = strategy.options.share_host_copy
    if option is None:
        return {"share": strategy.is_distributed, "share_scope": run_scope()}
    return {"share": bool(option), "share_scope": None}


def add_adapters(
    base: torch.nn.Module,
    adapter_path: str | None,
    lora_r: int,
    lora_alpha: int,
    lora_dropout: float,
    target_modules: list[str] | None,
    use_dora: bool,
) -> PeftModel:
    """``base`` with the adapters of ``adapter_path`` (trainable), else new LoRA (or DoRA) adapters on its decoder."""
    if adapter_path is not None:
        # The adapter's own config decides its shape; trainable, so that `fit` continues it.
        return PeftModel.from_pretrained(base, adapter_path, is_trainable=True, local_files_only=True)
    lora = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=_decoder_linears(base, target_modules),
        use_dora=use_dora,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(base, lora)


def check_adapter_dir(path: str) -> None:
    """Refuse an ``adapter_path`` that is not a PEFT adapter directory, saying what it should hold."""
    if not (Path(path) / "adapter_config.json").is_file():
        raise MisconfigurationException(
            f"CausalLMFineTune(adapter_path={path!r}) holds no adapter_config.json. Give a PEFT adapter directory,"
            " e.g. a run's `<log_dir>/adapter` or `lightning-blockwise export RUN.ckpt BASE OUT`'s OUT."
        )


def _decoder_linears(model: torch.nn.Module, names: list[str] | None) -> str:
    """A PEFT ``target_modules`` pattern for the linears named ``names`` (default: all) inside the decoder layers.

    PEFT's ``"all-linear"`` would also put adapters on a multimodal model's vision tower, whose
    ``q_proj`` and friends share the decoder's names; anchoring the pattern at the decoder's
    ``layers`` keeps the adapters where ``lightning-blockwise plan`` counts them.
    """
    layers = find_decoder_stack(model, allow_unvalidated=True).layers
    prefix = next(name for name, module in model.named_modules() if module is layers)
    leaves = names or sorted(
        {name.rsplit(".", 1)[-1] for name, module in layers.named_modules() if isinstance(module, torch.nn.Linear)}
    )
    # PEFT matches a string with `re.fullmatch` against each module's qualified name.
    return rf"{re.escape(prefix)}\.\d+\.(.*\.)?({'|'.join(map(re.escape, leaves))})"


def check_attention_tiles(checkpoint: str, tile_tokens: int, datamodule: object | None) -> None:
    """Refuse, before the base loads, what tiled attention would refuse at the first long batch.

    The checkpoint's config says whether its attention applies dropout, and the data module whether it packs rows
    (packed rows need a mask; NOTE [ Tiled attention ] in longcontext/attention.py). ``tile_attention`` checks the
    built model again, and the loss each batch: this only moves the refusal before minutes of loading.

    Args:
        checkpoint: The checkpoint directory (its ``config.json`` is read, no weights).
        tile_tokens: The module's ``attention_tile_tokens``.
        datamodule: The Trainer's data module, if any.

    Raises:
        MisconfigurationException: If the config has attention dropout or the data module packs its rows.
    """
    where = f"CausalLMFineTune(attention_tile_tokens={tile_tokens})"
    hparams = getattr(datamodule, "hparams", None)
    packing = getattr(datamodule, "packing", None)
    if packing is None and isinstance(hparams, Mapping):
        packing = hparams.get("packing")
    if packing:
        raise MisconfigurationException(
            f"{where}: the data module packs its rows (`packing=True`), and packed rows need a mask that keeps their"
            " examples apart, which tiled attention does not compute (NOTE [ Tiled attention ] in"
            " longcontext/attention.py). Turn off the data module's `packing`, or set attention_tile_tokens to None."
        )
    try:
        config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    except (OSError, ValueError):
        return  # loading the base says what is wrong with the checkpoint
    dropout = getattr(config.get_text_config(), "attention_dropout", 0.0) or 0.0
    if dropout:
        raise MisconfigurationException(
            f"{where}: the checkpoint's config applies attention dropout ({dropout}), which tiled attention does not."
            " Set `attention_dropout=0.0` in its config.json, or set attention_tile_tokens to None."
        )


__all__ = ["add_adapters", "check_adapter_dir", "check_attention_tiles", "host_copy_sharing", "load_base"]
