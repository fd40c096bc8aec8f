"""``BlockwiseStrategy``: Lightning hooks that put rematerializing, streamable decoder layers in place."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import STEP_OUTPUT
from typing_extensions import override

from lightning_blockwise.architectures import DecoderStack, check_trainable, eval_mode_4bit_modules, find_decoder_stack
from lightning_blockwise.compat.versions import warn_if_untested
from lightning_blockwise.planning.units import format_gib
from lightning_blockwise.residency import placement
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.placement import HostCopy
from lightning_blockwise.residency.stream_observer import StreamObserver
from lightning_blockwise.strategy.accumulation import (
    BlockMajorSteps,
    planned_window,
    refuse_unsupported,
)
from lightning_blockwise.strategy.checkpoint_hooks import CheckpointHooks
from lightning_blockwise.strategy.checkpointing import FrozenBase
from lightning_blockwise.strategy.device_memory import CardBudget, card_budget, check_cap
from lightning_blockwise.strategy.module_budget import module_budget
from lightning_blockwise.strategy.module_placement import ModulePlacement, shared_copy_key
from lightning_blockwise.strategy.options import (
    CARD,
    budget_bytes,
    check_options,
    offload_split,
    refuse_8bit_linears,
    refuse_accelerate_hooks,
    refuse_compiled,
    refuse_cpu_eval_mode_4bit,
)
from lightning_blockwise.strategy.queries import BlockwiseQueries
from lightning_blockwise.strategy.resumable import ResumableStrategy
from lightning_blockwise.strategy.step_planner import StepPlanner, budget_errors
from lightning_blockwise.strategy.step_tokens import first_tokens
from lightning_blockwise.strategy.streamed_stack import StreamedStack

# Lightning's own logger, which it shows at INFO on every rank (rank_zero_info shows rank 0 only).
log = logging.getLogger("lightning.pytorch")


class BlockwiseStrategy(BlockwiseQueries, ResumableStrategy):
    """Train PEFT adapters on a frozen Hugging Face decoder stack that is rematerialized layer by layer.

    After the usual single-device setup the strategy finds the decoder layers of the Hugging Face model inside
    the LightningModule and installs on each (in place, the class untouched) a forward that runs without building
    a graph, keeping only the layer input, its RNG state and its call arguments; the backward recomputes the layer
    from them and differentiates it. Training is bit-identical to ``strategy="auto"``. Weights are grouped into
    blocks of ``block_size`` layers, the unit in which the residency moves them.

    What a user sets, and why (the Trainer sets the rest: accelerator, devices, processes):

    - ``vram_budget``: how much of the card the run may take (default: the card); blocks that fit stay on it.
    - ``block_size``: layers per copy; larger blocks make fewer, larger copies.
    - ``prefetch_depth``: blocks on their way ahead of the one in use, so copies hide behind compute.
    - ``budget_tokens``: the micro-batch to plan for at setup where the data module does not declare it.
    - ``offload_activations``: saved layer inputs in host memory, for contexts the card holds no other way (default:
      with a budget, the plan chooses how many, and ``input_checkpoint_every``, from the card and host memory).
    - ``keep_activations``: spend the budget on not recomputing (default) or on residency alone (link-bound steps).
    - ``input_checkpoint_every``: keep one layer input in k, replay the rest: less memory, a third weight pass.
    - ``block_major_accumulation``: one copy of each block per accumulation window instead of one per micro-batch.
    - ``share_host_copy``: one host copy of the base for the processes of a machine that train on it.
    - ``save_frozen_base``: self-contained checkpoints instead of lean ones.
    - ``allow_unvalidated``: try an architecture outside the validated ones.

    Args:
        block_size: Decoder layers per block.
        prefetch_depth: Blocks fetched ahead of the one in use when weights stream.
        vram_budget: The device memory the run may take. ``"card"`` (default): what this process may use of the
            card at setup (free memory under any per-process cap, less a margin; NOTE [ The card as the default
            budget ] in device_memory.py), so a model whose blocks and activations fit trains as resident training
            does and the rest streams. Bytes or a string like ``"16GiB"``: a cap on the device memory the run takes,
            on CUDA the caching allocator's per-process cap for the run, with expandable segments on (NOTE [ A budget
            is a cap on the card ] in planning/memory.py), for a card shared with other jobs. Blocks that fit under
            the budget with the step's predicted peak and 10% headroom stay on the device for the whole run (less
            traffic, faster steps). ``None``: no budget, every block streams and every layer is recomputed (the
            least device memory). On the CPU a set budget has no effect (the base is in host memory already);
            setup warns where the plan takes it (a budget the plan refuses is said once, by the refusal).
        budget_tokens: Tokens per micro-batch (batch size x sequence length) to plan for at setup. Default: the data
            module's ``max_length`` x ``batch_size`` where it declares both, else the first training batch's, read
            ahead (NOTE [ The first batch read ahead ] in step_tokens.py), else 2048; a refusal at setup says which.
            Either way a longer batch is planned for before its step runs (NOTE [ A budget that sees the batches ] in
            planning/step_budget.py).
        offload_activations: Keep each layer's saved input in pinned host memory between forward and
            backward (NOTE [ Layer-input offload ] in residency/activations.py). ``None``: the plan decides; with a
            budget and ``input_checkpoint_every`` unset too, it chooses how many layers' inputs wait in host memory
            and one kept in how many from the budget and the host memory free, again before a longer batch; what
            fits no way under a set ``vram_budget`` is refused at setup, naming the longest micro-batch that would
            (NOTE [ Where layer inputs wait ] in planning/input_choice.py). Without a budget it turns offload on when
            the step would not fit the device without it. ``True``/``False`` force it. An integer ``m`` offloads the
            first ``m`` layers' inputs and keeps the rest on the device (host RAM short of every layer's input: NOTE
            [ Split layer inputs ]).
        keep_activations: With a ``vram_budget``, recomputed layers first keep their attention kernels' outputs
            where a layer's attention is worth it (long context: NOTE [ Kept attention ] in replay/kept_attention.py),
            then blocks whose slabs and layers' autograd graphs fit stay on the device and run as in resident
            training, not recomputed in the backward (faster); the rest of the budget keeps blocks resident only.
            ``False`` spends the whole budget on resident blocks, which is better where the step waits on the host
            link (NOTE [ Kept activations ] in planning/memory.py).
        allow_unvalidated: Accept architectures outside
            :data:`~lightning_blockwise.architectures.VALIDATED_MODEL_TYPES`.
        save_frozen_base: Write the frozen base into checkpoints too (a self-contained file). By default a checkpoint
            holds what training changes and a fingerprint of the base (NOTE [ Lean checkpoints ] in checkpointing.py).
        input_checkpoint_every: Keep the saved input of one layer in ``k`` only (layers ``0, k, 2k, ...``; on the
            device or in host memory as ``offload_activations`` says for that layer); in the backward each segment
            of ``k`` layers is first replayed forward from its kept input to recompute the others (NOTE [ Input
            checkpoints ] in replay/segments.py). Exact; about a third more weight traffic and forward compute.
            ``None`` (default): every layer's input is kept, unless the plan chooses ``k`` (``offload_activations``
            unset and a budget, see there). Not with ``block_major_accumulation``.
        block_major_accumulation: With ``Trainer(accumulate_grad_batches=G)``, copy each block once for the forward of a
            window's G micro-batches and once for their backward, instead of G times each: a window's training steps
            run layer by layer (NOTE [ Block-major accumulation ] in replay/block_major.py; a window's batches are read
            ahead, NOTE [ A window's batches ] in accumulation.py). Exact, on one device or several (NOTE [ Block-major
            windows on several ranks ]); needs dropout 0 in the decoder layers, automatic optimization; saves G
            micro-batches' layer inputs at once; nothing kept or offloaded.
        share_host_copy: Share the host copy this run packs with the other processes of the machine that pack the
            same base (NOTE [ One host copy per machine ] in residency/shared_arena.py): ``None`` (default) among
            this run's ranks only when it has several, ``True`` with any process of this user (concurrent jobs on
            one base), ``False`` never. A base loaded by ``load_blockwise`` comes shared already (its ``share``).
        accelerator: The accelerator (set by the Trainer).
        device: The one device to train on, for a strategy built by hand; with the strategy chosen by name
            (``Trainer(strategy="blockwise", accelerator="gpu", devices=N)``) the Trainer sets the devices.
        parallel_devices: The devices of this node's processes, one each (instead of ``device``).
        cluster_environment: Where the ranks come from (set by the Trainer: Lightning, torchrun, SLURM, ...).
        checkpoint_io: Passed to :class:`~lightning.pytorch.strategies.ParallelStrategy`.
        precision_plugin: Passed to :class:`~lightning.pytorch.strategies.ParallelStrategy`.
        process_group_backend: With several processes: ``"nccl"``/``"gloo"``; default NCCL on CUDA, gloo on CPUs.
        timeout: With several processes: how long collectives wait for the other ranks.
        ddp_kwargs: With several processes: keyword arguments of :class:`~torch.nn.parallel.DistributedDataParallel`
            (NOTE [ Data parallel, and one device as before ] in data_parallel.py).

    Raises:
        MisconfigurationException: If ``block_size``, ``prefetch_depth`` or ``budget_tokens`` is not an integer
            of at least 1, ``vram_budget`` is not a positive size, ``offload_activations`` is not a bool, ``None``
            or a count of layers (at most the model's, checked at setup),
            a bool option (``save_frozen_base``, ``allow_unvalidated``, ...) is not a bool, or ``device`` is a GPU
            and CUDA is not available.

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
        check_options(
            block_size=block_size,
            prefetch_depth=prefetch_depth,
            budget_tokens=budget_tokens,
            offload_activations=offload_activations,
            keep_activations=keep_activations,
            block_major_accumulation=block_major_accumulation,
            input_checkpoint_every=input_checkpoint_every,
            allow_unvalidated=allow_unvalidated,
            save_frozen_base=save_frozen_base,
            share_host_copy=share_host_copy,
            device=device,
            parallel_devices=parallel_devices,
            ddp_kwargs=ddp_kwargs,
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=[torch.device(device)] if device is not None else parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            ddp_kwargs=ddp_kwargs,
        )
        self.block_size = block_size
        self.prefetch_depth = prefetch_depth
        #: Whether the run plans for the card's budget (``vram_budget="card"``), measured at each setup.
        self.uses_card = vram_budget == CARD
        #: The user's budget in bytes; ``None`` with ``"card"`` (see :attr:`planned_budget`) or no budget.
        self.vram_budget = budget_bytes(vram_budget)
        self._card: CardBudget | None = None
        self.budget_tokens = budget_tokens
        self.offload_activations = offload_activations
        self.keep_activations = keep_activations
        self._planner: StepPlanner | None = None
        self.allow_unvalidated = allow_unvalidated
        self.save_frozen_base = save_frozen_base
        self.share_host_copy = share_host_copy
        self.block_major_accumulation = block_major_accumulation
        self.input_checkpoint_every = input_checkpoint_every
        self._block_major: BlockMajorSteps | None = None
        self.plan: BlockPlan | None = None
        self._observer = StreamObserver()
        self._stack: DecoderStack | None = None
        self._layers: StreamedStack | None = None
        self._host_copy: HostCopy | None = None
        self._placement = ModulePlacement()
        self._checkpoints = CheckpointHooks("BlockwiseStrategy")

    @override
    def setup(self, trainer: Trainer) -> None:
        warn_if_untested()
        # Refuse a module that cannot train blockwise before anything moves or optimizers are built.
        refuse_compiled(self.lightning_module)
        stack = find_decoder_stack(self.lightning_module, allow_unvalidated=self.allow_unvalidated)
        refuse_8bit_linears(stack.layers)
        refuse_accelerate_hooks(stack.layers)
        try:
            self.plan = BlockPlan(num_layers=len(stack.layers), block_size=self.block_size)
        except ValueError as error:
            raise MisconfigurationException(f"`BlockwiseStrategy(block_size={self.block_size})`: {error}") from None
        if trainer.state.fn == TrainerFn.FITTING:
            check_trainable(stack)
            if self.root_device.type == "cpu":
                # At setup, before the sanity validation and the callbacks' fit-start work (a `ParityCheck` would
                # report a bit-identical comparison first): Lightning keeps the modes it finds until training.
                refuse_cpu_eval_mode_4bit(eval_mode_4bit_modules(stack))
            window = planned_window(trainer) if self.block_major_accumulation else 1
            if window > 1:
                refuse_unsupported(self.lightning_module, stack)
                self._block_major = BlockMajorSteps(window, len(stack.layers), self.root_device)
            elif self.block_major_accumulation:
                rank_zero_info("BlockwiseStrategy: block_major_accumulation has no effect: accumulate_grad_batches=1.")
        self._stack = stack
        if self.root_device.type == "cuda":
            with budget_errors(self._budget_owner):
                check_cap(self.root_device, self.vram_budget)
        super().setup(trainer)  # calls `model_to_device`, which sets up the streamer, then wraps in DDP
        assert self._layers is not None and self._planner is not None
        self._layers.install()
        if self.root_device.type != "cuda" and self.vram_budget is not None:
            # After the plan: a budget the plan refuses is said once, by the refusal (which says this too).
            rank_zero_warn(
                f"{self._budget_owner} has no effect on the {self.root_device.type.upper()}: the frozen base already"
                " lives in host memory, so every block counts as resident and nothing streams or is capped. Drop"
                " `vram_budget`, or train on a GPU (`accelerator='gpu'`) to have it cap the card's memory."
            )
        rank_zero_info(f"BlockwiseStrategy: {self._layers.describe(stack.model_type)}; {self._planner.describe()}.")

    @override
    def model_to_device(self) -> None:
        """Bind the decoder layers' frozen tensors to the host arena and move the rest to the device."""
        assert self._stack is not None and self.plan is not None
        device = self.root_device
        share_key = shared_copy_key(self._stack.model.config, self.share_host_copy, self.is_distributed)
        pack = lambda: placement.host_copy(self._stack, self.plan, device.type == "cuda", share_key)  # noqa: E731
        # NOTE [ Local rank 0 owns its host's copy ] in data_parallel.py.
        self._host_copy = self.local_rank_zero_first(pack, ordered=self.share_host_copy is not False)
        owner = self._budget_owner
        offload, offloaded_layers = offload_split(self.offload_activations, len(self._stack.layers))
        for change in self._placement.place(self.lightning_module, self._stack, device, self.vram_budget, owner):
            rank_zero_info(f"BlockwiseStrategy: {change}.")
        self._card = None
        if self.uses_card and device.type == "cuda":
            # NOTE [ The card as the default budget ] in device_memory.py: planned for, not set as a cap. Every rank
            # measures its own card, so every rank says what it found.
            self._card = card_budget(device, held_outside=self._placement.held_outside)
            rank = f" (rank {self.global_rank})" if self.world_size > 1 else ""
            log.info(f"BlockwiseStrategy{rank}: vram_budget='card': {self._card.why}.")
        budget = module_budget(
            self.lightning_module,
            self._stack.model,
            block_bytes=[layout.nbytes for layout in self._host_copy.layouts],
            device=device,
            prefetch_depth=self.prefetch_depth,
            budget=self.planned_budget,
            offload=offload,
            offloaded_layers=offloaded_layers,
            block_layers=self.plan.layers_per_block,
            keep_activations=self.keep_activations,
            window=self._block_major.window if self._block_major is not None else 1,
            ranks=self.world_size,
            card=self._card is not None,
            checkpoint_every=self.input_checkpoint_every,
            host_ranks=self.num_processes,
        )
        self._planner = StepPlanner(budget, self._budget_owner, device, self.host_group)
        trainer = self.lightning_module.trainer
        # NOTE [ The first batch read ahead ] in step_tokens.py.
        tokens = first_tokens(self.budget_tokens, trainer, fitting=trainer.state.fn == TrainerFn.FITTING)
        plan = self._planner.first_plan(tokens.count, tokens.source, tokens.per_rank)
        # Before the streamer binds resident blocks to the device: the fingerprint reads the host copy.
        self._checkpoints.base = FrozenBase(
            self.lightning_module, self._stack.model, self._host_copy.layouts, self._host_copy.arena.slabs
        )
        self._layers = StreamedStack(
            self._stack.layers,
            self.plan,
            self._host_copy,
            device,
            self.prefetch_depth,
            plan.residency.resident,
            plan.residency.kept,
            # The options', or where the plan chose them, its own (NOTE [ Where layer inputs wait ] in
            # planning/input_choice.py).
            plan.shape.offloaded_layers,
            plan.shape.checkpoint_every,
            plan.residency.attention,
        )
        self._layers.set_observer(self._observer)
        self._planner.attach(self._layers)

    @property
    def _budget_owner(self) -> str:
        if self.uses_card:
            budget = None if self._card is None else self._card.budget
            planned = "" if budget is None else f", here {format_gib(budget)}"
            return f"`BlockwiseStrategy(vram_budget='card')` (the default: the card's free memory{planned})"
        return f"`BlockwiseStrategy(vram_budget={self.vram_budget})`"

    @property
    def planned_budget(self) -> int | None:
        """The budget the run plans for: the user's ``vram_budget``, or the card's measured at setup, else ``None``."""
        return self._card.budget if self._card is not None else self.vram_budget

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._block_major is not None:
            # NOTE [ A window's batches ] in accumulation.py; it plans for the window's batches first.
            return self._block_major.training_step(self, args, kwargs, super().training_step, self._see_batch)
        if self._planner is not None:
            # NOTE [ A budget that sees the batches ] in planning/step_budget.py.
            replanned = self._planner.before_step(args[0] if args else kwargs.get("batch"))
            if replanned is not None:
                self._planner.announce(replanned)
        return super().training_step(*args, **kwargs)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        moved = super().batch_to_device(batch, device, dataloader_idx)
        trainer = None if self.lightning_module is None else self.lightning_module._trainer
        if self._planner is not None and trainer is not None and trainer.training:
            # NOTE [ Masked attention ] in planning/step_shape.py: the masks read here, on the host.
            self._planner.note_host_batch(batch, moved)
        return moved

    def _see_batch(self, batch: Any) -> None:
        if self._planner is not None:
            # NOTE [ A budget that sees the batches ] in planning/step_budget.py.
            replanned = self._planner.see_batch(batch)
            if replanned is not None:
                self._planner.announce(replanned)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._block_major is not None:
            closure = self._block_major.closure_then_window(closure)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def on_train_end(self) -> None:
        if self._planner is not None:
            # NOTE [ Re-plans in the log ] in step_planner.py.
            self._planner.announce_largest()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if self._block_major is not None:
            self._block_major.close()
            self._block_major = None
        if self._layers is not None:
            self._layers.close()
            self._layers = None
        self._placement.restore()
        self._card = None
        self._stack = None
        super().teardown()

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
