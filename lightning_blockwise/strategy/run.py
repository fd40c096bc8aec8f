"""What a blockwise strategy sets up for one Trainer function: the checked module, then the run built on it.

:func:`check_module` refuses a module that cannot train blockwise before anything moves;
:class:`BlockwiseRun` then builds the run's parts in the one order they depend on. The strategy owns one
run at a time (``None`` before setup and after teardown) and answers its callbacks from it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_blockwise.architectures import DecoderStack, check_trainable, eval_mode_4bit_modules, find_decoder_stack
from lightning_blockwise.planning.units import format_gib
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.placement import HostCopy, host_copy
from lightning_blockwise.residency.stream_observer import StreamObserver
from lightning_blockwise.strategy.accumulation import BlockMajorSteps, planned_window, refuse_unsupported
from lightning_blockwise.strategy.checkpoint_hooks import CheckpointHooks
from lightning_blockwise.strategy.checkpointing import FrozenBase
from lightning_blockwise.strategy.data_parallel import DataParallelStrategy
from lightning_blockwise.strategy.device_memory import CardBudget, card_budget
from lightning_blockwise.strategy.fit_loop import check_fit_loop
from lightning_blockwise.strategy.module_budget import module_budget
from lightning_blockwise.strategy.module_placement import ModulePlacement, shared_copy_key
from lightning_blockwise.strategy.options import (
    BlockwiseOptions,
    offload_split,
    refuse_8bit_linears,
    refuse_accelerate_hooks,
    refuse_compiled,
    refuse_cpu_eval_mode_4bit,
)
from lightning_blockwise.strategy.step_planner import StepPlanner
from lightning_blockwise.strategy.step_tokens import first_tokens
from lightning_blockwise.strategy.streamed_stack import StreamedStack

# Lightning's own logger, which it shows at INFO on every rank (rank_zero_info shows rank 0 only).
log = logging.getLogger("lightning.pytorch")


@dataclass(frozen=True)
class CheckedModule:
    """A LightningModule found fit to train blockwise, before anything of it moves.

    Attributes:
        stack: Its decoder stack.
        blocks: The stack's layers grouped into blocks of ``block_size``.
        window: Micro-batches of a block-major window (1: block-major accumulation is off).
    """

    stack: DecoderStack
    blocks: BlockPlan
    window: int


def check_module(module: nn.Module, trainer: object, options: BlockwiseOptions, device: torch.device) -> CheckedModule:
    """Refuse a module that cannot train blockwise, before anything moves or optimizers are built.

    Args:
        module: The LightningModule.
        trainer: The Trainer being set up.
        options: The strategy's options.
        device: The compute device.

    Raises:
        MisconfigurationException: Naming what the module or the options lack, and the fix.
    """
    refuse_compiled(module)
    stack = find_decoder_stack(module, allow_unvalidated=options.allow_unvalidated)
    refuse_8bit_linears(stack.layers)
    refuse_accelerate_hooks(stack.layers)
    try:
        blocks = BlockPlan(num_layers=len(stack.layers), block_size=options.block_size)
    except ValueError as error:
        raise MisconfigurationException(f"`BlockwiseStrategy(block_size={options.block_size})`: {error}") from None
    window = 1
    if trainer.state.fn == TrainerFn.FITTING:  # type: ignore[attr-defined]
        check_fit_loop(trainer.fit_loop)  # type: ignore[attr-defined]
        check_trainable(stack)
        if device.type == "cpu":
            # At setup, before the sanity validation and the callbacks' fit-start work (a `ParityCheck` would
            # report a bit-identical comparison first): Lightning keeps the modes it finds until training.
            refuse_cpu_eval_mode_4bit(eval_mode_4bit_modules(stack))
        window = planned_window(trainer) if options.block_major_accumulation else 1  # type: ignore[arg-type]
        if window > 1:
            refuse_unsupported(module, stack)  # type: ignore[arg-type]
        elif options.block_major_accumulation:
            rank_zero_info("BlockwiseStrategy: block_major_accumulation has no effect: accumulate_grad_batches=1.")
    return CheckedModule(stack, blocks, window)


def budget_owner(options: BlockwiseOptions, card: CardBudget | None = None) -> str:
    """How errors and the log name the run's budget: the user's ``vram_budget``, or the card's measured one."""
    if options.uses_card:
        planned = "" if card is None or card.budget is None else f", here {format_gib(card.budget)}"
        return f"`BlockwiseStrategy(vram_budget='card')` (the default: the card's free memory{planned})"
    return f"`BlockwiseStrategy(vram_budget={options.vram_budget})`"


