"""The activation model's measured constants: what a step's peaks hold beyond what it counts tensor by tensor.

Each constant says what it counts and where it was fitted; NOTE [ A layer's backward peak ] says how a
rematerialized layer's backward peaks and what the constants cover there. Read by ``step_shape.py``.
"""

from __future__ import annotations

#: Bytes per token per vocabulary entry at the loss's peak: the bf16 logits (kept for the
#: outputs), log-softmax's fp32 output (saved for its backward) and the fp32 gradient flowing
#: through it, with part of a second one (12 fit the 7B-72B H100 peaks in benchmarks/RESULTS.md, but a
#: Qwen2.5-1.5B step at 4096 tokens, logits-bound, allocated 0.4% over a plan made with 12:
#: tests/strategy/test_gpu_budget.py; 12.5 covers it).
LOGIT_BYTES_PER_ENTRY = 12.5
#: The same for a chunk of :func:`~lightning_blockwise.longcontext.loss.chunked_causal_lm_loss`, which keeps no bf16
#: logits for the outputs: its fp32 upcast, log-softmax's output and the gradients through them. The three H100 points
#: whose peak is a 4096-row chunk measured 10.5-11.4 B per entry; 12.5 over-predicted one of them by 11%.
CHUNK_LOGIT_BYTES_PER_ENTRY = 12
#: Hidden-state-sized tensors alive besides the saved inputs: the decoder's output, its gradient,
#: and a layer's incoming and outgoing gradients.
HIDDEN_STATES_ALIVE = 4
#: The caching allocator rounds every block up (512 B, 2 MiB for large ones); the peak it reports
#: counts the rounded sizes. Measured peaks were up to 1% above the unrounded sum.
ALLOCATOR_ROUNDING = 1.02
#: Hidden-state-sized bf16 equivalents at the post-attention norm's backward, beyond the inputs and the hidden
#: states alive throughout (NOTE [ A layer's backward peak ]).
NORM_PEAK_HIDDEN = 15
#: SDPA's backward block, in hidden-state-sized bf16 tensors over the queries it runs at once: one allocation of 4.02
#: measured (NOTE [ A layer's backward peak ]).
ATTENTION_BLOCK_HIDDEN = 4
#: Hidden-state-sized bf16 equivalents alive beside that block, beyond the inputs and the hidden states alive
#: throughout (NOTE [ A layer's backward peak ]; an estimate, not a fit).
ATTENTION_PEAK_HIDDEN = 7
#: With Liger's RMSNorm (``fused_norm``), hidden-state-sized bf16 equivalents beside SDPA's block at attention's
#: backward, beyond the inputs and the hidden states alive throughout. Fixed by the H100 7B points with attention
#: untiled: 3.12 just reaches the 65k-token one, 3.0 the 358k one; the 262k one with 16k-query tiles allows 3.27 at
#: most (NOTE [ A layer's backward peak ]).
FUSED_ATTENTION_PEAK_HIDDEN = 3.2
#: With Liger's RMSNorm, hidden-state-sized bf16 equivalents at the post-attention norm's backward beyond the inputs
#: and the hidden states alive throughout: attention's saved normed input, rotated queries and output, and the norm's
#: saved bf16 input (NOTE [ A layer's backward peak ]; counted, not fitted: no measured point binds there).
FUSED_NORM_PEAK_HIDDEN = 4
#: Hidden-state-sized bf16 equivalents the MLP's backward holds less with Liger's RMSNorm: the two norms' saved fp32
#: upcasts (four), less the bf16 input Liger's post-attention norm saves instead (counted). The 22 GiB-capped 7B points
#: at 16k and 32k tokens, MLP untiled, need at least 2.5 (NOTE [ A layer's backward peak ]).
FUSED_NORM_MLP_HIDDEN = 3
#: Hidden-state-sized bf16 tensors per token a kept layer's graph holds less with Liger's RMSNorm and RoPE: 14.1 KB per
#: token and layer at the 7B shape (52 KB less with Liger, 37.9 KB of it the SwiGLU activation ``fused_mlp`` counts).
FUSED_NORM_GRAPH_HIDDEN = 2


