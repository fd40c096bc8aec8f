"""What ``BlockwiseStrategy``'s checkpoint hooks do: lean or full state dicts, checked loads, an exact resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise.checkpointing import CHECKPOINT_KEY, FrozenBase
from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.streamed_stack import StreamedStack

# NOTE [ Loader state restored late ]
# Lightning puts a resumed run's loader state back when the fit loop builds its loader
# (`_FitLoop.setup_data`). A module whose `configure_optimizers` reads
# `trainer.estimated_stepping_batches` with `max_epochs` set (every warmup-cosine schedule of the
# recipes) makes Lightning build that loader there, in the strategy's setup, before the checkpoint
# is read; the state read afterwards waits for a loader that is never built again, and the run
# resumes from the start of its epoch (the demo CLI, resumed at step 28 with `max_epochs: 3`, trained
# other batches from step 29 on). So at train start, after the loops are restored and before the
# first batch, the strategy hands the waiting state to the loader and has the loop make its iterator
# again, as `setup_data` would have. It reads the fit loop's private attributes (Lightning 2.6);
# `tests/cli/test_resume.py` fails if they change.


class CheckpointHooks:
    """A run's checkpoints as the strategy writes and reads them, through the module's :class:`FrozenBase`.

    A checkpoint leaves the frozen base out, or reads it from the host copy, and records the base's
    fingerprint and the RNG states (NOTE [ Lean checkpoints ] in checkpointing.py); a checkpoint loaded
    for fitting has its RNG states put back before the first batch (NOTE [ Exact resume ] in replay/rng.py).
    Until the module is set up (:attr:`base` is ``None``) the strategy does what Lightning does.

    Args:
        owner: How errors name the strategy, e.g. ``"BlockwiseStrategy"``.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        #: The set-up module's frozen base: built after the decoder layers were packed into the host
        #: arena and before any block is bound to the device (the fingerprint reads the host copy).
        self.base: FrozenBase | None = None
        self._rng_to_restore: dict[str, Any] | None = None

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the frozen base that checkpoints record, once set up."""
        return None if self.base is None else self.base.fingerprint

    def state_dict(self, state: dict[str, Any], include_base: bool) -> dict[str, Any]:
        """The module's ``state`` without the frozen base, or with it read from the host copy.

        Args:
            state: The module's state dict as Lightning collects it.
            include_base: Whether checkpoints carry the frozen base (``save_frozen_base``).
        """
        return state if self.base is None else self.base.checkpoint_state(state, include_base=include_base)

    def record(self, checkpoint: dict[str, Any], include_base: bool) -> None:
        """Record the format, the base and the RNG states now under :data:`CHECKPOINT_KEY` in ``checkpoint``."""
        if self.base is not None:
            checkpoint[CHECKPOINT_KEY] = self.base.checkpoint_meta(include_base)

    def load(
        self, module: nn.Module, checkpoint: Mapping[str, Any], strict: bool, layers: StreamedStack | None
    ) -> None:
        """Load a lean or full checkpoint into the set-up ``module``; refuse one of another base.

        Frozen decoder tensors go into the host arena (:meth:`FrozenBase.take_checkpoint`), the rest
        through ``module.load_state_dict``. Missing frozen-base keys are expected; missing trainable
        keys are an error whatever ``strict`` says, since training would silently restart them.

        Args:
            module: The LightningModule.
            checkpoint: Lightning's checkpoint.
            strict: Refuse keys the module does not have or lacks.
            layers: The streamed decoder layers, whose resident blocks copy a loaded base again.

        Raises:
            MisconfigurationException: If the checkpoint was written over another base, lacks trainable
                parameters, or (with ``strict``) has keys the module does not or lacks others.
        """
        assert self.base is not None
        try:
            state, has_base = self.base.take_checkpoint(checkpoint)
        except ValueError as error:
            raise MisconfigurationException(f"{self.owner}: {error}") from None
        if has_base and layers is not None:
            # Blocks kept resident on the device hold copies of the old bytes: copy them again.
            layers.restream()
        result = module.load_state_dict(state, strict=False)
        if has_base:
            self.base.refresh()
        mismatch = self.base.mismatch(result.missing_keys, result.unexpected_keys)
        if strict and mismatch:
            raise MisconfigurationException(f"{self.owner}: {mismatch}")

    @staticmethod
    def resume_loader(fit_loop: Any) -> None:
        """Give a resumed run's loader the state read after it was built (NOTE [ Loader state restored late ])."""
        if not fit_loop._combined_loader_states_to_load or fit_loop._combined_loader is None:
            return
        fit_loop._load_combined_loader_states()
        if fit_loop._data_fetcher is not None:
            # A stateful loader applies a loaded state when it is iterated next.
            fit_loop._data_fetcher.setup(fit_loop._combined_loader)
            iter(fit_loop._data_fetcher)

    def resume_rng(self, checkpoint: Mapping[str, Any]) -> None:
        """Have :meth:`restore_rng` put back the RNG states ``checkpoint`` recorded (one resumed by ``fit``)."""
        self._rng_to_restore = (checkpoint.get(CHECKPOINT_KEY) or {}).get("rng")

    def restore_rng(self) -> None:
        """Put back the RNG states of the checkpoint :meth:`resume_rng` saw, once."""
        if self._rng_to_restore is not None:
            # NOTE [ Exact resume ] in replay/rng.py. The strategy calls this after the loops, the data and
            # every `on_train_start` hook are set up and before the first batch is drawn, as where the
            # checkpoint was written.
            GlobalRngState.from_state_dict(self._rng_to_restore).restore()
            self._rng_to_restore = None


__all__ = ["CheckpointHooks"]
