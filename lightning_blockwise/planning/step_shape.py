"""What a training step's activations take: the step's shape and the memory model of one step.

:class:`StepShape` is what activation memory depends on (tokens, sizes, the long-context options);
its methods give the predicted peak, a layer's working set and its graph. Pure arithmetic, fitted on and
checked against H100 measurements (``tests/planning/test_calibration.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_blockwise.planning.activation_constants import (
    ALLOCATOR_ROUNDING,
    ATTENTION_BLOCK_HIDDEN,
    ATTENTION_PEAK_HIDDEN,
    CHUNK_LOGIT_BYTES_PER_ENTRY,
    FUSED_ATTENTION_PEAK_HIDDEN,
    FUSED_NORM_GRAPH_HIDDEN,
    FUSED_NORM_MLP_HIDDEN,
    FUSED_NORM_PEAK_HIDDEN,
    HIDDEN_STATES_ALIVE,
    LOGIT_BYTES_PER_ENTRY,
    NORM_PEAK_HIDDEN,
)
from lightning_blockwise.planning.input_levels import card_inputs
from lightning_blockwise.planning.step_kernels import PLAIN_KERNELS, StepKernels

# NOTE [ Masked attention ]
# Causal rows without padding run SDPA with `is_causal=True` and no mask, and grouped-query attention passes the
# keys and values as they are (`enable_gqa`). Padded rows, and packed rows whose positions restart, make
# transformers build a mask (a boolean batch x 1 x row x row, once per forward), and with a mask its SDPA path
# repeats the keys and values to every query head (`repeat_kv`; transformers 5.x on CUDA), and SDPA turns the boolean
# mask into an additive one of the activations' dtype for its kernel. Both are saved for the backward by every layer
# that keeps its graph, and by the layer being recomputed. Measured (H100, Qwen2.5-7B shape, 2 rows of 4096 tokens
# packed by 512, Liger and the fused update; `benchmarks/layer_allocations.py --packed 512`): per layer, the additive
# mask (1.14 hidden-sized tensors: 2 x 4096 x 4096 x 2 B) and the two repeated key and value tensors (one hidden-sized
# each) at the sdpa call. The plan of 9 kept layers on packed rows that missed them was 1.8% under. Counted here: the
# additive mask and the repeats beyond the keys and values per kept graph and in the recomputed layer, the boolean mask
# throughout. The step budget learns the row from the batches it sees (`masked_row` in strategy/step_tokens.py).


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
        loss_chunk_tokens: Rows of logits the loss builds at a time (``None``: all); it and the two tile sizes come
            from :class:`~lightning_blockwise.planning.step_kernels.StepKernels`, where each is documented.
        mlp_tile_tokens: Tokens per tile of the decoder layers' MLPs (``None``: untiled).
        attention_tile_tokens: Queries per tile of the decoder layers' attention (``None``: untiled).
        adapter_dropout: The adapters apply dropout to their inputs (what a kept layer's graph also
            holds); assumed when unknown.
        window: Micro-batches whose layer inputs are saved at once: ``accumulate_grad_batches`` with
            block-major accumulation (NOTE [ Block-major accumulation ] in replay/block_major.py), else 1.
        kv_size: Elements per token of attention's keys (and of its values): key-value heads x head size;
            ``None``: ``hidden_size`` (no grouped-query attention).
        checkpoint_every: One layer input kept in this many, the others replayed in the backward (NOTE [ Input
            checkpoints ] in replay/segments.py); ``None``: every layer's input kept.
        fused_norm: The decoder's RMSNorms run Liger's kernel (``kernels/liger.py``), which keeps and makes no fp32
            upcasts of its input: smaller working sets and kept graphs (NOTE [ A layer's backward peak ]).
        masked_row: Tokens per row where attention runs SDPA with a mask (padded or packed rows), ``None`` where it
            runs causal without one (NOTE [ Masked attention ]).
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
    kv_size: int | None = None
    fused_mlp: bool = False
    checkpoint_every: int | None = None
    attention_tile_tokens: int | None = None
    fused_norm: bool = False
    masked_row: int | None = None
    #: Query heads and their width (``None``: the hidden size in one head): what a kept attention output takes.
    query_heads: int | None = None
    query_size: int | None = None

    @classmethod
    def for_config(
        cls,
        config: Any,
        tokens: int,
        num_layers: int,
        activation_bytes: int = 2,
        offload_inputs: bool = False,
        kernels: StepKernels = PLAIN_KERNELS,
        adapter_dropout: bool = True,
        window: int = 1,
        offloaded_layers: int | None = None,
        checkpoint_every: int | None = None,
        masked_row: int | None = None,
    ) -> StepShape:
        """The step shape of a Hugging Face model config (its ``text_config`` for a multimodal one).

        Args:
            config: The model's ``PretrainedConfig``.
            tokens: Tokens per micro-batch.
            num_layers: Decoder layers.
            activation_bytes: Bytes per activation element (the LM head's element size).
            offload_inputs: Layer inputs wait for the backward in host memory.
            kernels: How the module computes the step: its loss chunk, MLP and attention tiles, Liger's kernels
                (taken as they are: a fused activation counts even with an MLP tile).
            adapter_dropout: The adapters apply dropout to their inputs.
            window: Micro-batches whose layer inputs are saved at once (block-major accumulation).
            offloaded_layers: With ``offload_inputs``, the layers whose inputs go to host memory (``None``: all).
            checkpoint_every: One layer input kept in this many (``None``: every one).
            masked_row: Tokens per row where attention runs SDPA with a mask (``None``: causal, no mask).
        """
        config = getattr(config, "text_config", None) or config
        heads = getattr(config, "num_attention_heads", None)
        head_size = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            tokens=tokens,
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
            vocab_size=config.vocab_size,
            num_layers=num_layers,
            activation_bytes=activation_bytes,
            offload_inputs=offload_inputs,
            loss_chunk_tokens=kernels.loss_chunk_tokens,
            mlp_tile_tokens=kernels.mlp_tile_tokens,
            adapter_dropout=adapter_dropout,
            window=window,
            offloaded_layers=offloaded_layers,
            kv_size=kv_heads * head_size if kv_heads and head_size else None,
            query_heads=heads,
            query_size=heads * head_size if heads and head_size else None,
            fused_mlp=kernels.fused_mlp,
            checkpoint_every=checkpoint_every,
            attention_tile_tokens=kernels.attention_tile_tokens,
            fused_norm=kernels.fused_norm,
            masked_row=masked_row,
        )

    def activation_peak(self) -> int:
        """Predicted activation bytes at the step's peak.

        Saved layer inputs on the card (one tensor per layer between forward and backward, one per
        segment and a segment's replayed ones with input checkpoints, the few in flight of those
        waiting in host memory: :func:`~.input_levels.card_inputs`), hidden states alive throughout, plus the larger of
        two working sets that are never alive together: the loss's logits and their gradients
        (``loss_chunk_tokens`` rows at a time with a chunked loss), which are freed before the
        decoder's backward starts, and one layer's recompute and backward (:meth:`layer_working_set`).
        """
        saved_inputs = card_inputs(self.num_layers, self.host_inputs(), self.checkpoint_every)
        saved_inputs *= self.input_bytes() * self.window
        if self.loss_chunk_tokens is None:
            logits = int(self.tokens * self.vocab_size * LOGIT_BYTES_PER_ENTRY)
        else:
            logits = min(self.tokens, self.loss_chunk_tokens) * self.vocab_size * CHUNK_LOGIT_BYTES_PER_ENTRY
        # The decoder's last hidden states and the gradients flowing through the stack, alive throughout.
        through = HIDDEN_STATES_ALIVE * self.input_bytes()
        # Block-major: the other micro-batches' decoder outputs, and their gradients waiting for the window's backward.
        through += 2 * (self.window - 1) * self.input_bytes()
        # The model's boolean mask, built once per forward and held by every layer's captured call arguments.
        through += 0 if self.masked_row is None else self.tokens * self.masked_row * self.window
        peak = saved_inputs + through + max(logits, self.layer_working_set())
        return int(peak * ALLOCATOR_ROUNDING)

    def layer_working_set(self) -> int:
        """Predicted bytes one layer's recompute and backward add at their peak, beyond the inputs and hidden states.

        The largest of its peaks (NOTE [ A layer's backward peak ]): the MLP's backward
        (:meth:`mlp_working_set`, with the dequantized weight of its largest projection), the
        post-attention norm's backward (:meth:`norm_working_set`) and attention's (:meth:`attention_working_set`).
        """
        dequantized = 2 * self.hidden_size * self.intermediate_size * self.activation_bytes
        peaks = max(self.mlp_working_set() + dequantized, self.norm_working_set(), self.attention_working_set())
        return peaks + self.masked_attention_bytes()

    def masked_attention_bytes(self) -> int:
        """Bytes a layer's graph holds more where its attention runs with a mask (NOTE [ Masked attention ])."""
        if self.masked_row is None:
            return 0
        kv_size = self.hidden_size if self.kv_size is None else self.kv_size
        repeated = 2 * self.tokens * (self.hidden_size - kv_size) * self.activation_bytes
        return self.tokens * self.masked_row * self.activation_bytes + repeated

    def mlp_working_set(self) -> int:
        """Bytes at the MLP's backward in a layer's recompute (without the dequantized weight).

        The MLP's intermediates and their gradients, six ``tokens x intermediate`` tensors, and five
        hidden-state-sized ones of attention and the norms, beyond the hidden states and gradients
        :meth:`activation_peak` counts throughout. Fitted on the H100 (``benchmarks/memory_peak.py``:
        at 7B and 16k tokens the step's peak holds six MLP-sized and twelve hidden-sized bf16
        equivalents; one layer alone, ``benchmarks/layer_working_set.py``, 302/439/524 KB per token at
        7B/32B/72B). With tiled MLPs the MLP's part is one tile's, and the tiles' input gradients,
        held until the last tile's backward is done, add one hidden-sized tensor (NOTE [ Tiled MLP ]):
        ten, counted before, over-predicted the tiled H100 points by 11-16%. With Liger's RMSNorm
        (``fused_norm``) three hidden-sized fewer: the norms' fp32 upcasts (NOTE [ A layer's backward peak ]).
        """
        if self.mlp_tile_tokens is None or self.mlp_tile_tokens >= self.tokens:
            hidden, mlp_tokens = 5, self.tokens  # a step within one tile runs the MLP untiled (TiledMLP)
        else:
            hidden, mlp_tokens = 6, self.mlp_tile_tokens
        # Liger's RMSNorm keeps no fp32 upcasts of the norms' inputs (NOTE [ A layer's backward peak ]).
        hidden -= FUSED_NORM_MLP_HIDDEN if self.fused_norm else 0
        per_token = hidden * self.tokens * self.hidden_size + 6 * mlp_tokens * self.intermediate_size
        return per_token * self.activation_bytes

    def norm_working_set(self) -> int:
        """Bytes at the post-attention norm's backward in a layer's recompute (NOTE [ A layer's backward peak ]).

        Fifteen hidden-state-sized bf16 equivalents and attention's keys and values, beyond the hidden states
        :meth:`activation_peak` counts throughout: what binds at long context once the MLP is tiled. With Liger's
        RMSNorm (``fused_norm``), which keeps no fp32 upcasts, four.
        """
        kv_size = self.hidden_size if self.kv_size is None else self.kv_size
        hidden = (FUSED_NORM_PEAK_HIDDEN if self.fused_norm else NORM_PEAK_HIDDEN) * self.tokens * self.hidden_size
        return (hidden + 2 * self.tokens * kv_size) * self.activation_bytes

    def attention_working_set(self) -> int:
        """Bytes at attention's backward in a layer's recompute (NOTE [ A layer's backward peak ]).

        SDPA's backward block, four hidden-state-sized bf16 tensors over the queries run at once (the whole sequence,
        or one tile with tiled attention), seven more over the sequence (eight with tiles) and the keys and values,
        beyond the hidden states :meth:`activation_peak` counts throughout. With Liger's RMSNorm (``fused_norm``)
        3.2 instead of seven (4.2 with tiles): what binds at long context then.
        """
        kv_size = self.hidden_size if self.kv_size is None else self.kv_size
        tiled = self.attention_tile_tokens is not None and self.attention_tile_tokens < self.tokens
        queries = self.attention_tile_tokens if tiled else self.tokens  # within one tile it runs untiled (TiledSDPA)
        beside = FUSED_ATTENTION_PEAK_HIDDEN if self.fused_norm else ATTENTION_PEAK_HIDDEN
        hidden = (beside + tiled) * self.tokens + ATTENTION_BLOCK_HIDDEN * queries
        return int((hidden * self.hidden_size + 2 * self.tokens * kv_size) * self.activation_bytes)

    def input_bytes(self) -> int:
        """Bytes of one layer's input (what a rematerialized layer saves for its backward)."""
        return self.tokens * self.hidden_size * self.activation_bytes

    def host_inputs(self) -> int:
        """Layer inputs that wait for the backward in host memory: the offloaded layers' that are kept."""
        if not self.offload_inputs:
            return 0
        offloaded = self.num_layers if self.offloaded_layers is None else min(self.offloaded_layers, self.num_layers)
        # With input checkpoints only layers 0, k, 2k, ... keep theirs (StreamedStack's host slabs, the same count).
        return offloaded if self.checkpoint_every is None else -(-offloaded // self.checkpoint_every)

    def offloaded_host_bytes(self) -> int:
        """Host bytes the saved layer inputs take with offload on (every offloaded layer's input at once), else 0."""
        return self.host_inputs() * self.input_bytes()

    def kept_attention(self) -> int:
        """Bytes a recomputed layer keeps with its attention outputs for its recompute.

        NOTE [ Kept attention ] in replay/kept_attention.py. The attention output (tokens x query heads x head size, in
        the activations' dtype) and its log-sum-exp (fp32 per query head and token; the memory-efficient kernel pads
        the tokens to 32), as the allocator rounds them.
        """
        width = self.hidden_size if self.query_size is None else self.query_size
        rows = -(-self.tokens // 32) * 32
        kept = self.tokens * width * self.activation_bytes + (self.query_heads or 1) * rows * 4
        return int(kept * ALLOCATOR_ROUNDING)

    def attention_flops(self) -> int:
        """FLOPs of one layer's causal attention forward (two matmuls over the causal half of tokens x tokens)."""
        width = self.hidden_size if self.query_size is None else self.query_size
        return 2 * self.tokens**2 * width

    def linear_params(self) -> int:
        """Weights of one decoder layer's linears (Llama-style): the attention's four and the MLP's three."""
        width = self.hidden_size if self.query_size is None else self.query_size
        kv_size = self.hidden_size if self.kv_size is None else self.kv_size
        return 2 * self.hidden_size * (width + kv_size) + 3 * self.hidden_size * self.intermediate_size

    def layer_flops(self) -> int:
        """FLOPs of one layer's forward: its linears' matmuls and its attention."""
        return 2 * self.tokens * self.linear_params() + self.attention_flops()

    def layer_graph(self) -> int:
        """Predicted bytes of one decoder layer's autograd graph (what a resident layer keeps until its backward).

        Eight hidden-sized and four MLP-sized tensors per token, and with adapter dropout six
        hidden-sized and one MLP-sized more (each adapter keeps its dropped-out input): resident
        training without checkpointing measured 192 and 203 KB per token and layer at the Qwen2.5-7B
        shape without dropout (2048 and 4096 tokens, H100, LoRA r16 on all seven projections;
        ``benchmarks/results/h100_long_context.jsonl``), 209 predicted; kept layers of the Qwen2.5-32B
        shape with dropout 0.05 about 387 (``benchmarks/card_check.py``, 1024 tokens), 420 predicted.

        With Liger's RMSNorm and RoPE (``fused_norm``) two hidden-sized fewer: 52 KB per token and layer less measured
        with Liger at the 7B shape, of which 37.9 KB is the SwiGLU activation ``fused_mlp`` counts and 14.1 KB, two
        hidden-sized tensors, the norms' and RoPE's. The 80 GB card's 4k and 16k points with every block resident
        and 28 and 21 blocks kept are then 4.3% and 5.9% over (NOTE [ A layer's backward peak ]).
        """
        hidden, mlp = (14, 5) if self.adapter_dropout else (8, 4)
        # The MLP-sized four are the gate and up projections, the activation and the product the down projection's
        # adapter keeps; a fused gated activation (Liger's) keeps the two projections and recomputes the activation
        # in its backward. Measured with Liger at the 7B shape: 52 KB per token and layer less (4096 tokens, every
        # layer kept; results/h100_peers_7b_80gb.jsonl, ours against ours+liger), of which this counts the 37.9 KB
        # of the activation only, staying over.
        mlp -= self.fused_mlp
        hidden -= FUSED_NORM_GRAPH_HIDDEN if self.fused_norm else 0
        graph = self.tokens * (hidden * self.hidden_size + mlp * self.intermediate_size) * self.activation_bytes
        graph += self.masked_attention_bytes()
        # Rounded as the allocator rounds (a 1.5B run with kept blocks allocated 0.4% above the unrounded sum).
        return int(graph * ALLOCATOR_ROUNDING)


__all__ = ["StepShape"]
