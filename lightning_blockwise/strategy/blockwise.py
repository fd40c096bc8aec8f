"""``BlockwiseStrategy``: Lightning hooks that put rematerializing, streamable decoder layers in place."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_blockwise.compat.versions import warn_if_untested
from lightning_blockwise.strategy.checkpoint_files import check_checkpoint_file, save_unbuffered, writes_itself
from lightning_blockwise.strategy.checkpoint_hooks import CheckpointHooks
from lightning_blockwise.strategy.device_memory import check_cap
from lightning_blockwise.strategy.module_placement import ModulePlacement
from lightning_blockwise.strategy.options import CARD, BlockwiseOptions
from lightning_blockwise.strategy.queries import BlockwiseQueries
from lightning_blockwise.strategy.run import BlockwiseRun, CheckedModule, budget_owner, check_module
from lightning_blockwise.strategy.step_planner import budget_errors


class BlockwiseStrategy(BlockwiseQueries):
    """Train PEFT adapters on a frozen Hugging Face decoder stack that is rematerialized layer by layer.

    After the usual single-device setup the strategy finds the decoder layers of the Hugging Face model inside
    the LightningModule and installs on each (in place, the class untouched) a forward that runs without building
    a graph, keeping only the layer input, its RNG state and its call arguments; the backward recomputes the layer
    from them and differentiates it. Training is bit-identical to ``strategy="auto"``. Weights are grouped into
    blocks of ``block_size`` layers, the unit in which the residency moves them. The Trainer sets the accelerator,
    the devices and the processes; the README's option table says when to set each of the others.

    Args:
        block_size: Decoder layers per block: larger blocks make fewer, larger copies.
        prefetch_depth: Blocks fetched ahead of the one in use when weights stream, so copies hide behind compute.
        vram_budget: The device memory the run may take. ``"card"`` (default): what this process may use of the
            card at setup, less a margin (NOTE [ The card as the default budget ] in device_memory.py). Bytes or a
            size like ``"16GiB"``: also the caching allocator's per-process cap, for a card shared with other jobs
            (NOTE [ A budget is a cap on the card ] in planning/memory.py). Blocks that fit under it with the step's
            predicted peak and 10% headroom stay on the device for the whole run. ``None``: every block streams and
            every layer is recomputed (the least device memory). On the CPU a set budget has no effect.
        budget_tokens: Tokens per micro-batch to plan for at setup. Default: the data module's ``max_length`` x
            ``batch_size``, else the first training batch's, read ahead (NOTE [ The first batch read ahead ] in
            step_tokens.py), else 2048. A longer batch is planned for before its step runs (NOTE [ A budget that
            sees the batches ] in planning/step_budget.py).
        offload_activations: Keep each layer's saved input in pinned host memory between forward and backward
            (NOTE [ Layer-input offload ] in residency/activations.py). ``None``: with a budget and
            ``input_checkpoint_every`` unset, the plan chooses how many layers' inputs wait in host memory and one
            kept in how many, before each longer batch too, and refuses at setup what fits no way under a set
            ``vram_budget`` (NOTE [ Where layer inputs wait ] in planning/input_choice.py); without a budget, on
            where the step would not fit the device otherwise. ``True``/``False`` force it; an integer ``m``
            offloads the first ``m`` layers' inputs only (NOTE [ Split layer inputs ]).
        keep_activations: With a budget, recomputed layers first keep their attention outputs where that is worth
            it (NOTE [ Kept attention ] in replay/kept_attention.py), then blocks whose layers' graphs fit keep them
            and are not recomputed (faster). ``False`` spends the budget on resident blocks only, better where the
            step waits on the host link (NOTE [ Kept activations ] in planning/memory.py).
        allow_unvalidated: Accept architectures outside
            :data:`~lightning_blockwise.architectures.VALIDATED_MODEL_TYPES`.
        save_frozen_base: Write the frozen base into checkpoints too (a self-contained file), not only what
            training changes and a fingerprint of the base (NOTE [ Lean checkpoints ] in checkpointing.py).
        input_checkpoint_every: Keep the saved input of one layer in ``k`` only; the backward replays each segment
            of ``k`` layers forward from its kept input (NOTE [ Input checkpoints ] in replay/segments.py): exact,
            about a third more weight traffic. ``None``: every input kept, unless the plan chooses ``k``.
        block_major_accumulation: With ``accumulate_grad_batches=G``, copy each block once for a window's G forwards
            and once for their backwards, instead of G times each (NOTE [ Block-major accumulation ] in
            replay/block_major.py; NOTE [ A window's batches ] in accumulation.py). Exact, on one device or several;
            needs dropout 0 in the decoder and automatic optimization; nothing kept or offloaded.
        share_host_copy: Share the host copy of the base with the machine's other processes that pack the same base
            (NOTE [ One host copy per machine ] in residency/shared_arena.py): ``None`` (default) among this run's
            ranks, ``True`` with any process of this user (concurrent jobs), ``False`` never.
        accelerator: The accelerator (set by the Trainer).
        device: The one device to train on, for a strategy built by hand (else the Trainer's ``devices``).
        parallel_devices: The devices of this node's processes, one each (instead of ``device``).
        cluster_environment: Where the ranks come from (set by the Trainer: Lightning, torchrun, SLURM, ...).
        checkpoint_io: Passed to :class:`~lightning.pytorch.strategies.ParallelStrategy`.
        precision_plugin: Passed to :class:`~lightning.pytorch.strategies.ParallelStrategy`.
        process_group_backend: With several processes: ``"nccl"``/``"gloo"``; default NCCL on CUDA, gloo on CPUs.
        timeout: With several processes: how long collectives wait for the other ranks.
        ddp_kwargs: With several processes: keyword arguments of :class:`~torch.nn.parallel.DistributedDataParallel`
            (NOTE [ Data parallel, and one device as before ] in data_parallel.py).

    Raises:
        MisconfigurationException: If an option is of the wrong type or range, or options do not go together
            (:meth:`~lightning_blockwise.strategy.options.BlockwiseOptions.checked`), or ``device`` is a GPU and
            CUDA is not available.

    Example::

        import lightning_blockwise  # registers "blockwise"
        trainer = Trainer(strategy="blockwise", accelerator="gpu", precision="bf16-mixed")
        trainer.fit(module)  # module holds a PEFT-wrapped, 4-bit Hugging Face causal LM
    """

    strategy_name = "blockwise"

    def __init__(
        self,
        block_size: int = 1,
        prefetch_depth: int = 2,
        vram_budget: int | str | None = CARD,
        budget_tokens: int | None = None,
        offload_activations: bool | int | None = None,
        keep_activations: bool = True,
        allow_unvalidated: bool = False,
        save_frozen_base: bool = False,
        share_host_copy: bool | None = None,
        block_major_accumulation: bool = False,
        input_checkpoint_every: int | None = None,
        accelerator: Accelerator | None = None,
        device: _DEVICE | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        options = BlockwiseOptions.checked(
            vram_budget,
            device,
            parallel_devices,
            ddp_kwargs,
            block_size=block_size,
            prefetch_depth=prefetch_depth,
            budget_tokens=budget_tokens,
            offload_activations=offload_activations,
            keep_activations=keep_activations,
            allow_unvalidated=allow_unvalidated,
            save_frozen_base=save_frozen_base,
            share_host_copy=share_host_copy,
            block_major_accumulation=block_major_accumulation,
            input_checkpoint_every=input_checkpoint_every,
        )
        super().__init__(
            options,
            accelerator=accelerator,
            parallel_devices=[torch.device(device)] if device is not None else parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            ddp_kwargs=ddp_kwargs,
        )
        self._checked: CheckedModule | None = None
        self._placement = ModulePlacement()
        self._checkpoints = CheckpointHooks("BlockwiseStrategy")

    @override
    def setup(self, trainer: Trainer) -> None:
        warn_if_untested()
        self._checked = check_module(self.lightning_module, trainer, self.options, self.root_device)
        self.plan = self._checked.blocks
        if self.root_device.type == "cuda":
            with budget_errors(budget_owner(self.options)):
                check_cap(self.root_device, self.options.vram_budget)
        super().setup(trainer)  # calls `model_to_device`, which builds the run, then wraps in DDP
        run = self._run
        assert run is not None
        run.layers.install()
        if self.root_device.type != "cuda" and self.options.vram_budget is not None:
            # After the plan: a budget the plan refuses is said once, by the refusal (which says this too).
            rank_zero_warn(
                f"{run.owner} has no effect on the {self.root_device.type.upper()}: the frozen base already"
                " lives in host memory, so every block counts as resident and nothing streams or is capped. Drop"
                " `vram_budget`, or train on a GPU (`accelerator='gpu'`) to have it cap the card's memory."
            )
        rank_zero_info(f"BlockwiseStrategy: {run.layers.describe(run.stack.model_type)}; {run.planner.describe()}.")

    @override
    def model_to_device(self) -> None:
        """Bind the decoder layers' frozen tensors to the host arena, move the rest to the device, plan the step."""
        assert self._checked is not None
        self._run = BlockwiseRun(self, self.options, self._checked, self._placement, self._checkpoints, self._observer)
        self._host_copy, self._planner = self._run.host_copy, self._run.planner

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._run is not None and self._run.block_major is not None:
            # NOTE [ A window's batches ] in accumulation.py; it plans for the window's batches first.
            return self._run.block_major.training_step(self, args, kwargs, super().training_step, self._see_batch)
        if self._run is not None:
            # NOTE [ A budget that sees the batches ] in planning/step_budget.py.
            replanned = self._run.planner.before_step(args[0] if args else kwargs.get("batch"))
            if replanned is not None:
                self._run.planner.announce(replanned)
        return super().training_step(*args, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        moved = super().batch_to_device(batch, device, dataloader_idx)
        trainer = None if self.lightning_module is None else self.lightning_module._trainer
        if self._run is not None and trainer is not None and trainer.training:
            # NOTE [ Masked attention ] in planning/step_shape.py: the masks read here, on the host.
            self._run.planner.note_host_batch(batch, moved)
        return moved

    def _see_batch(self, batch: Any) -> None:
        if self._run is not None:
            # NOTE [ A budget that sees the batches ] in planning/step_budget.py.
            replanned = self._run.planner.see_batch(batch)
            if replanned is not None:
                self._run.planner.announce(replanned)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._run is not None and self._run.block_major is not None:
            closure = self._run.block_major.closure_then_window(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # NOTE [ Loader state restored late ] in checkpoint_hooks.py, then NOTE [ Exact resume ] in replay/rng.py:
        # after every `on_train_start` hook, before the first batch.
        self._checkpoints.at_train_start(self.lightning_module.trainer.fit_loop)

    @override
    def on_train_end(self) -> None:
        if self._run is not None:
            # NOTE [ Re-plans in the log ] in step_planner.py.
            self._run.planner.announce_largest()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._run is not None:
            self._run.close()
            self._run = None
        self._placement.restore()
        self._checked = None
        super().teardown()

    # Checkpoints: NOTE [ Lean checkpoints ] in checkpointing.py.

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # A checkpoint's frozen tensors (`save_frozen_base=True`) go into the host arena, and its base
        # fingerprint is compared with the packed base's: both exist only after setup.
        return True

    @property
    def base_fingerprint(self) -> str | None:
        """The fingerprint of the frozen base that checkpoints record; set at setup."""
        return self._checkpoints.fingerprint

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The state dict without the frozen base, or with it read from the host copy."""
        return self._checkpoints.state_dict(super().lightning_module_state_dict(), self.options.save_frozen_base)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if self._run is not None and self._run.block_major is not None:
            self._run.block_major.checkpoint_loader_state(checkpoint)
        self._checkpoints.record(checkpoint, self.options.save_frozen_base)
        if self.is_global_zero and writes_itself(self.checkpoint_io, filepath, storage_options):
            save_unbuffered(checkpoint, Path(filepath))
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        # A bad `ckpt_path` fails naming the file and the problem, not deep inside torch's unpickler.
        check_checkpoint_file(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a lean or full checkpoint into the set-up module; refuse one of another base.

        See :meth:`~lightning_blockwise.strategy.checkpoint_hooks.CheckpointHooks.load`, which says what it refuses.
        """
        if self._checkpoints.base is None:
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        layers = None if self._run is None else self._run.layers
        share, ranks = self.options.share_host_copy, self.world_size
        self._checkpoints.load(self.lightning_module, checkpoint, strict, layers, self._host_copy, share, ranks)
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._checkpoints.resume_rng(checkpoint, self.global_rank, self.world_size)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name,
                cls,
                description="Frozen decoder layers rematerialized and streamed block by block (lightning-blockwise)",
            )


__all__ = ["BlockwiseStrategy"]
