"""How ``CausalLMFineTune`` builds its model: refusals before the base loads, then base, adapters, kernels and tiles.

What :meth:`~lightning_blockwise.recipes.finetune.CausalLMFineTune.configure_model` runs, in this order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel

from lightning_blockwise.adapters.dora_norm import factor_dora_norms
from lightning_blockwise.export.training_record import TrainingRecord
from lightning_blockwise.longcontext.attention import tile_attention
from lightning_blockwise.longcontext.tiling import tile_mlps
from lightning_blockwise.recipes import base_record
from lightning_blockwise.recipes.finetune_model import (
    add_adapters,
    check_adapter_dir,
    check_attention_tiles,
    load_base,
)
from lightning_blockwise.recipes.kernel_choice import (
    check_fused_lora_adapter,
    check_kernels_device,
    install_kernels,
    resolve_auto,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.parsing import AttributeDict


def build_model(
    hp: AttributeDict,
    choice: frozenset[str] | None,
    record: TrainingRecord,
    mlp_tile_tokens: int | None,
    attention_tile_tokens: int | None,
    trainer: pl.Trainer | None,
) -> tuple[PeftModel, list[str]]:
    """The recipe's model with its adapters, kernels and tiles, in train mode, and the kernels it installed (sorted).

    Args:
        hp: ``CausalLMFineTune``'s hyperparameters.
        choice: Its kernels (:func:`~lightning_blockwise.recipes.kernel_choice.kernel_choice`; ``None``: ``"auto"``).
        record: Its base as checkpoints record it (checked against ``adapter_path``'s).
        mlp_tile_tokens: Its ``mlp_tile_tokens``.
        attention_tile_tokens: Its ``attention_tile_tokens``.
        trainer: The Trainer it is attached to, if any.

    Raises:
        MisconfigurationException: If what is asked cannot be built (most of it before the base loads).
    """
    if hp.adapter_path is not None:
        # Before the base loads (minutes at 72B), not after.
        check_adapter_dir(hp.adapter_path)
        check_fused_lora_adapter(choice, hp.adapter_path)
        base_record.check_adapter_base(hp.adapter_path, record, hp.allow_other_base)
    strategy = trainer.strategy if trainer is not None else None
    # Before the base loads; Liger's installed forwards would refuse the first batch anyway.
    device_type = None if strategy is None else strategy.root_device.type
    check_kernels_device(choice, device_type)
    if attention_tile_tokens is not None:
        datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
        check_attention_tiles(hp.checkpoint, attention_tile_tokens, datamodule)
    base = load_base(hp.checkpoint, hp.loader, hp.compute_dtype, hp.quantize, hp.random_init, strategy)
    model = add_adapters(
        base, hp.adapter_path, hp.lora_r, hp.lora_alpha, hp.lora_dropout, hp.target_modules, hp.use_dora
    )
    if hp.dora_norm == "factored":
        factor_dora_norms(model)
    kernels = choice
    if kernels is None:  # "auto": decided once, here, so every strategy trains the same function
        kernels = resolve_auto(model, device_type, mlp_tile_tokens)
    install_kernels(model, kernels, mlp_tiled=mlp_tile_tokens is not None)
    if mlp_tile_tokens is not None:
        # Under every strategy, so that blockwise and resident runs train the same function.
        tile_mlps(model, mlp_tile_tokens)
    if attention_tile_tokens is not None:
        try:
            tile_attention(model, attention_tile_tokens)
        except ValueError as error:
            raise MisconfigurationException(
                f"CausalLMFineTune(attention_tile_tokens={attention_tile_tokens}): {error}"
            ) from None
    # `from_pretrained` returns eval mode and Lightning keeps the modes it finds; training wants train mode
    # (dropout, and bitsandbytes' CPU kernel choice: NOTE [ bitsandbytes CPU inference kernel ] in
    # compat/bitsandbytes/cpu_kernel.py).
    model.train()
    return model, sorted(kernels)


__all__ = ["build_model"]
