"""Planning a blockwise run for the micro-batches it trains on: which blocks stay resident, whether inputs offload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_blockwise.planning.input_choice import host_limited, plan_inputs
from lightning_blockwise.planning.input_levels import InputLevels
from lightning_blockwise.planning.memory import BLAS_THREADS, ResidencyPlan, plan_residency
from lightning_blockwise.planning.step_kernels import PLAIN_KERNELS, StepKernels
from lightning_blockwise.planning.step_plan import StepPlan
from lightning_blockwise.planning.step_shape import StepShape
from lightning_blockwise.planning.units import format_gb, format_gib
from lightning_blockwise.residency.arena import HOST_RAM_RESERVE, available_host_memory

# NOTE [ A budget that sees the batches ]
# Activation memory grows with the tokens of a micro-batch, so a plan made for fewer tokens
# than a batch holds can overflow the card. The first plan is made for a declared maximum
# (the strategy's ``budget_tokens``, else the data module's ``max_length`` x ``batch_size``), else
# for the first training batch (NOTE [ The first batch read ahead ] in step_tokens.py), else for
# ``DEFAULT_TOKENS``; before a training step whose batch holds more tokens than the plan, the
# strategy plans again for that batch (fewer resident blocks, the layer inputs offloaded) or stops
# with a clear error, before the step allocates anything. Plans only grow: a shorter batch keeps the
# plan made for the longest one so far.

#: The least attention forward per layer, in FLOPs, worth keeping its outputs for (NOTE [ Kept attention ] in
#: replay/kept_attention.py): about 2 ms at an H200's attention rate. The recording and answering run every operator of
#: a layer call through a Python dispatch mode, host time that a short step does not hide: the 7B shape at 4k tokens
#: (0.12 TFLOP per layer) under a 7.9 GB budget stepped in 0.583 s keeping them against 0.459 s without (H200,
#: GPU busy 353 of 608 ms); at 16k (1.9 TFLOP) keeping them was 4.6% faster.
KEPT_ATTENTION_MIN_FLOPS = 10**12


@dataclass(frozen=True)
class StepBudget:
    """What a step's device memory depends on, fixed at setup; :meth:`plan` answers for any token count.

    Args:
        config: The Hugging Face model's config.
        num_layers: Decoder layers.
        activation_bytes: Bytes per activation element.
        block_bytes: Each block's slab size.
        prefetch_depth: Blocks copied ahead of the one in use.
        fixed_bytes: Device bytes that do not depend on the plan (head, norms, adapters, ...).
        trainable_bytes: Bytes of the trainable parameters.
        budget: The ``vram_budget`` in bytes, or ``None``.
        offload: Force layer-input offload on or off; ``None`` turns it on when the plan needs it.
        device_limit: Without a budget, the device bytes beyond which automatic offload turns on
            (``None``: never, e.g. on the CPU).
        block_layers: Decoder layers in each block.
        keep_activations: With a budget, keep blocks' graphs instead of recomputing them where they
            fit (NOTE [ Kept activations ] in planning/memory.py).
        keep_attention: With ``keep_activations``, recomputed layers keep their attention outputs where they fit
            (NOTE [ Kept attention ] in replay/kept_attention.py).
        adapter_dropout: The adapters apply dropout (a kept graph holds their dropped-out inputs).
        window: Micro-batches whose layer inputs are saved at once: ``accumulate_grad_batches`` with block-major
            accumulation, else 1; over 1, nothing is kept or offloaded (NOTE [ Block-major accumulation ]).
        offloaded_layers: With offload on, the layers (the first ones) whose inputs go to host memory; ``None``: all
            (NOTE [ Split layer inputs ] in residency/activations.py).
        card: The budget is the card's (NOTE [ The card as the default budget ]): a step it cannot hold streams.
        checkpoint_every: One layer input kept in this many, the others replayed (``input_checkpoint_every``).
        choose_inputs: Neither ``offload`` nor ``checkpoint_every`` was set: with a budget the planner chooses
            where the layer inputs wait (NOTE [ Where layer inputs wait ]).
        host_ranks: Processes on this machine, each offloading its own inputs: each plans for its share of its
            host memory.
        masked_row: The longest row seen whose attention runs with a mask (NOTE [ Masked attention ] in
            planning/step_shape.py); ``None`` until such a batch is seen.
        kernels: How the module computes the step (its loss chunk, MLP and attention tiles, Liger's kernels), taken
            as they are.
    """

    config: Any
    num_layers: int
    activation_bytes: int
    block_bytes: Sequence[int]
    prefetch_depth: int
    fixed_bytes: int
    trainable_bytes: int
    budget: int | None
    offload: bool | None
    device_limit: int | None
    block_layers: Sequence[int] = ()
    keep_activations: bool = False
    adapter_dropout: bool = True
    window: int = 1
    offloaded_layers: int | None = None
    card: bool = False
    checkpoint_every: int | None = None
    choose_inputs: bool = False
    host_ranks: int = 1
    masked_row: int | None = None
    keep_attention: bool = True
    kernels: StepKernels = PLAIN_KERNELS

    @property
    def places_inputs(self) -> bool:
        """Whether plans choose where the layer inputs wait, from the host memory free for them.

        The choice left to the planner, a budget, no block-major window (NOTE [ Where layer inputs wait ]).
        """
        return self.choose_inputs and self.budget is not None and self.window == 1

    def shape(self, tokens: int, offload: bool, levels: InputLevels | None = None) -> StepShape:
        """The step shape at ``tokens`` tokens per micro-batch (with ``levels``, where they say, not ``offload``)."""
        offloaded_layers, checkpoint_every = self.offloaded_layers, self.checkpoint_every
        if levels is not None:
            split = levels.offload_activations()
            offload, offloaded_layers = split is not False, None if isinstance(split, bool) else split
            checkpoint_every = levels.k
        return StepShape.for_config(
            self.config,
            tokens,
            self.num_layers,
            self.activation_bytes,
            offload_inputs=offload,
            kernels=self.kernels,
            adapter_dropout=self.adapter_dropout,
            window=self.window,
            offloaded_layers=offloaded_layers,
            checkpoint_every=checkpoint_every,
            masked_row=self.masked_row,
        )

    def plan(self, tokens: int, host_bytes: int | None = None) -> StepPlan:
        """The plan for micro-batches of up to ``tokens`` tokens (NOTE [ A budget that sees the batches ]).

        Automatic offload stays off while the step fits (the budget, else ``device_limit``) without it.
        With the card's budget (``card``), a step that does not fit it even with every block streamed is
        planned without a budget instead, every block streamed, and the plan says why (``over_card``): the card's
        budget is an estimate the user did not ask for, and the prediction errs high (a loss the module does not
        declare counts as Hugging Face's), so such a run is not refused where it may well fit. Where the plan chooses
        where the layer inputs wait and the host memory cannot take them all, they wait where the fewest stay on the
        card within it instead of all in host memory, and ``over_card`` says that host memory was the limit.

        With ``choose_inputs`` and a budget, where the layer inputs wait is chosen here (NOTE [ Where layer inputs
        wait ]).

        Args:
            tokens: Tokens per micro-batch.
            host_bytes: Host memory free for the layer inputs, where the plan chooses where they wait; ``None``:
                measured now (:func:`host_room`).

        Raises:
            ValueError: If even every block streamed (and the inputs offloaded, unless forced off, or, where the
                plan chooses, in no split and no checkpoint spacing) does not fit the budget; says by how much,
                the longest micro-batch that would fit where the plan chooses, and what to change.
        """
        if host_bytes is None and self.places_inputs:
            host_bytes = host_room(self.host_ranks)
        try:
            return self._plan(tokens, host_bytes)
        except ValueError as error:
            if not self.card or self.budget is None:
                raise
            refusal = error
        # Unbudgeted, but offload decided against the card's budget (what this process may use, another job on the
        # card respected), not against the whole card's `device_limit`.
        unbudgeted = replace(self, budget=None, card=False, device_limit=self.budget)
        streamed = unbudgeted._plan(tokens)
        host_limit = ""
        if self.places_inputs and host_bytes is not None and streamed.offload_host_bytes > host_bytes:
            # Offloading every input needs host memory for all of them, often the very shortage that made the
            # budgeted choice fail: the fewest on the card that the host memory allows instead.
            streamed, host_limit = host_limited(unbudgeted, tokens, host_bytes, streamed.offload_host_bytes)
        why = (
            f"the card's budget of {format_gib(self.budget)} is below what the plan predicts ({refusal}){host_limit};"
            " every block streams instead, unbudgeted. The prediction counts a loss the module does not declare as"
            " Hugging Face's (declare `loss_chunk_tokens` with a chunked loss); if the step runs out of memory,"
            " offload the layer inputs, tile the MLPs or shorten the micro-batches"
        )
        return replace(streamed, over_card=why)

    def _plan(self, tokens: int, host_bytes: int | None = None) -> StepPlan:
        if self.places_inputs:
            return plan_inputs(self, tokens, host_room(self.host_ranks) if host_bytes is None else host_bytes)
        choices = [self.offload] if self.offload is not None else [False] if self.window > 1 else [False, True]
        error: ValueError | None = None
        for offload in choices:
            shape = self.shape(tokens, offload)
            try:
                residency = self.residency(shape, self.budget)
            except ValueError as failure:
                error = failure
                continue
            limit = self.budget if self.budget is not None else self.device_limit
            if self.offload is None and not offload and limit is not None and residency.minimum > limit:
                continue
            return StepPlan(tokens, residency, offload, shape)
        assert error is not None
        hint = "" if self.offload is False else " with the layer inputs offloaded to host memory"
        raise ValueError(f"at {tokens} tokens per micro-batch{hint}, {error}")

    def residency(self, shape: StepShape, budget: int | None) -> ResidencyPlan:
        """The residency plan of ``shape`` under ``budget`` (``plan_residency``'s ``ValueError`` if it does not fit)."""
        return plan_residency(
            block_bytes=list(self.block_bytes),
            prefetch_depth=self.prefetch_depth,
            fixed_bytes=self.fixed_bytes,
            trainable_bytes=self.trainable_bytes,
            activation_bytes=shape.activation_peak(),
            budget=budget,
            graph_bytes=self._graph_bytes(shape),
            attention_bytes=self.attention_bytes(shape),
        )

    @property
    def _keeps(self) -> bool:
        """Whether plans keep activations at all: the option, a budget, blocks, no block-major window."""
        return self.keep_activations and self.budget is not None and bool(self.block_layers) and self.window == 1

    def _graph_bytes(self, shape: StepShape) -> list[int] | None:
        """Each block's layers' graphs, when blocks may keep them (NOTE [ Kept activations ])."""
        return [layers * shape.layer_graph() for layers in self.block_layers] if self._keeps else None

    def attention_bytes(self, shape: StepShape) -> list[int] | None:
        """Each block's layers' attention outputs, when recomputed layers may keep them (NOTE [ Kept attention ]).

        Not with input checkpoints (a segment's replay reruns layers whose forward kept nothing), nor with attention
        dropout (a call with dropout is computed again: NOTE [ Kept attention ] in replay/kept_attention.py), nor where
        a layer's attention forward is under :data:`KEPT_ATTENTION_MIN_FLOPS`.
        """
        if not self.keep_attention or shape.checkpoint_every is not None or _attention_dropout(self.config):
            return None
        if not self._keeps or shape.attention_flops() < KEPT_ATTENTION_MIN_FLOPS:
            return None
        return [layers * shape.kept_attention() for layers in self.block_layers]

    def layer_graph(self, tokens: int) -> int:
        """Bytes of one layer's autograd graph at ``tokens`` tokens (what a resident layer keeps)."""
        return self.shape(tokens, offload=False).layer_graph()

    def describe(self, plan: StepPlan) -> str:
        """One line for the log: tokens, peak, offload, and where the layer inputs wait where the plan chose it."""
        if plan.inputs is not None:
            offload = f"; {plan.inputs.describe(self.num_layers, plan.offload_host_bytes)}"
        elif plan.offload:
            offload = f", layer inputs offloaded to host memory ({format_gib(plan.offload_host_bytes)} pinned)"
        else:
            offload = ""
        kept, attention = plan.residency.kept, plan.residency.attention
        streamed = len(set(kept) - set(plan.residency.resident))
        kept_text = (
            f"{len(kept)} blocks keep their activations (not recomputed; {streamed} of them streamed), " if kept else ""
        )
        if attention:
            layers = sum(self.block_layers[block] for block in attention)
            kept_text += f"{layers} recomputed layers keep their attention outputs, "
        if self.window > 1:
            kept_text += f"block-major accumulation over {self.window} micro-batches (nothing kept or offloaded), "
        resident = f"{len(plan.residency.resident)} of {len(self.block_bytes)} blocks resident, "
        return (
            f"{resident}{kept_text}predicted training-step peak {format_gb(plan.residency.predicted_peak)} allocated"
            f" ({format_gb(plan.residency.predicted_reserved)} with the allocator's headroom) at {plan.tokens}"
            f" tokens per micro-batch{offload}"
        )


def host_room(ranks: int = 1) -> int:
    """Host bytes this process may give its saved layer inputs now: what ``HostArena``'s check sees, less its reserve.

    Each of the ``ranks`` processes on this machine offloads its own inputs, so each gets its share.
    """
    return max(0, available_host_memory() - HOST_RAM_RESERVE) // ranks


def blas_threads(window: int) -> int:
    """Threads that run matmuls in a step: Lightning's and autograd's, plus a block-major window's workers."""
    return BLAS_THREADS + (window if window > 1 else 0)


def _attention_dropout(config: Any) -> bool:
    """Whether the model's attention applies dropout in training (its config's ``attention_dropout``)."""
    config = getattr(config, "text_config", None) or config
    return bool(getattr(config, "attention_dropout", 0.0) or 0.0)


__all__ = ["KEPT_ATTENTION_MIN_FLOPS", "StepBudget", "blas_threads", "host_room"]