class BlockwiseRun:
    """The set-up parts of a blockwise run, built in the order each needs the one before.

    1. The **host copy**: the decoder layers' frozen tensors packed into (or mapped from) the host arena,
       by each host's local rank 0 first (NOTE [ Local rank 0 owns its host's copy ] in data_parallel.py).
    2. The module's **placement**: the rest of it on the device, the allocator capped at the budget.
    3. The **card** measured where the run plans for it (NOTE [ The card as the default budget ] in
       device_memory.py): after the placement, which is what the card holds then.
    4. The **planner** and its first plan, for the tokens the run declares or reads ahead (NOTE [ The first
       batch read ahead ] in step_tokens.py).
    5. The base's **fingerprint** for checkpoints: it reads the host copy, so before any block is bound to
       the device.
    6. The **streamed stack** of layers on that plan, which the planner then keeps in step.
    7. The **block-major steps**, where a window is planned for (they wrap the stack's layers per window).

    Args:
        strategy: The strategy: its module, device and ranks.
        options: Its options.
        checked: The module as :func:`check_module` found it.
        placement: The strategy's placement, which it restores at teardown (also after a setup that failed).
        checkpoints: The strategy's checkpoint hooks, handed the base.
        observer: What the stack's streamers report to.

    Raises:
        MisconfigurationException: If the step does not fit the budget, or the allocator cannot be capped at it.
    """

    def __init__(
        self,
        strategy: DataParallelStrategy,
        options: BlockwiseOptions,
        checked: CheckedModule,
        placement: ModulePlacement,
        checkpoints: CheckpointHooks,
        observer: StreamObserver,
    ) -> None:
        module, stack, blocks = strategy.lightning_module, checked.stack, checked.blocks
        device = strategy.root_device
        #: The module's decoder stack, and its layers' blocks.
        self.stack, self.blocks = stack, blocks
        share_key = shared_copy_key(stack.model.config, options.share_host_copy, strategy.is_distributed)
        pack = lambda: host_copy(stack, blocks, device.type == "cuda", share_key)  # noqa: E731
        #: The host arena and block layouts (1).
        self.host_copy: HostCopy = strategy.local_rank_zero_first(pack, ordered=options.share_host_copy is not False)
        # (2)
        for change in placement.place(module, stack, device, options.vram_budget, budget_owner(options)):
            rank_zero_info(f"BlockwiseStrategy: {change}.")
        #: The card's budget (3), where the run plans for it on a CUDA device; else ``None``.
        self.card: CardBudget | None = None
        if options.uses_card and device.type == "cuda":
            # Planned for, not set as a cap. Every rank measures its own card, so every rank says what it found.
            self.card = card_budget(device, held_outside=placement.held_outside)
            rank = f" (rank {strategy.global_rank})" if strategy.world_size > 1 else ""
            log.info(f"BlockwiseStrategy{rank}: vram_budget='card': {self.card.why}.")
        #: The budget planned for: the user's, or the card's measured one.
        self.budget = self.card.budget if self.card is not None else options.vram_budget
        #: How errors and the log name that budget.
        self.owner = budget_owner(options, self.card)
        offload, offloaded_layers = offload_split(options.offload_activations, len(stack.layers))
        budget = module_budget(
            module,
            stack.model,
            block_bytes=[layout.nbytes for layout in self.host_copy.layouts],
            device=device,
            prefetch_depth=options.prefetch_depth,
            budget=self.budget,
            offload=offload,
            offloaded_layers=offloaded_layers,
            block_layers=blocks.layers_per_block,
            keep_activations=options.keep_activations,
            window=checked.window,
            ranks=strategy.world_size,
            card=self.card is not None,
            checkpoint_every=options.input_checkpoint_every,
            host_ranks=strategy.num_processes,
        )
        #: The step planner (4).
        self.planner = StepPlanner(budget, self.owner, device, strategy.host_group)
        trainer = module.trainer
        tokens = first_tokens(options.budget_tokens, trainer, fitting=trainer.state.fn == TrainerFn.FITTING)
        plan = self.planner.first_plan(tokens.count, tokens.source, tokens.per_rank)
        # (5)
        checkpoints.base = FrozenBase(module, stack.model, self.host_copy.layouts, self.host_copy.arena.slabs)
        #: The rematerialized, streamed decoder layers (6).
        self.layers = StreamedStack(
            stack.layers,
            blocks,
            self.host_copy,
            device,
            options.prefetch_depth,
            plan.residency.resident,
            plan.residency.kept,
            # The options', or where the plan chose them, its own (NOTE [ Where layer inputs wait ] in
            # planning/input_choice.py).
            plan.shape.offloaded_layers,
            plan.shape.checkpoint_every,
            plan.residency.attention,
        )
        self.layers.set_observer(observer)
        self.planner.attach(self.layers)
        #: A window's training steps, where block-major accumulation is on (NOTE [ A window's batches ] in
        #: accumulation.py).
        self.block_major = BlockMajorSteps(checked.window, stack.layers, device) if checked.window > 1 else None

    def close(self) -> None:
        """Close the block-major window and the streamer; the layers keep their rematerializing forward."""
        if self.block_major is not None:
            self.block_major.close()
            self.block_major = None
        self.layers.close()


__all__ = ["BlockwiseRun", "CheckedModule", "budget_owner", "check_module"]
