"""``ParityCheck``: at fit start, one training step's loss and adapter gradients, resident vs blockwise.

A thin Lightning callback over :mod:`lightning_blockwise.verification`, which runs and compares the step.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_blockwise.compat.lightning_namespaces import FollowsTrainer, follow
from lightning_blockwise.planning import parse_bytes
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy
from lightning_blockwise.verification import ParityError, ParityResult, TensorMismatch, check_step, first_batch


class ParityCheck(FollowsTrainer, Callback):
    """Check at fit start that one blockwise training step is bit-identical to the resident one.

    Before the first training step the callback runs the module's ``training_step`` on the
    first training batch and a backward twice from the same state: once with the decoder
    layers resident (their own forward, plain autograd, weights on the device) and once
    rematerialized and streamed by :class:`~lightning_blockwise.BlockwiseStrategy`. It
    compares the loss and every adapter gradient with ``torch.equal``. On a mismatch it
    reruns the resident arm to tell a nondeterministic stack from a broken replay. The run
    afterwards is as if the check had never run (NOTE [ Parity check leaves no trace ] in
    verification/check.py). When the resident reference does not fit, only the leading blocks that
    do are checked (NOTE [ Prefix parity ] in verification/check.py); :meth:`ParityResult.scope`
    says what was checked. The steps run in :func:`~lightning_blockwise.verification.check_step`.

    The result is logged once to every logger of the Trainer (at ``trainer.global_step``)
    and kept in the callback's state, so a resumed run does not check again unless
    ``always=True``. Logged keys:

    - ``parity/passed``: 1.0 when every tensor was equal, else 0.0 (also 0.0 when nothing fit).
    - ``parity/checked_layers`` / ``parity/num_layers``: decoder layers checked, of all.
    - ``parity/mismatches``: tensors that differ.
    - ``parity/nondeterministic``: 1.0 when the resident arm disagreed with itself.
    - ``parity/peak_vram_bytes``: peak allocated device memory during the check (CUDA only).

    Args:
        batch: The batch to check on, as the dataloader yields it (moved to the device here);
            by default the first batch of the training dataloader.
        on_mismatch: ``"raise"`` a :class:`ParityError` before any training step, or ``"warn"`` and train.
        max_reference_bytes: Cap on the extra device bytes the resident reference may use (bytes or
            ``"2GiB"``); also bounded by the free device memory and the headroom under the strategy's
            ``vram_budget`` (:meth:`~lightning_blockwise.BlockwiseStrategy.reference_headroom`).
        always: Check even when the loaded state says a previous run already did.

    Raises:
        MisconfigurationException: If ``on_mismatch`` is unknown, the Trainer's strategy is not a
            ``BlockwiseStrategy``, or the module uses manual optimization.

    Example::

        from lightning_blockwise.callbacks.parity import ParityCheck

        trainer = Trainer(strategy="blockwise", deterministic=True, callbacks=[ParityCheck()])
        trainer.fit(module)  # raises ParityError before the first step if blockwise != resident
    """

    def __init__(
        self,
        batch: Any = None,
        on_mismatch: Literal["raise", "warn"] = "raise",
        max_reference_bytes: int | str | None = None,
        always: bool = False,
    ) -> None:
        if on_mismatch not in ("raise", "warn"):
            raise MisconfigurationException(
                f"`ParityCheck(on_mismatch={on_mismatch!r})` is not supported. Use 'raise' or 'warn'."
            )
        self.batch = batch
        self.on_mismatch = on_mismatch
        try:
            self.max_reference_bytes = None if max_reference_bytes is None else parse_bytes(max_reference_bytes)
        except ValueError as error:
            raise MisconfigurationException(
                f"`ParityCheck(max_reference_bytes={max_reference_bytes!r})`: {error}"
            ) from None
        self.always = always
        self.result: ParityResult | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if follow(self, trainer):  # NOTE [ Two Lightning namespaces ]: now the twin, whose own setup runs
            return self.setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, BlockwiseStrategy):
            raise MisconfigurationException(
                f"`ParityCheck` compares blockwise with resident training and needs `BlockwiseStrategy`, but the"
                f" Trainer uses `{type(trainer.strategy).__name__}`. Use `Trainer(strategy='blockwise')` or drop"
                " the callback."
            )
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "`ParityCheck` runs `training_step` without stepping the optimizer, which manual optimization"
                " does inside `training_step`. Drop the callback or use automatic optimization."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.result is not None and not self.always:
            rank_zero_info(f"ParityCheck: already checked in this run's history, skipping. {self.result.scope()}")
            return
        strategy = trainer.strategy
        assert isinstance(strategy, BlockwiseStrategy)
        self.result = self._check(trainer, pl_module, strategy)
        for logger in trainer.loggers:
            logger.log_metrics(self.result.metrics(), step=trainer.global_step)
        report = self.result.report()
        if self.result.passed is False:
            if self.on_mismatch == "raise":
                raise ParityError(report)
            rank_zero_warn(report)
        elif self.result.passed is None:
            rank_zero_warn(report)
        else:
            rank_zero_info(report)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"result": None if self.result is None else asdict(self.result)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        result = state_dict.get("result")
        self.result = None if result is None else ParityResult.from_dict(result)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: BlockwiseStrategy) -> ParityResult:
        limits = [b for b in (self.max_reference_bytes, strategy.reference_headroom()) if b is not None]
        return check_step(
            strategy,
            pl_module,
            batch=lambda: self.batch if self.batch is not None else first_batch(trainer),
            limit=min(limits) if limits else None,
        )


__all__ = ["ParityCheck", "ParityError", "ParityResult", "TensorMismatch"]
