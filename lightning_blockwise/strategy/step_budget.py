"""Planning a blockwise run for the micro-batches it trains on: which blocks stay resident, whether inputs offload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.kernels.liger import liger_kernels_in
from lightning_blockwise.planning import ResidencyPlan, StepShape, format_gb, format_gib, plan_residency
from lightning_blockwise.planning.input_levels import InputLevels, card_inputs, fewest_on_card, input_levels
from lightning_blockwise.planning.longest import GRANULARITY, longest_fit
from lightning_blockwise.planning.memory import ALLOCATOR_HEADROOM_PERCENT, ALLOCATOR_SLACK, BLAS_THREADS
from lightning_blockwise.residency.arena import HOST_RAM_RESERVE, available_host_memory
from lightning_blockwise.strategy.device_memory import blas_workspace_bytes

# NOTE [ A budget that sees the batches ]
# Activation memory grows with the tokens of a micro-batch, so a plan made for fewer tokens
# than a batch holds can overflow the card. The first plan is made for a declared maximum
# (the strategy's ``budget_tokens``, else the data module's ``max_length`` x ``batch_size``), else
# for the first training batch (NOTE [ The first batch read ahead ] in step_tokens.py), else for
# ``DEFAULT_TOKENS``; before a training step whose batch holds more tokens than the plan, the
# strategy plans again for that batch (fewer resident blocks, the layer inputs offloaded) or stops
# with a clear error, before the step allocates anything. Plans only grow: a shorter batch keeps the
# plan made for the longest one so far.

# NOTE [ Where layer inputs wait ]
# A step's saved layer inputs (layers x tokens x hidden x 2 B) can wait on the card, in host memory
# (``offload_activations=m``: NOTE [ Split layer inputs ] in residency/activations.py), or only one in
# k of them, the others replayed in the backward (``input_checkpoint_every=k``: NOTE [ Input
# checkpoints ] in replay/segments.py). Where the user sets neither and the run plans for a budget
# (a ``vram_budget`` or the card's), the planner chooses both, for each plan, so again before a longer
# batch: first the most inputs the budget holds on the card beside the rest of the step with every
# block streamed (the memory model's count of inputs on the card, ``card_inputs``, is monotone, and
# the splits of every input reach each count from the inputs in flight up to all of them, so a
# bisection over the splits finds it), then ``input_levels`` for that card and the host memory free
# now: every input on the card, else the fewest in host memory, else the smallest k. Blocks stay
# resident or keep their graphs with what the budget has left, as before. Where no split and no k
# fit, the run is refused before the step, with the longest micro-batch that would fit
# (``longest_fit`` over the same choice). Without a budget, offload is decided as before: all or
# nothing against the device's limit; the card's budget that gives way to streaming (NOTE [ The card
# as the default budget ]) is one such plan, except where the host memory cannot take every input:
# there the inputs wait where the fewest stay on the card within it (``fewest_on_card``), and the
# warning says that host memory was the limit. Block-major windows keep every input on the card.
# Re-planning changes the levels between steps only, where no input is held
# (``StreamedStack.set_input_levels``).
#
# Inputs on the card save no compute: in host memory they cost copies, which overlap the step. So where
# the plan leaves layers that neither keep their graphs nor their attention outputs (NOTE [ Kept
# attention ] in replay/kept_attention.py), it also plans with as many inputs in host memory as the host
# holds, and takes that plan where it skips more forward FLOPs (kept graphs' whole forwards, kept
# attention outputs' attention forwards: ``StepShape.layer_flops``, ``attention_flops``). That is long
# context on a small card: the 7B shape at 32k tokens on a 22 GiB cap kept the attention outputs of 8 of
# 28 layers beside the inputs on the card.
#
# The host memory free for the inputs (``StepPlanner``'s, for every plan) is what the arena's own
# check sees, less its reserve, divided among the ranks on this machine (each offloads its own), plus,
# at a re-plan, this rank's current slabs: they are freed before the new ones are allocated, so they
# are room, not a shortage. With several processes every rank plans from the least of the ranks'
# rooms (one all-reduce), and a step's tokens are the most of any rank's (one all-reduce before each
# step), so every rank re-plans at the same step, from the same numbers, and chooses the same: one
# rank alone refusing would leave the others waiting in DDP's first collective.

#: The least attention forward per layer, in FLOPs, worth keeping its outputs for (NOTE [ Kept attention ] in
#: replay/kept_attention.py): about 2 ms at an H200's attention rate. The recording and answering run every operator of
#: a layer call through a Python dispatch mode, host time that a short step does not hide: the 7B shape at 4k tokens
#: (0.12 TFLOP per layer) under a 7.9 GB budget stepped in 0.583 s keeping them against 0.459 s without (H200,
#: GPU busy 353 of 608 ms); at 16k (1.9 TFLOP) keeping them was 4.6% faster.
KEPT_ATTENTION_MIN_FLOPS = 10**12

#: Card memory kept out of the limit that decides automatic offload without a ``vram_budget``: the
#: CUDA context and kernels, which ``max_memory_allocated`` does not count (the cuBLAS workspaces it
#: does count are in the plan's fixed bytes: ``blas_workspace_bytes``).
_CONTEXT_RESERVE = 2**30


@dataclass(frozen=True)
class InputChoice:
    """Where a plan's layer inputs wait, as the planner chose it (NOTE [ Where layer inputs wait ]).

    Attributes:
        levels: Inputs on the card, in host memory, and one kept in ``k``.
        card_holds: The most inputs the budget holds on the card beside the rest of the step (those in flight and
            a segment's replayed ones counted).
        host_holds: The inputs the host memory free for them holds.
    """

    levels: InputLevels
    card_holds: int
    host_holds: int
    #: More inputs wait in host memory than the card needs, so that it keeps attention outputs and graphs instead.
    for_kept: bool = False

    def describe(self, num_layers: int, host_bytes: int) -> str:
        """What was chosen and why, for the log (``host_bytes``: what the inputs in host memory take)."""
        device, host, every = self.levels
        if every is None and not host:
            return f"layer inputs: all {num_layers} on the card (the budget holds them)"
        where = f"{device} on the card" + (f", {host} in host memory ({format_gib(host_bytes)} pinned)" if host else "")
        if every is not None:
            where = (
                f"one in {every} kept ({where}), the others replayed in the backward: no split of all {num_layers} fits"
            )
        holds = f"the budget holds {self.card_holds} at a time on the card, the host {self.host_holds}"
        if self.for_kept:
            holds += "; in host memory so that the card keeps attention outputs and graphs, which skip compute"
        return f"layer inputs: {where}; {holds}"


@dataclass(frozen=True)
class StepPlan:
    """The plan of a training step for micro-batches of up to ``tokens`` tokens.

    Attributes:
        tokens: Tokens per micro-batch planned for.
        residency: Which blocks stay resident, and the predicted peak.
        offload: Whether layer inputs wait for the backward in host memory.
        shape: The step shape the prediction was made from.
    """

    tokens: int
    residency: ResidencyPlan
    offload: bool
    shape: StepShape
    #: Why the card's budget gave way to streaming every block (NOTE [ The card as the default budget ]), else None.
    over_card: str | None = None
    #: Where the layer inputs wait, where the planner chose it (NOTE [ Where layer inputs wait ]), else None.
    inputs: InputChoice | None = None

    @property
    def offload_host_bytes(self) -> int:
        """Host bytes the offloaded layer inputs take (0 with offload off)."""
        return self.shape.offloaded_host_bytes()


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
        loss_chunk_tokens: Rows of logits the module's loss builds at a time (``None``: all).
        mlp_tile_tokens: Tokens per tile of the module's tiled MLPs (``None``: untiled).
        attention_tile_tokens: Queries per tile of the module's tiled attention (``None``: untiled).
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
        fused_mlp: The model's MLPs run Liger's fused gated activation (a smaller kept graph: ``StepShape``).
        fused_norm: The model's RMSNorms run Liger's kernel (no fp32 upcasts: smaller working sets and kept graphs).
        checkpoint_every: One layer input kept in this many, the others replayed (``input_checkpoint_every``).
        choose_inputs: Neither ``offload`` nor ``checkpoint_every`` was set: with a budget the planner chooses
            where the layer inputs wait (NOTE [ Where layer inputs wait ]).
        host_ranks: Processes on this machine, each offloading its own inputs: each plans for its share of its
            host memory.
        masked_row: The longest row seen whose attention runs with a mask (NOTE [ Masked attention ] in
            planning/step_shape.py); ``None`` until such a batch is seen.
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
    loss_chunk_tokens: int | None
    mlp_tile_tokens: int | None
    device_limit: int | None
    block_layers: Sequence[int] = ()
    keep_activations: bool = False
    adapter_dropout: bool = True
    window: int = 1
    offloaded_layers: int | None = None
    card: bool = False
    fused_mlp: bool = False
    checkpoint_every: int | None = None
    choose_inputs: bool = False
    host_ranks: int = 1
    attention_tile_tokens: int | None = None
    fused_norm: bool = False
    masked_row: int | None = None
    keep_attention: bool = True

    @classmethod
    def for_module(
        cls,
        module: nn.Module,
        model: nn.Module,
        block_bytes: Sequence[int],
        device: torch.device,
        prefetch_depth: int,
        budget: int | None,
        offload: bool | None,
        block_layers: Sequence[int] = (),
        keep_activations: bool = False,
        window: int = 1,
        ranks: int = 1,
        offloaded_layers: int | None = None,
        card: bool = False,
        checkpoint_every: int | None = None,
        host_ranks: int = 1,
    ) -> StepBudget:
        """The budget of a module set up on ``device``: what is there now, what the module declares.

        Device bytes are counted once per storage. The module declares a chunked loss, tiled MLPs and tiled
        attention with positive integer attributes ``loss_chunk_tokens``, ``mlp_tile_tokens`` and
        ``attention_tile_tokens`` (NOTE [ Chunked loss ] in loss.py, NOTE [ Tiled MLP ] in tiling.py, NOTE [ Tiled
        attention ] in attention.py).

        Args:
            module: The LightningModule, its rest moved to ``device``.
            model: The Hugging Face model inside it.
            block_bytes: Each block's slab size.
            device: The compute device.
            prefetch_depth: Blocks copied ahead of the one in use.
            budget: The ``vram_budget`` in bytes, or ``None``.
            offload: The ``offload_activations`` option.
            block_layers: Decoder layers in each block.
            keep_activations: The ``keep_activations`` option.
            window: Micro-batches of a block-major window (1: none).
            ranks: Data-parallel processes of the run: with several, DDP's gradient buckets (a flat copy of the
                trainable gradients on each rank's device, `ModelSizes.per_rank` in planning) count as fixed bytes.
            offloaded_layers: With offload on, the layers whose inputs go to host memory (``None``: all).
            card: ``budget`` is the card's, not the user's (NOTE [ The card as the default budget ]): a step it does
                not hold streams every block instead of being refused.
            checkpoint_every: The ``input_checkpoint_every`` option. With it and ``offload`` both ``None`` the planner
                chooses where the layer inputs wait (NOTE [ Where layer inputs wait ]).
            host_ranks: Processes on this machine (Lightning's devices per node), sharing its host memory.
        """
        head = model.get_output_embeddings()
        trainable = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        buckets = trainable if ranks > 1 else 0
        liger = liger_kernels_in(model)
        return cls(
            config=model.config,
            num_layers=len(find_decoder_stack(model, allow_unvalidated=True).layers),
            activation_bytes=head.weight.element_size() if head is not None else 2,
            block_bytes=list(block_bytes),
            prefetch_depth=prefetch_depth,
            fixed_bytes=device_bytes(module, device) + blas_workspace_bytes(device, blas_threads(window)) + buckets,
            trainable_bytes=trainable,
            budget=budget,
            offload=offload,
            loss_chunk_tokens=_declared_count(module, "loss_chunk_tokens"),
            mlp_tile_tokens=_declared_count(module, "mlp_tile_tokens"),
            device_limit=device_limit(device),
            block_layers=list(block_layers),
            keep_activations=keep_activations,
            adapter_dropout=_has_dropout(module),
            window=window,
            offloaded_layers=offloaded_layers,
            card=card,
            fused_mlp=liger["mlp"] > 0,
            checkpoint_every=checkpoint_every,
            choose_inputs=offload is None and checkpoint_every is None,
            host_ranks=host_ranks,
            attention_tile_tokens=_declared_count(module, "attention_tile_tokens"),
            fused_norm=liger["rms_norm"] > 0,
        )

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
            loss_chunk_tokens=self.loss_chunk_tokens,
            mlp_tile_tokens=self.mlp_tile_tokens,
            adapter_dropout=self.adapter_dropout,
            window=self.window,
            offloaded_layers=offloaded_layers,
            fused_mlp=self.fused_mlp,
            checkpoint_every=checkpoint_every,
            attention_tile_tokens=self.attention_tile_tokens,
            fused_norm=self.fused_norm,
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
            streamed, host_limit = unbudgeted._host_limited(tokens, host_bytes, streamed.offload_host_bytes)
        why = (
            f"the card's budget of {format_gib(self.budget)} is below what the plan predicts ({refusal}){host_limit};"
            " every block streams instead, unbudgeted. The prediction counts a loss the module does not declare as"
            " Hugging Face's (declare `loss_chunk_tokens` with a chunked loss); if the step runs out of memory,"
            " offload the layer inputs, tile the MLPs or shorten the micro-batches"
        )
        return replace(streamed, over_card=why)

    def _host_limited(self, tokens: int, host_bytes: int, all_bytes: int) -> tuple[StepPlan, str]:
        """The unbudgeted plan whose layer inputs keep the fewest on the card within ``host_bytes``, and why."""
        one = self.shape(tokens, False).input_bytes()
        levels = fewest_on_card(self.num_layers, host_bytes // one)
        shape = self.shape(tokens, False, levels)
        choice = InputChoice(levels, card_inputs(self.num_layers, levels.host_count, levels.k), host_bytes // one)
        plan = StepPlan(tokens, self._residency(shape, None), shape.offload_inputs, shape, inputs=choice)
        why = (
            f". Host memory was the limit too: {format_gib(host_bytes)} free for the layer inputs holds"
            f" {host_bytes // one} of the {self.num_layers} ({format_gib(all_bytes)} to offload them all), so they"
            f" wait {levels.device_count} on the card, {levels.host_count} in host memory"
            + (f", one in {levels.k} kept" if levels.k is not None else "")
        )
        return plan, why

    def _plan(self, tokens: int, host_bytes: int | None = None) -> StepPlan:
        if self.places_inputs:
            return self._plan_inputs(tokens, host_room(self.host_ranks) if host_bytes is None else host_bytes)
        choices = [self.offload] if self.offload is not None else [False] if self.window > 1 else [False, True]
        error: ValueError | None = None
        for offload in choices:
            shape = self.shape(tokens, offload)
            try:
                residency = self._residency(shape, self.budget)
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

    def _plan_inputs(self, tokens: int, host_bytes: int) -> StepPlan:
        """The plan at ``tokens`` tokens with the layer inputs where they fit (NOTE [ Where layer inputs wait ])."""
        try:
            choice = self._choose_inputs(tokens, host_bytes)
        except ValueError as error:
            longest = self._longest(tokens, host_bytes)
            raise ValueError(f"at {tokens} tokens per micro-batch {error} {longest}") from None
        shape = self.shape(tokens, False, choice.levels)
        plan = StepPlan(tokens, self._residency(shape, self.budget), shape.offload_inputs, shape, inputs=choice)
        return self._inputs_out_for_kept(plan, host_bytes)

    def _inputs_out_for_kept(self, plan: StepPlan, host_bytes: int) -> StepPlan:
        """``plan``, or one with more inputs in host memory skipping more compute (NOTE [ Where layer inputs wait ])."""
        assert plan.inputs is not None
        host = min(self.num_layers, host_bytes // plan.shape.input_bytes())
        if plan.inputs.levels.k is not None or host <= plan.inputs.levels.host_count:
            return plan
        layers = self.block_layers
        if self._attention_bytes(plan.shape) is None or plan.residency.covered_layers(layers) == self.num_layers:
            return plan
        levels = InputLevels(self.num_layers - host, host, None)
        shape = self.shape(plan.tokens, False, levels)
        try:
            residency = self._residency(shape, self.budget)
        except ValueError:
            return plan
        moved = StepPlan(plan.tokens, residency, True, shape, inputs=replace(plan.inputs, levels=levels, for_kept=True))
        skipped = moved.residency.skipped_flops(layers, moved.shape) > plan.residency.skipped_flops(layers, plan.shape)
        return moved if skipped else plan

    def _choose_inputs(self, tokens: int, host_bytes: int) -> InputChoice:
        """Where the layer inputs at ``tokens`` tokens wait under the budget and ``host_bytes`` of host memory.

        Raises:
            ValueError: If no split and no checkpoint spacing fits, or the step does not fit the budget even with
                the fewest inputs on the card.
        """
        assert self.budget is not None
        layers = self.num_layers
        # One split of every input per count of inputs on the card (NOTE [ Where layer inputs wait ]), fewest first.
        splits = sorted({card_inputs(layers, host, None): host for host in range(layers, -1, -1)}.items())
        fitting, failure = -1, None
        low, high = 0, len(splits) - 1
        while low <= high:
            middle = (low + high) // 2
            host = splits[middle][1]
            try:
                self._residency(self.shape(tokens, False, InputLevels(layers - host, host, None)), self.budget)
            except ValueError as error:
                failure, high = error, middle - 1
                continue
            fitting, low = middle, middle + 1
        if fitting < 0:
            assert failure is not None
            fewest = f"{splits[0][0]} on the card at a time, the fewest any choice keeps"
            raise ValueError(f"with the layer inputs offloaded to host memory ({fewest}), {failure}")
        shape = self.shape(tokens, False)
        holds, one = splits[fitting][0], shape.input_bytes()
        try:
            levels = input_levels(layers, tokens, shape.hidden_size, holds * one, host_bytes, self.activation_bytes)
        except ValueError as error:
            raise ValueError(
                f"the budget holds {holds} layer inputs on the card beside the rest of the step and the host memory"
                f" {host_bytes // one}: {error}"
            ) from None
        return InputChoice(levels, holds, host_bytes // one)

    def _longest(self, tokens: int, host_bytes: int) -> str:
        """What a refused length says: the longest micro-batch whose layer inputs have a place, and what to change."""

        def fits(length: int) -> bool:
            try:
                self._choose_inputs(length, host_bytes)
            except ValueError:
                return False
            return True

        granularity = GRANULARITY if tokens > GRANULARITY else 1
        longest = longest_fit(fits, granularity, limit=tokens)
        change = (
            "raise `vram_budget`, free host memory, or make the step smaller (`loss_chunk_tokens` with a chunked"
            " loss, `mlp_tile_tokens` with tiled MLPs)"
        )
        if longest is None:
            return f"Not even {granularity} tokens per micro-batch fit this budget: {change}."
        return (
            f"The longest micro-batch that fits this budget and {format_gib(host_bytes)} of host memory for the layer"
            f" inputs is {longest} tokens: train on at most that many per micro-batch (batch size x sequence"
            f" length; at setup `budget_tokens`, else the data module's `max_length` x `batch_size`), or {change}."
        )

    def _residency(self, shape: StepShape, budget: int | None) -> ResidencyPlan:
        """The residency plan of ``shape`` under ``budget`` (``plan_residency``'s ``ValueError`` if it does not fit)."""
        return plan_residency(
            block_bytes=list(self.block_bytes),
            prefetch_depth=self.prefetch_depth,
            fixed_bytes=self.fixed_bytes,
            trainable_bytes=self.trainable_bytes,
            activation_bytes=shape.activation_peak(),
            budget=budget,
            graph_bytes=self._graph_bytes(shape),
            attention_bytes=self._attention_bytes(shape),
        )

    @property
    def _keeps(self) -> bool:
        """Whether plans keep activations at all: the option, a budget, blocks, no block-major window."""
        return self.keep_activations and self.budget is not None and bool(self.block_layers) and self.window == 1

    def _graph_bytes(self, shape: StepShape) -> list[int] | None:
        """Each block's layers' graphs, when blocks may keep them (NOTE [ Kept activations ])."""
        return [layers * shape.layer_graph() for layers in self.block_layers] if self._keeps else None

    def _attention_bytes(self, shape: StepShape) -> list[int] | None:
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


def device_bytes(module: nn.Module, device: torch.device) -> int:
    """Bytes of ``module``'s parameters and buffers on ``device``, each storage once."""
    storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device == device:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def device_limit(device: torch.device) -> int | None:
    """The bytes a CUDA device lets this process allocate (its per-process cap, less the context), else ``None``."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(torch.cuda.get_per_process_memory_fraction(device) * total) - _CONTEXT_RESERVE


def _attention_dropout(config: Any) -> bool:
    """Whether the model's attention applies dropout in training (its config's ``attention_dropout``)."""
    config = getattr(config, "text_config", None) or config
    return bool(getattr(config, "attention_dropout", 0.0) or 0.0)


def _has_dropout(module: nn.Module) -> bool:
    """Whether any dropout with ``p > 0`` is in ``module`` (PEFT's adapter dropout is an ``nn.Dropout``)."""
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in module.modules())


def _declared_count(module: Any, name: str) -> int | None:
    """A positive integer the module declares for the planner, else ``None``."""
    value = getattr(module, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def reference_headroom(device: torch.device, budget: int | None, predicted_peak: int) -> int | None:
    """Device bytes a resident reference step may take now beyond the run's planned peak (``None``: no limit).

    The least of: what the budget leaves above the planned peak; on CUDA, the free and cached
    device memory less what the training step still needs to grow to its planned peak; and,
    under a per-process cap (``torch.cuda.set_per_process_memory_fraction``), what that cap leaves.
    """
    limits = []
    if budget is not None:
        # The budget caps the allocator, which needs its headroom (NOTE [ A budget is a cap on the card ]).
        limits.append((budget - ALLOCATOR_SLACK) * 100 // (100 + ALLOCATOR_HEADROOM_PERCENT) - predicted_peak)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        cached = torch.cuda.memory_reserved(device) - allocated
        # The blockwise step itself still has to grow from what is allocated now to its planned peak.
        still_needed = max(0, predicted_peak - allocated)
        limits.append(max(0, free + cached - still_needed))
        # A per-process cap binds the allocator before the card runs out: at most `fraction * total` bytes.
        cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
        limits.append(max(0, cap - allocated - still_needed))
    return min(limits) if limits else None


__all__ = [
    "KEPT_ATTENTION_MIN_FLOPS",
    "InputChoice",
    "StepBudget",
    "StepPlan",
    "device_bytes",
    "device_limit",
    "host_room",
]
