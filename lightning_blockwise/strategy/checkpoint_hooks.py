"""What ``BlockwiseStrategy``'s checkpoint hooks do: lean or full state dicts, checked loads, an exact resume."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.residency.placement import HostCopy
from lightning_blockwise.strategy.checkpointing import CHECKPOINT_KEY, FrozenBase
from lightning_blockwise.strategy.fit_loop import restart_iterator, restore_loader_states
from lightning_blockwise.strategy.streamed_stack import StreamedStack

# NOTE [ Loader state restored late ]
# Lightning puts a resumed run's loader state back when the fit loop builds its loader
# (`_FitLoop.setup_data`). A module whose `configure_optimizers` reads
# `trainer.estimated_stepping_batches` with `max_epochs` set (every warmup-cosine schedule of the
# recipes) makes Lightning build that loader there, in the strategy's setup, before the checkpoint
# is read; the state read afterwards waits for a loader that is never built again, and the run
# resumes from the start of its epoch (the demo CLI, resumed at step 28 with `max_epochs: 3`, trained
# other batches from step 29 on). So at train start, after the loops are restored and before the
# first batch, the strategy hands the waiting state to the loader and has the loop make its iterator
# again, as `setup_data` would have. It reads the fit loop's private attributes (NOTE [ The fit loop's
# private state ] in fit_loop.py); `tests/cli/test_resume.py` fails if they change.
#
# A checkpoint written at the end of an epoch has a second trap: the uninterrupted run makes the
# next epoch's loader iterator after it (the iterator draws its base seed from the global RNG),
# while the resumed run made its iterator when it set up its data, before the RNG states are put
# back; every random number of the resumed epoch was then one draw off (dropout masks differed from
# the first batch on). So after putting the states back the strategy makes that iterator again,
# with the samplers' epoch set first, as the uninterrupted run does (tests/distributed and
# tests/strategy/test_checkpointing.py, resumed after an epoch: exact, with controls). A step checkpoint
# (`every_n_train_steps`) written at an epoch's last batch is the same case under another restart
# stage: Lightning calls it mid-epoch and closes that epoch on resume (`_resumed_after_an_epoch`).


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
        """Record the format, the base and the RNG states now under :data:`CHECKPOINT_KEY` in ``checkpoint``.

        With several processes every rank calls this (Lightning saves on every rank and writes rank 0's), and
        the RNG states of all of them are recorded, one per rank (NOTE [ Exact resume ] in replay/rng.py).
        """
        if self.base is None:
            return
        meta = self.base.checkpoint_meta(include_base)
        if _distributed_is_initialized() and torch.distributed.get_world_size() > 1:
            states: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(states, meta["rng"])
            meta["rng_per_rank"] = states
        checkpoint[CHECKPOINT_KEY] = meta

    def load(
        self,
        module: nn.Module,
        checkpoint: Mapping[str, Any],
        strict: bool,
        layers: StreamedStack | None,
        host_copy: HostCopy | None = None,
        share_host_copy: bool | None = None,
        world_size: int = 1,
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
            host_copy: The host copy a checkpoint's frozen base is written into.
            share_host_copy: The strategy's ``share_host_copy``, said where a shared copy refuses the write.
            world_size: The run's processes, said there too.

        Raises:
            MisconfigurationException: If the checkpoint was written over another base, lacks trainable
                parameters, or (with ``strict``) has keys the module does not or lacks others; or carries the
                base while the host copy is another process's or serves others (:func:`check_base_write`).
        """
        assert self.base is not None
        if host_copy is not None and self.base.has_base(checkpoint.get("state_dict", {})):
            # NOTE [ One host copy per machine ] in residency/shared_arena.py: a copy mapped read-only, or one that
            # processes still read, is refused here, naming the option that shares it.
            check_base_write(host_copy, share_host_copy, world_size)
            host_copy.prepare_base_write(self.owner)
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
        restore_loader_states(fit_loop)

    @staticmethod
    def restart_epoch(fit_loop: Any) -> None:
        """After the RNG states are back, make a loader iterator again for a run resumed at an epoch's end.

        NOTE [ Loader state restored late ]; a no-op for a fresh run or one resumed mid-epoch.
        """
        if _resumed_after_an_epoch(fit_loop):
            restart_iterator(fit_loop)

    def resume_rng(self, checkpoint: Mapping[str, Any], rank: int = 0, world_size: int = 1) -> None:
        """Have :meth:`restore_rng` put back the RNG states ``checkpoint`` recorded (one resumed by ``fit``).

        Args:
            checkpoint: Lightning's checkpoint.
            rank: This process's global rank: with a checkpoint of as many ranks, it gets its own states back.
            world_size: The number of processes now.
        """
        if CHECKPOINT_KEY not in checkpoint:
            rank_zero_warn(
                f"{self.owner}: this checkpoint was not written by {self.owner} (it has no `{CHECKPOINT_KEY}` entry:"
                " `strategy='auto'` or another strategy wrote it), so it holds no random-number states. The resumed"
                " run continues from its weights, optimizer and loops, but its random numbers (dropout masks, a"
                " shuffle drawn from the global generator) are not those of the run that wrote it: the resume is not"
                " exact. For an exact resume, resume under the strategy that wrote the checkpoint (and checkpoint"
                f" under {self.owner} from now on)."
            )
        meta = checkpoint.get(CHECKPOINT_KEY) or {}
        per_rank = meta.get("rng_per_rank")
        self._rng_to_restore = meta.get("rng")
        if per_rank is not None and len(per_rank) == world_size:
            self._rng_to_restore = per_rank[rank]
        elif per_rank is not None or world_size > 1:
            written_by = len(per_rank) if per_rank is not None else 1
            rank_zero_warn(
                f"{self.owner}: this checkpoint was written by {written_by} process(es) and resumes on {world_size}:"
                " every rank starts from rank 0's random-number states and the data is sharded differently, so the"
                f" resumed run is not the one that wrote it. Resume with {written_by} process(es) for an exact resume."
            )

    def at_train_start(self, fit_loop: Any) -> None:
        """After every ``on_train_start`` hook, before the first batch: a resumed run's loader state, then its RNG.

        NOTE [ Loader state restored late ], then NOTE [ Exact resume ] in replay/rng.py.
        """
        self.resume_loader(fit_loop)
        if self.restore_rng():
            self.restart_epoch(fit_loop)

    def restore_rng(self) -> bool:
        """Put back the RNG states of the checkpoint :meth:`resume_rng` saw, once; whether there were any."""
        if self._rng_to_restore is None:
            return False
        # NOTE [ Exact resume ] in replay/rng.py. The strategy calls this after the loops, the data and
        # every `on_train_start` hook are set up and before the first batch is drawn, as where the
        # checkpoint was written.
        GlobalRngState.from_state_dict(self._rng_to_restore).restore()
        self._rng_to_restore = None
        return True


def check_base_write(copy: HostCopy, share_host_copy: bool | None, world_size: int) -> None:
    """Refuse a checkpoint's frozen base for a host copy that other processes read, saying why it is shared.

    Writing it would change the weights those processes train on (NOTE [ One host copy per machine ]). A copy
    that serves no process now is left to ``HostCopy.prepare_base_write``, which stops serving it.

    Raises:
        MisconfigurationException: Naming this process's part in the sharing, the option that shares, and the fix.
    """
    if copy.arena.read_only:
        part = "maps another process's host copy of the base read-only"
    else:
        peers = [] if copy.serving is None else copy.serving.peers()
        if not peers:
            return
        part = f"shares that copy with {len(peers)} other process(es) (pids {peers[:8]})"
    if share_host_copy is None and world_size > 1:
        why = f"`BlockwiseStrategy(share_host_copy=None)` (default) shares one copy among this run's {world_size} ranks"
    elif share_host_copy:
        why = "`BlockwiseStrategy(share_host_copy=True)` shares it with every process of this user that loads the base"
    else:
        why = "the model was loaded shared (`load_blockwise(share=True)`, its default)"
    raise MisconfigurationException(
        f"BlockwiseStrategy: this checkpoint carries the frozen base (it was saved with `save_frozen_base=True`), which"
        f" loading it writes into the host copy, but this process {part}: {why}. Pass"
        " `BlockwiseStrategy(share_host_copy=False)` (a model you load yourself: `load_blockwise(..., share=False)`)"
        " so that every process packs a copy of its own, or resume from a checkpoint saved without the base"
        " (`save_frozen_base=False`) if the run's base is the one on disk."
    )


def _resumed_after_an_epoch(fit_loop: Any) -> bool:
    """Whether the checkpoint was written after its epoch's last batch: at the epoch's end, or by a step interval.

    A checkpoint of `ModelCheckpoint(every_n_train_steps=k)` whose step k is an epoch's last batch is written in
    `on_train_batch_end`, before the epoch ends: Lightning restarts it "mid-epoch" and finishes that epoch at once
    (`_FitLoop.reset`), so the next epoch's iterator must be made again as for an epoch-end checkpoint
    (NOTE [ Loader state restored late ]).
    """
    if fit_loop.resumed_on_epoch_end or fit_loop.restarted_on_epoch_end:
        return True
    epoch_loop = fit_loop.epoch_loop
    return bool(
        fit_loop.restarted_mid_epoch
        and epoch_loop.restarted_on_train_batch_end
        and epoch_loop.batch_progress.is_last_batch
    )


__all__ = ["CheckpointHooks", "check_base_write"]
