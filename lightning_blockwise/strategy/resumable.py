"""The strategy's checkpoint hooks: lean or full state dicts, unbuffered saves, checked loads, an exact resume.

What a checkpoint holds is decided in checkpointing.py and checkpoint_hooks.py; these are the Lightning
``Strategy`` hooks that hand them the module and the files, mixed into
:class:`~lightning_blockwise.BlockwiseStrategy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_blockwise.residency.placement import HostCopy
from lightning_blockwise.strategy.accumulation import BlockMajorSteps
from lightning_blockwise.strategy.checkpoint_files import check_checkpoint_file, save_unbuffered
from lightning_blockwise.strategy.checkpoint_hooks import CheckpointHooks
from lightning_blockwise.strategy.data_parallel import DataParallelStrategy
from lightning_blockwise.strategy.streamed_stack import StreamedStack


class ResumableStrategy(DataParallelStrategy):
    """Checkpoint and resume hooks of :class:`~lightning_blockwise.BlockwiseStrategy`, over its set-up state."""

    _checkpoints: CheckpointHooks
    _host_copy: HostCopy | None
    _layers: StreamedStack | None
    _block_major: BlockMajorSteps | None
    save_frozen_base: bool
    share_host_copy: bool | None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A checkpoint's frozen tensors (`save_frozen_base=True`) go into the host arena, and its base
        # fingerprint is compared with the packed base's: both exist only after setup.
        return True

    @property
    def base_fingerprint(self) -> str | None:
        """The fingerprint of the frozen base that checkpoints record; set at setup.

        See NOTE [ Lean checkpoints ] in checkpointing.py.
        """
        return self._checkpoints.fingerprint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The state dict without the frozen base, or with it read from the host copy.

        See NOTE [ Lean checkpoints ] in checkpointing.py.
        """
        return self._checkpoints.state_dict(super().lightning_module_state_dict(), self.save_frozen_base)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if self._block_major is not None:
            self._block_major.checkpoint_loader_state(checkpoint)
        self._checkpoints.record(checkpoint, self.save_frozen_base)
        own_write = type(self.checkpoint_io) is TorchCheckpointIO and storage_options is None and _is_local(filepath)
        if not (self.is_global_zero and own_write):
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # Lean and full-state checkpoints alike (a `CheckpointIO` plugin of the user's writes as it wants).
        # Lightning's `TorchCheckpointIO` serializes into an in-memory buffer first, which for a full-state
        # checkpoint would copy the whole base in host RAM; and fsspec stages the file in the system's temporary
        # directory and moves it into place, which across file systems is a copy under the final name: a full disk
        # left a truncated checkpoint there. Ours is written beside its final name and renamed when complete.
        save_unbuffered(checkpoint, Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        # A bad `ckpt_path` fails naming the file and the problem, not deep inside torch's unpickler.
        check_checkpoint_file(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a lean or full checkpoint into the set-up module; refuse one of another base.

        See :meth:`~lightning_blockwise.strategy.checkpoint_hooks.CheckpointHooks.load`.

        Raises:
            MisconfigurationException: If the checkpoint was written over another base, lacks trainable
                parameters, or (with ``strict``) has keys the module does not or lacks others.
        """
        if self._checkpoints.base is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        read_only = self._host_copy is not None and self._host_copy.arena.read_only
        if self._host_copy is not None and self._checkpoints.base.has_base(checkpoint.get("state_dict", {})):
            # NOTE [ One host copy per machine ] in residency/shared_arena.py.
            _check_base_write(self._host_copy, self.share_host_copy, self.world_size)
            self._host_copy.prepare_base_write("BlockwiseStrategy")
        self._checkpoints.load(self.lightning_module, checkpoint, strict, self._layers, read_only)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._checkpoints.resume_rng(checkpoint, self.global_rank, self.world_size)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # NOTE [ Loader state restored late ] in checkpoint_hooks.py, then NOTE [ Exact resume ] in replay/rng.py:
        # after every `on_train_start` hook, before the first batch.
        fit_loop = self.lightning_module.trainer.fit_loop
        self._checkpoints.resume_loader(fit_loop)
        if self._checkpoints.restore_rng():
            self._checkpoints.restart_epoch(fit_loop)


def _check_base_write(copy: HostCopy, share_host_copy: bool | None, world_size: int) -> None:
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


def _is_local(path: str | Path) -> bool:
    return "://" not in str(path)


__all__ = ["ResumableStrategy"]