# NOTE [ A layer's backward peak ]
# A rematerialized layer's backward has two peaks that bind (a third is below). In the MLP's
# backward, its intermediates (tokens x intermediate each) dominate, so untiled that is where a long
# step peaks. With the MLP tiled they shrink to one tile's, and the peak moves to the post-attention RMSNorm's backward,
# which scales with tokens x hidden alone. Measured there (H100, Qwen2.5-7B shape, offload, chunked
# loss, tiled MLP, 32k and 131k tokens; the allocator's history replayed to the step's peak): seven
# fp32 and seven bf16 hidden-sized tensors, and attention's keys and values. fp32: both norms' saved
# upcasts of their inputs (``hidden_states.to(torch.float32)``, saved by ``pow`` and the product
# with ``rsqrt``) and five temporaries of the norm's backward (the upcast gradient, its product
# with ``rsqrt``, the mean's expanded gradient, ``pow``'s backward). bf16: the layer's input, the
# next one coming back, the incoming gradient, attention's saved normed input, rotated queries and
# output, and the norm's gradient. That is 21 bf16 equivalents beside the inputs; the model counts
# 15 beyond the inputs and the four hidden states it keeps throughout (the incoming gradient is one
# of them), with offload 22 in all: one over, the slot of an input being copied out, which only the
# forward uses. The plan of 131k tokens that missed this was 13% under (19.68 GB against 22.26).
# Two norms per layer is Llama-style; an architecture with more (Gemma 2/3 have four) keeps more
# fp32 copies alive and has not been measured here.
#
# A third peak comes later, in attention's backward: SDPA's backward (flash or efficient kernel, C++
# autograd) allocates one block of 4.02 hidden-sized bf16 tensors (H100, Qwen2.5-7B shape, 65k
# tokens, Liger's RMSNorm and RoPE: ten hidden-sized tensors and that block at the step's peak),
# counted here over the queries SDPA runs at once (not yet measured with tiles). Beside it the model
# counts seven hidden-sized bf16 equivalents and the keys and values beyond the inputs and the hidden
# states kept throughout (attention's saved normed input, queries and output, the output's gradient,
# the residual's gradient, the input norm's fp32 upcast), an estimate; with tiled attention (NOTE [
# Tiled attention ] in longcontext/attention.py) the block is one tile's, and the finished tiles'
# query gradients waiting for the last one add one hidden-sized tensor. With Hugging Face's RMSNorm
# that peak (at most 12) stays under the norm's (15), so tiled attention leaves those predictions unchanged.
#
# With Liger's RMSNorm (``fused_norm``: ``use_liger_kernels``, which ``kernels="auto"`` turns on on CUDA)
# the norms keep and make no fp32 upcasts: the kernel saves its bf16 input and one fp32 scale per row
# and writes its input gradient over the incoming one. Every peak above shrinks, and attention's binds
# at long context. The model without this was 11-97% over the nine H100 points it is now fitted on
# (Qwen2.5-7B shape, LoRA r16 without dropout, chunked loss, Liger's RMSNorm and RoPE; RESULTS.md,
# "Session of 2026-11-26 03:51"; tests/planning/test_calibration.py), and with Liger:
# - attention's backward: 3.2 hidden-sized bf16 equivalents beside SDPA's block. The 65k-token replay
#   holds ten hidden-sized tensors at the peak, three beyond the three inputs in flight and the four
#   kept throughout; three leave that point 0.6% under (0.2 GB of smaller tensors the replay does not
#   list), 3.2 covers it (+0.4%) and the 358k untiled one (+1.4%), and the 262k one tiled by 16k
#   queries bounds it (3.27 at most for 10% over; +8.5% at 3.2). The finished tiles' query gradients
#   count as before (one), the block (4) too. The 262k untiled step that ran out of memory on a 22 GiB
#   cap (a 7.03 GiB block refused at 20.26 GiB allocated: 29.3 GB at least) is planned at 29.9 GB.
# - the post-attention norm's backward: four (attention's saved normed input, rotated queries and
#   output, and the post-attention norm's saved bf16 input), counted, not fitted: no measured point
#   binds there, and it stays under attention's at every tiling (3.2 + 1 + the tile's block).
# - the MLP's backward: three fewer hidden-sized (the two norms' saved fp32 upcasts, four bf16
#   equivalents, less the bf16 input Liger's post-attention norm saves instead). The 22 GiB-capped
#   16k and 32k points, MLP untiled, need at least 2.5 fewer to be within 10% (+8.7% and +9.3% with
#   three). Liger's SwiGLU (``fused_mlp``) leaves the six MLP-sized intermediates as counted: two fewer
#   would put the 32k point 5% under.
# - a kept layer's graph: two hidden-sized tensors per token fewer (:meth:`StepShape.layer_graph`).
# The 65k points ran the fused LoRA update, the longer ones did not; the model does not tell them apart.


__all__ = [
    "ALLOCATOR_ROUNDING",
    "ATTENTION_BLOCK_HIDDEN",
    "ATTENTION_PEAK_HIDDEN",
    "CHUNK_LOGIT_BYTES_PER_ENTRY",
    "FUSED_ATTENTION_PEAK_HIDDEN",
    "FUSED_NORM_GRAPH_HIDDEN",
    "FUSED_NORM_MLP_HIDDEN",
    "FUSED_NORM_PEAK_HIDDEN",
    "HIDDEN_STATES_ALIVE",
    "LOGIT_BYTES_PER_ENTRY",
    "NORM_PEAK_HIDDEN",
]
