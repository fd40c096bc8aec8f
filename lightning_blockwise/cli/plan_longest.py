"""``lightning-blockwise plan --longest`` and ``--table``: the longest context a card and a host train, and a grid.

A length fits when the card's recommendation for it (:func:`~lightning_blockwise.planning.recommend.recommend`:
budget, block size, and offload, the chunked loss and tiled MLPs where needed; the attention tile and the kernels
``plan --kernels`` counts as given) fits the card, and the host holds what it pins (the arena and the offloaded
layer inputs) beside the embedding table and a reserve. The search and the step-time formula are
:mod:`lightning_blockwise.planning.longest`'s; :mod:`~lightning_blockwise.cli.plan_table` prints the answers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from lightning_blockwise.cli.plan_arguments import TABLE_CARDS_GIB, TABLE_LENGTHS
from lightning_blockwise.planning.footprint import ModelSizes
from lightning_blockwise.planning.input_levels import INPUTS_IN_FLIGHT, card_inputs
from lightning_blockwise.planning.longest import (
    DEFAULT_LINK_GBPS,
    DEFAULT_TFLOPS,
    GRANULARITY,
    StepCost,
    StepTime,
    longest_fit,
    step_time,
)
from lightning_blockwise.planning.memory import ALLOCATOR_HEADROOM_PERCENT
from lightning_blockwise.planning.recommend import SMALLEST_CARD, Recommendation, recommend
from lightning_blockwise.planning.step_kernels import PLAIN_KERNELS, StepKernels
from lightning_blockwise.planning.step_shape import StepShape
from lightning_blockwise.residency.arena import HOST_RAM_RESERVE

#: The memories a length can run out of, in the order they are checked and named.
MEMORIES = ("card", "host", "pinned")


@dataclass(frozen=True)
class Machine:
    """The card and host a context is planned for, and the rates its step time is estimated from.

    Attributes:
        card: The card's memory, in bytes.
        host_ram: The host's RAM, in bytes.
        pinned_limit: The most host memory that may be page-locked (a container's or ``ulimit -l``'s limit), in
            bytes; ``None``: the host RAM is the only limit.
        tflops: The card's sustained bf16 matmul rate, in TFLOP/s.
        link_gbps: The host link's rate, in GB/s.
        recompute_every: A second-level recompute keeping every k-th layer's input (``None``: off).
        prefetch_depth: Blocks copied ahead of the one in use.
        offload: ``offload_activations`` as given; ``None``: the recommendation chooses.
        kernels: How the module computes the step (its tiles, the loss chunk, ``plan --kernels``), as
            :func:`~lightning_blockwise.planning.recommend.recommend` takes it: a loss chunk or MLP tile left
            ``None`` is chosen there.
    """

    card: int
    host_ram: int
    pinned_limit: int | None = None
    tflops: float = DEFAULT_TFLOPS
    link_gbps: float = DEFAULT_LINK_GBPS
    recompute_every: int | None = None
    prefetch_depth: int = 2
    offload: bool | None = None
    kernels: StepKernels = PLAIN_KERNELS


@dataclass(frozen=True)
class ContextFit:
    """Whether a micro-batch of ``tokens`` tokens (batch 1) trains on a machine, with what, and how fast.

    Attributes:
        tokens: Tokens per micro-batch.
        advice: The card's recommendation for that length (its ``plan`` is ``None`` where the card is too small).
        pinned_bytes: Host memory page-locked: the arena and the offloaded layer inputs.
        host_bytes: Host RAM needed: the pinned bytes, the embedding table and the arena's reserve.
        binds: The memories too small for it, of :data:`MEMORIES` (empty: it fits).
        time: The expected step time where it fits.
    """

    tokens: int
    advice: Recommendation
    pinned_bytes: int
    host_bytes: int
    binds: tuple[str, ...]
    time: StepTime | None

    @property
    def fits(self) -> bool:
        """Whether every memory holds it."""
        return not self.binds


def context_fit(sizes: ModelSizes, machine: Machine, tokens: int) -> ContextFit:
    """Whether ``tokens`` tokens (batch 1) train on ``machine``, as its recommendation plans them.

    With a second-level recompute every ``k`` layers (``machine.recompute_every``, a planned option), only every
    k-th layer's input is offloaded (host bytes / k), and the ``k - 2`` inputs a segment's backward holds beyond
    those the offload has in flight anyway are counted on the card, with the allocator's headroom (``card_inputs``
    in planning/input_levels.py; at these lengths the recommendation offloads the inputs).
    """
    every = machine.recompute_every
    input_bytes = tokens * _text(sizes.config).hidden_size * sizes.activation_bytes
    extra = 0 if not every else card_inputs(sizes.num_layers, -(-sizes.num_layers // every), every)
    extra = max(0, extra - INPUTS_IN_FLIGHT)
    segment = extra * input_bytes * (100 + ALLOCATOR_HEADROOM_PERCENT) // 100
    # The inputs a segment's backward adds sit on the card beside the step: what is left of the card is planned for,
    # and where nothing usable is left the card binds (never a larger card than the one asked about).
    left = machine.card - segment
    card = max(left, SMALLEST_CARD)
    advice = recommend(sizes, card, tokens, machine.prefetch_depth, machine.offload, machine.kernels)
    advice = _with_card(advice, machine.card)
    if left < SMALLEST_CARD:
        advice = replace(advice, plan=None)
    offloaded = advice.offload_host_bytes
    if every and offloaded:
        offloaded = -(-sizes.num_layers // every) * input_bytes
    pinned = sizes.host_bytes(advice.block_size) + offloaded
    host = pinned + sizes.host_embedding_bytes + HOST_RAM_RESERVE
    binds = (
        ("card",) * (advice.plan is None)
        + ("host",) * (host > machine.host_ram)
        + ("pinned",) * (machine.pinned_limit is not None and pinned > machine.pinned_limit)
    )
    time = None
    if advice.plan is not None:
        blocks = sizes.block_bytes(advice.block_size)
        streamed = sum(nbytes for index, nbytes in enumerate(blocks) if index not in advice.plan.resident)

        # Kept layers run once, not recomputed (NOTE [ Expected step time ]): the last block may hold fewer layers.
        def layers(blocks: tuple[int, ...]) -> int:
            return sum(min(advice.block_size, sizes.num_layers - block * advice.block_size) for block in blocks)

        kept = layers(advice.plan.kept)
        cost = StepCost(
            matmul_params=matmul_params(sizes),
            num_layers=sizes.num_layers,
            attention_size=attention_size(sizes.config),
            arena_bytes=streamed,
            offloaded_bytes=offloaded,
            recomputed_params=_recomputed_params(sizes, advice),
            recompute_every=every,
            kept_layers=kept,
            kept_params=kept * _layer_params(sizes.config),
            tiled_attention=advice.attention_tile_tokens is not None and advice.attention_tile_tokens < tokens,
            attention_layers=layers(advice.plan.attention),
        )
        time = step_time(cost, tokens, machine.tflops, machine.link_gbps)
    return ContextFit(tokens, advice, pinned, host, binds, time)


def longest_context(sizes: ModelSizes, machine: Machine) -> tuple[ContextFit | None, ContextFit]:
    """The longest context (batch 1, a multiple of 1024 tokens) ``machine`` trains, and the next length's verdict.

    Returns:
        The longest fit (``None`` if not even 1024 tokens fit), and the fit of the length one step longer: what
        it says binds is what stops a longer context.
    """
    fits: dict[int, ContextFit] = {}

    def fits_at(tokens: int) -> bool:
        fits[tokens] = context_fit(sizes, machine, tokens)
        return fits[tokens].fits

    tokens = longest_fit(fits_at)
    following = (tokens or 0) + GRANULARITY
    after = fits.get(following) or context_fit(sizes, machine, following)
    return (fits[tokens] if tokens is not None else None), after


def context_table(
    sizes: ModelSizes,
    machine: Machine,
    lengths: tuple[int, ...] = TABLE_LENGTHS,
    cards_gib: tuple[int, ...] = TABLE_CARDS_GIB,
) -> dict[str, Any]:
    """Every length on every card (in GiB) of ``machine``'s host: the fits, and each card's longest context."""
    cells = {}
    longest = {}
    for gib in cards_gib:
        card = Machine(**{**vars(machine), "card": gib * 2**30})
        cells[gib] = [context_fit(sizes, card, tokens) for tokens in lengths]
        longest[gib] = longest_context(sizes, card)
    return {"lengths": lengths, "cards_gib": cards_gib, "cells": cells, "longest": longest}


def matmul_params(sizes: ModelSizes) -> int:
    """Weights of the matmuls a token passes through: each decoder layer's linears (Llama-style) and the LM head."""
    return config_matmul_params(sizes.config, sizes.num_layers)


