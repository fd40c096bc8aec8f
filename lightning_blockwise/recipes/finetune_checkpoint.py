"""What ``CausalLMFineTune``'s checkpoints record beside the adapters, and what a resumed fit does with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_blockwise.export.adapter import clean_export_leftovers
from lightning_blockwise.export.training_record import CHECKPOINT_RECORD_KEY, TrainingRecord
from lightning_blockwise.recipes.optimizers import OPTIMIZER_KEY, check_resumed_optimizer

#: The checkpoint key of the kernels the model computed with
#: (:meth:`~lightning_blockwise.recipes.finetune.CausalLMFineTune.on_load_checkpoint`).
_KERNELS_KEY = "lightning_blockwise_kernels"
#: The checkpoint key of where the run exports its adapter (NOTE [ A resume cleans its run's export ] in
#: export/adapter.py).
_ADAPTER_DIR_KEY = "lightning_blockwise_adapter_dir"


def record_run(
    checkpoint: dict[str, Any],
    optimizer: str,
    export_target: Path | None,
    installed_kernels: list[str] | None,
    record: TrainingRecord | None,
) -> None:
    """Write into ``checkpoint`` the module's optimizer, and its export target, kernels and base where it has them."""
    checkpoint[OPTIMIZER_KEY] = optimizer
    if export_target is not None:
        checkpoint[_ADAPTER_DIR_KEY] = str(export_target)
    if installed_kernels is not None:
        checkpoint[_KERNELS_KEY] = installed_kernels
    if record is not None:
        checkpoint[CHECKPOINT_RECORD_KEY] = record.to_dict()


def recorded_kernels(checkpoint: dict[str, Any]) -> list[str] | None:
    """The kernels ``checkpoint``'s model computed with; ``None`` where it does not record them."""
    return checkpoint.get(_KERNELS_KEY)


def resume_fit(checkpoint: dict[str, Any], optimizer: str, is_global_zero: bool) -> None:
    """Refuse to resume the fit of ``checkpoint`` with another optimizer, and clean what its killed export left.

    The optimizer is checked before Lightning loads its state (NOTE [ An optimizer's state resumes into its own kind
    only ] in recipes/optimizers.py); global rank 0 removes what a killed export of the checkpoint's run left beside
    its adapter directory (NOTE [ A resume cleans its run's export ] in export/adapter.py).

    Raises:
        MisconfigurationException: If ``optimizer`` is not the one the checkpoint's optimizer state belongs to.
    """
    check_resumed_optimizer(checkpoint, optimizer)
    if is_global_zero and checkpoint.get(_ADAPTER_DIR_KEY):
        clean_export_leftovers(checkpoint[_ADAPTER_DIR_KEY])  # NOTE [ A resume cleans its run's export ]


__all__ = ["record_run", "recorded_kernels", "resume_fit"]
