"""The memory model of a training step: activations, and which blocks a VRAM budget keeps resident."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_blockwise.planning.units import format_gib

#: Bytes per token per vocabulary entry at the loss's peak: the bf16 logits (kept for the
#: outputs), log-softmax's fp32 output (saved for its backward) and the fp32 gradient flowing
#: through it, with part of a second one (12 fit the 7B-72B H100 peaks in benchmarks/RESULTS.md, but a
#: Qwen2.5-1.5B step at 4096 tokens, logits-bound, allocated 0.4% over a plan made with 12:
#: tests/gpu/test_gpu_budget.py; 12.5 covers it).
_LOGIT_BYTES_PER_ENTRY = 12.5
#: Hidden-state-sized tensors alive besides the saved inputs: the decoder's output, its gradient,
#: and a layer's incoming and outgoing gradients.
_HIDDEN_STATES_ALIVE = 4
#: The caching allocator rounds every block up (512 B, 2 MiB for large ones); the peak it reports
#: counts the rounded sizes. Measured peaks were up to 1% above the unrounded sum.
_ALLOCATOR_ROUNDING = 1.02
#: The cap a budget sets on the caching allocator over the predicted allocated peak
#: (NOTE [ A budget is a cap on the card ]).
ALLOCATOR_HEADROOM_PERCENT = 10
#: And a fixed slack over it for the caching allocator's segments (2 MiB and 20 MiB ones, partly used), which
#: only small budgets notice: caps of 27 and 67 MiB ran out of memory at 6 and 28 MiB allocated (H100, a small
#: Llama in tests/gpu/test_gpu_streaming.py).
ALLOCATOR_SLACK = 128 * 2**20
#: Threads whose matmuls each get a cuBLAS workspace from the caching allocator during a step: the
#: forward's and autograd's device thread (a workspace belongs to a handle, and handles to threads).
#: Freed by ``torch.cuda.empty_cache`` and allocated again at the next matmul, so they count in the
#: step's peak: 2 x 32 MiB measured on the H100 (tests/gpu/test_gpu_streaming.py, a model small
#: enough for them to be most of its peak).
BLAS_THREADS = 2
#: One cuBLAS workspace under torch's default on Hopper and later (``CUBLAS_WORKSPACE_CONFIG=:4096:8``);
#: what ``plan`` assumes, not knowing the card.
HOPPER_BLAS_WORKSPACE = 8 * 4096 * 2**10
#: Layer inputs on the device at a time with offload on: the one in use, the next one coming
#: back, and one being copied out (NOTE [ Layer-input offload ] in residency/activations.py).
_INPUTS_IN_FLIGHT = 3


@dataclass(frozen=True)
class StepShape:
    """What a training step's activation memory depends on.

    Args:
        tokens: Tokens per micro-batch (batch size x sequence length), at most.
        hidden_size: The model's hidden size.
        intermediate_size: The MLP's inner size.
        vocab_size: The vocabulary size.
        num_layers: Decoder layers.
        activation_bytes: Bytes per activation element (2 under bf16 autocast).
        offload_inputs: Layer inputs wait for the backward in host memory (not on the device).
        offloaded_layers: With ``offload_inputs``, how many layers' inputs (the first ones) go to host memory, the
            rest staying on the device (NOTE [ Split layer inputs ] in residency/activations.py); ``None``: all.
        loss_chunk_tokens: Rows of logits the module's loss builds at a time
            (:func:`~lightning_blockwise.longcontext.loss.chunked_causal_lm_loss`); ``None``: all of them at once,
            as Hugging Face's loss does.
        mlp_tile_tokens: Tokens per tile of the decoder layers' MLPs
            (:func:`~lightning_blockwise.longcontext.tiling.tile_mlps`); ``None``: untiled.
        adapter_dropout: The adapters apply dropout to their inputs (what a kept layer's graph also
            holds); assumed when unknown.
        window: Micro-batches whose layer inputs are saved at once: ``accumulate_grad_batches`` with
            block-major accumulation (NOTE [ Block-major accumulation ] in replay/block_major.py), else 1.
    """

    tokens: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    activation_bytes: int = 2
    offload_inputs: bool = False
    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None
    adapter_dropout: bool = True
    window: int = 1
    offloaded_layers: int | None = None

    @classmethod
    def for_config(
        cls,
        config: Any,
        tokens: int,
        num_layers: int,
        activation_bytes: int = 2,
        offload_inputs: bool = False,
        loss_chunk_tokens: int | None = None,
        mlp_tile_tokens: int | None = None,
        adapter_dropout: bool = True,
        window: int = 1,
        offloaded_layers: int | None = None,
    ) -> StepShape:
        """The step shape of a Hugging Face model config (its ``text_config`` for a multimodal one).

        Args:
            config: The model's ``PretrainedConfig``.
            tokens: Tokens per micro-batch.
            num_layers: Decoder layers.
            activation_bytes: Bytes per activation element (the LM head's element size).
            offload_inputs: Layer inputs wait for the backward in host memory.
            loss_chunk_tokens: Rows of logits the loss builds at a time (``None``: all).
            mlp_tile_tokens: Tokens per MLP tile (``None``: untiled).
            adapter_dropout: The adapters apply dropout to their inputs.
            window: Micro-batches whose layer inputs are saved at once (block-major accumulation).
            offloaded_layers: With ``offload_inputs``, the layers whose inputs go to host memory (``None``: all).
        """
        config = getattr(config, "text_config", None) or config
        return cls(
            tokens=tokens,
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
            vocab_size=config.vocab_size,
            num_layers=num_layers,
            activation_bytes=activation_bytes,
            offload_inputs=offload_inputs,
            loss_chunk_tokens=loss_chunk_tokens,
            mlp_tile_tokens=mlp_tile_tokens,
            adapter_dropout=adapter_dropout,
            window=window,
            offloaded_layers=offloaded_layers,
        )

    def activation_peak(self) -> int:
        """Predicted activation bytes at the step's peak.

        Saved layer inputs (one tensor per layer between forward and backward, or the few in
        flight when they wait in host memory), plus the larger of two working sets that are
        never alive together: the loss's logits and their gradients (``loss_chunk_tokens`` rows
        at a time with a chunked loss), which are freed before the decoder's backward starts,
        and one layer's recompute graph with the dequantized weight of its largest projection
        (while a layer's backward runs).
        """
        host = self.host_inputs()
        saved_inputs = self.num_layers - host + min(host, _INPUTS_IN_FLIGHT)
        saved_inputs *= self.input_bytes() * self.window
        rows = self.tokens if self.loss_chunk_tokens is None else min(self.tokens, self.loss_chunk_tokens)
        logits = int(rows * self.vocab_size * _LOGIT_BYTES_PER_ENTRY)
        dequantized = 2 * self.hidden_size * self.intermediate_size * self.activation_bytes
        # The decoder's last hidden states and the gradients flowing through the stack, alive throughout.
        through = _HIDDEN_STATES_ALIVE * self.input_bytes()
        # Block-major: the other micro-batches' decoder outputs, and their gradients waiting for the window's backward.
        through += 2 * (self.window - 1) * self.input_bytes()
        peak = saved_inputs + through + max(logits, self.layer_working_set() + dequantized)
        return int(peak * _ALLOCATOR_ROUNDING)

    def layer_working_set(self) -> int:
        """Predicted bytes one layer's recompute and backward add at their peak (without the dequantized weight).

        The MLP's intermediates and their gradients, six ``tokens x intermediate`` tensors, and five
        hidden-state-sized ones of attention and the norms, beyond the hidden states and gradients
        :meth:`activation_peak` counts throughout. Fitted on the H100 (``benchmarks/memory_peak.py``:
        at 7B and 16k tokens the step's peak holds six MLP-sized and twelve hidden-sized bf16
        equivalents; one layer alone, ``benchmarks/layer_working_set.py``, 302/439/524 KB per token at
        7B/32B/72B). With tiled MLPs the MLP's part is one tile's, and the tiles' saved inputs,
        concatenated outputs and their gradients add five hidden-sized tensors (NOTE [ Tiled MLP ]).
        """
        if self.mlp_tile_tokens is None or self.mlp_tile_tokens >= self.tokens:
            hidden, mlp_tokens = 5, self.tokens  # a step within one tile runs the MLP untiled (TiledMLP)
        else:
            hidden, mlp_tokens = 10, self.mlp_tile_tokens
        per_token = hidden * self.tokens * self.hidden_size + 6 * mlp_tokens * self.intermediate_size
        return per_token * self.activation_bytes

    def input_bytes(self) -> int:
        """Bytes of one layer's input (what a rematerialized layer saves for its backward)."""
        return self.tokens * self.hidden_size * self.activation_bytes

    def host_inputs(self) -> int:
        """Layers whose inputs wait for the backward in host memory."""
        if not self.offload_inputs:
            return 0
        return self.num_layers if self.offloaded_layers is None else min(self.offloaded_layers, self.num_layers)

    def offloaded_host_bytes(self) -> int:
        """Host bytes the saved layer inputs take with offload on (every offloaded layer's input at once), else 0."""
        return self.host_inputs() * self.input_bytes()

    def layer_graph(self) -> int:
        """Predicted bytes of one decoder layer's autograd graph (what a resident layer keeps until its backward).

        Eight hidden-sized and four MLP-sized tensors per token, and with adapter dropout six
        hidden-sized and one MLP-sized more (each adapter keeps its dropped-out input): resident
        training without checkpointing measured 192 and 203 KB per token and layer at the Qwen2.5-7B
        shape without dropout (2048 and 4096 tokens, H100, LoRA r16 on all seven projections;
        ``benchmarks/results/h100_long_context.jsonl``), 209 predicted; kept layers of the Qwen2.5-32B
        shape with dropout 0.05 about 387 (``benchmarks/card_check.py``, 1024 tokens), 420 predicted.
        """
        hidden, mlp = (14, 5) if self.adapter_dropout else (8, 4)
        graph = self.tokens * (hidden * self.hidden_size + mlp * self.intermediate_size) * self.activation_bytes
        # Rounded as the allocator rounds (a 1.5B run with kept blocks allocated 0.4% above the unrounded sum).
        return int(graph * _ALLOCATOR_ROUNDING)


# NOTE [ A budget is a cap on the card ]
# What runs out on a card is what the caching allocator has reserved, not what tensors hold: a
# budget that bounds only the allocated peak let the allocator reserve 1.1-1.3x of it with
# expandable segments and 1.2-2.6x without (benchmarks/RESULTS.md, "Long context"), and a run
# sized to the card could still die. So a ``vram_budget`` is made a cap: on CUDA the strategy sets
# it as the allocator's per-process limit (``torch.cuda.set_per_process_memory_fraction``), with
# expandable segments on (device_memory.py), and the allocator frees its cache and maps
# pages rather than reserve past it. What the cap
# must leave over the allocated peak was measured (``benchmarks/allocator_cap.py``, H100, 7B at 4k
# and 16k tokens, with and without offload and tiling): with expandable segments a cap of 1.05x the
# allocated peak ran every point and 1.02x ran out of memory in each; without them even 1.10x ran
# out in each. The plan therefore keeps ``ALLOCATOR_HEADROOM_PERCENT`` (10%), plus
# ``ALLOCATOR_SLACK`` for the smallest budgets, between its predicted allocated peak, itself never
# under the measured one, and the budget; at 1.05x the tightest point was 7% slower (the allocator
# freeing and remapping), at 1.10x none was.


# NOTE [ Kept activations ]
# A rematerialized layer runs its forward twice per step: once without a graph, once in the
# backward to build it. With a frozen 4-bit base that second forward is the whole price of
# streaming on a compute-bound step (H100, 7B and 32B: copies hide under compute), so memory
# spent on resident blocks alone buys nothing there. A kept block is resident and its layers
# run as in resident training, with plain autograd: their graph lives from the forward to the
# backward, and nothing is recomputed. Plain autograd on a resident block is what `ParityCheck`'s
# reference already runs (NOTE [ Resident prefix ] in streamed_stack.py), bit-identical to
# resident training; the block stays bound to the same device copy until its backward, since
# resident blocks change only between steps (NOTE [ Graphs do not outlive residency ] in
# replay/remat.py). A streamed block may keep its graphs as well: its backward brings it back
# to the slot it had in the forward first (NOTE [ Kept graphs of streamed blocks ] in
# replay/kept.py). The planner keeps resident blocks from the first one on while the budget
# holds their slabs and graphs, then spends what is left on resident blocks only, which save
# copies, worth it only where the step waits on the link. A timed plan that spent the budget by
# a measured step was no faster on the H100 (benchmarks/RESULTS.md, "Timed plan") and was
# removed. `keep_activations=False` spends the whole budget on residency.


@dataclass(frozen=True)
class ResidencyPlan:
    """Which blocks stay on the device for the whole run, and the memory that is predicted to take.

    Attributes:
        resident: Blocks copied to the device once and kept there.
        kept: Blocks whose layers keep their autograd graph from the forward to the backward
            instead of recomputing it (NOTE [ Kept activations ]); resident or streamed.
        num_slots: Device slots for the streamed blocks.
        slot_bytes: Bytes of one slot (the largest streamed block).
        predicted_peak: Predicted peak allocated device memory of a training step, in bytes.
        minimum: The smallest budget that streams every block (its predicted peak with the
            allocator's headroom, NOTE [ A budget is a cap on the card ]).
    """

    resident: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    predicted_peak: int
    minimum: int
    kept: tuple[int, ...] = ()

    @property
    def predicted_reserved(self) -> int:
        """The budget this plan needs: its predicted peak with the allocator's headroom."""
        return with_headroom(self.predicted_peak)


def with_headroom(allocated: int) -> int:
    """The allocator cap an allocated peak of ``allocated`` bytes needs: 10% and 128 MiB more.

    NOTE [ A budget is a cap on the card ].
    """
    return allocated + -(-allocated * ALLOCATOR_HEADROOM_PERCENT // 100) + ALLOCATOR_SLACK


def plan_residency(
    block_bytes: list[int], prefetch_depth: int, fixed_bytes: int, trainable_bytes: int, activation_bytes: int,
    budget: int | None, graph_bytes: list[int] | None = None,
) -> ResidencyPlan:  # fmt: skip
    """Keep as many blocks resident as ``budget`` allows; stream the rest (all of them without a budget).

    A plan fits the budget when its predicted peak with the allocator's headroom does
    (NOTE [ A budget is a cap on the card ]). The prediction adds what is on the device for the
    whole run (``fixed_bytes``: head, norms, adapters), the adapters' gradients and AdamW state
    (3 x ``trainable_bytes``), the activations, the slots and the resident blocks. Blocks are
    kept resident from the first one on: every block but those around the forward/backward turn
    is loaded twice per step, so any resident block saves the same traffic. With ``graph_bytes``
    the budget first goes to kept blocks (resident, and their layers' graphs kept: no recompute),
    from the first on, then to more resident blocks (NOTE [ Kept activations ]).

    Args:
        block_bytes: Each block's slab size.
        prefetch_depth: Blocks copied ahead of the one in use.
        fixed_bytes: Device bytes that do not depend on the plan.
        trainable_bytes: Bytes of the trainable parameters.
        activation_bytes: Predicted activation peak (:meth:`StepShape.activation_peak`).
        budget: The cap on the allocator, in bytes, or ``None`` to stream every block.
        graph_bytes: Each block's layers' autograd graphs (:meth:`StepShape.layer_graph` per layer),
            what keeping it costs beyond its slab; ``None``: every layer is recomputed.

    Raises:
        ValueError: If ``budget`` is below the minimum (every block streamed).
    """
    base = fixed_bytes + 3 * trainable_bytes + activation_bytes

    def peak(resident: int, kept_bytes: int = 0) -> tuple[int, int, int]:
        streamed = block_bytes[resident:]
        slots = min(prefetch_depth + 1, len(streamed))
        slot_bytes = max(streamed, default=0)
        return base + slots * slot_bytes + sum(block_bytes[:resident]) + kept_bytes, slots, slot_bytes

    def fits(resident: int, kept_bytes: int) -> bool:
        assert budget is not None
        return with_headroom(peak(resident, kept_bytes)[0]) <= budget

    streamed_peak, slots, slot_bytes = peak(0)
    minimum = with_headroom(streamed_peak)
    if budget is None:
        return ResidencyPlan((), slots, slot_bytes, streamed_peak, minimum)
    if budget < minimum:
        raise ValueError(
            f"the budget of {format_gib(budget)} is below the {format_gib(minimum)} this run needs with every block"
            f" streamed ({len(block_bytes)} blocks, {slots} slots of {slot_bytes / 2**20:.0f} MiB; a predicted peak"
            f" of {format_gib(streamed_peak)} allocated, and {ALLOCATOR_HEADROOM_PERCENT}% +"
            f" {ALLOCATOR_SLACK // 2**20} MiB for the allocator). Raise the budget to at least {format_gib(minimum)},"
            " or lower `prefetch_depth`, `block_size` or the tokens per micro-batch."
        )
    graphs = graph_bytes or []
    kept, kept_bytes = 0, 0
    while kept < len(graphs) and fits(kept + 1, kept_bytes + graphs[kept]):
        kept_bytes += graphs[kept]
        kept += 1
    resident = kept
    while resident < len(block_bytes) and fits(resident + 1, kept_bytes):
        resident += 1
    kept_blocks = tuple(range(kept))
    predicted, slots, slot_bytes = peak(resident, kept_bytes)
    return ResidencyPlan(tuple(range(resident)), slots, slot_bytes, predicted, minimum, kept_blocks)


__all__ = [
    "ALLOCATOR_HEADROOM_PERCENT",
    "ALLOCATOR_SLACK",
    "ResidencyPlan",
    "StepShape",
    "plan_residency",
    "with_headroom",
]