def config_matmul_params(config: Any, num_layers: int) -> int:
    """:func:`matmul_params` from a config and its decoder layers' count alone."""
    config = _text(config)
    return num_layers * _layer_params(config) + config.vocab_size * config.hidden_size


def _layer_params(config: Any) -> int:
    """Weights of one decoder layer's linears (Llama-style): the attention's four and the MLP's three."""
    return StepShape.for_config(config, tokens=1, num_layers=1).linear_params()


def _recomputed_params(sizes: ModelSizes, advice: Recommendation) -> int:
    return recomputed_params(
        sizes.config, sizes.num_layers, bool(advice.mlp_tile_tokens), bool(advice.loss_chunk_tokens)
    )


def recomputed_params(config: Any, num_layers: int, mlp_tiled: bool, loss_chunked: bool) -> int:
    """Weights a step runs one forward more: the tiled MLPs' and, with the chunked loss, the LM head's."""
    config = _text(config)
    mlp = num_layers * 3 * config.hidden_size * config.intermediate_size if mlp_tiled else 0
    head = config.vocab_size * config.hidden_size if loss_chunked else 0
    return mlp + head


def _text(config: Any) -> Any:
    """A config's language model's (its ``text_config`` for a multimodal one)."""
    return getattr(config, "text_config", None) or config


def attention_size(config: Any) -> int:
    """Attention heads x head size: the width of Q (``StepCost.attention_size``)."""
    config = _text(config)
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)


def _with_card(advice: Recommendation, card: int) -> Recommendation:
    """The recommendation as made for ``card`` (a second-level recompute plans it on a smaller one)."""
    if advice.gpu_memory == card:
        return advice
    return Recommendation(**{**vars(advice), "gpu_memory": card})


__all__ = [
    "MEMORIES",
    "TABLE_CARDS_GIB",
    "TABLE_LENGTHS",
    "ContextFit",
    "Machine",
    "attention_size",
    "config_matmul_params",
    "context_fit",
    "context_table",
    "longest_context",
    "matmul_params",
    "recomputed_params",
]
