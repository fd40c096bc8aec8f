"""The memory model of a training step: which blocks a VRAM budget keeps resident, around the activations.

The activations are :class:`~lightning_blockwise.planning.step_shape.StepShape`'s (re-exported here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_blockwise.planning.step_shape import StepShape
from lightning_blockwise.planning.units import format_gib, format_mib

#: The cap a budget sets on the caching allocator over the predicted allocated peak
#: (NOTE [ A budget is a cap on the card ]).
ALLOCATOR_HEADROOM_PERCENT = 10
#: And a fixed slack over it for the caching allocator's segments (2 MiB and 20 MiB ones, partly used), which
#: only small budgets notice: caps of 27 and 67 MiB ran out of memory at 6 and 28 MiB allocated (H100, a small
#: Llama in tests/residency/test_gpu_streaming.py).
ALLOCATOR_SLACK = 128 * 2**20
#: Threads whose matmuls each get a cuBLAS workspace from the caching allocator during a step: the
#: forward's and autograd's device thread (a workspace belongs to a handle, and handles to threads).
#: Freed by ``torch.cuda.empty_cache`` and allocated again at the next matmul, so they count in the
#: step's peak: 2 x 32 MiB measured on the H100 (tests/residency/test_gpu_streaming.py, a model small
#: enough for them to be most of its peak).
BLAS_THREADS = 2
#: One cuBLAS workspace under torch's default on Hopper and later (``CUBLAS_WORKSPACE_CONFIG=:4096:8``);
#: what ``plan`` assumes, not knowing the card.
HOPPER_BLAS_WORKSPACE = 8 * 4096 * 2**10


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
# removed. `keep_activations=False` spends the whole budget on residency. Before any graph, the budget
# keeps the attention outputs of recomputed layers (NOTE [ Kept attention ] in replay/kept_attention.py),
# from the last block down: at long context they save a layer's attention kernel for a twentieth of its
# graph's bytes; a block that then keeps its whole graph gives its attention outputs back.


@dataclass(frozen=True)
class ResidencyPlan:
    """Which blocks stay on the device for the whole run, and the memory that is predicted to take.

    Attributes:
        resident: Blocks copied to the device once and kept there.
        kept: Blocks whose layers keep their autograd graph from the forward to the backward
            instead of recomputing it (NOTE [ Kept activations ]); resident or streamed.
        attention: Blocks, not kept, whose layers keep their attention outputs for the recompute (NOTE [ Kept
            attention ] in replay/kept_attention.py).
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
    attention: tuple[int, ...] = ()

    @property
    def predicted_reserved(self) -> int:
        """The budget this plan needs: its predicted peak with the allocator's headroom."""
        return with_headroom(self.predicted_peak)

    def covered_layers(self, block_layers: Sequence[int]) -> int:
        """Layers that keep their graphs or their attention outputs (``block_layers``: each block's layers)."""
        return sum(block_layers[block] for block in (*self.kept, *self.attention))

    def skipped_flops(self, block_layers: Sequence[int], shape: StepShape) -> int:
        """Forward FLOPs a step of ``shape`` skips: kept graphs' whole forwards, kept attention outputs' attention."""
        kept = sum(block_layers[block] for block in self.kept)
        attention = sum(block_layers[block] for block in self.attention)
        return kept * shape.layer_flops() + attention * shape.attention_flops()


def with_headroom(allocated: int) -> int:
    """The allocator cap an allocated peak of ``allocated`` bytes needs: 10% and 128 MiB more.

    NOTE [ A budget is a cap on the card ].
    """
    return allocated + -(-allocated * ALLOCATOR_HEADROOM_PERCENT // 100) + ALLOCATOR_SLACK


def plan_residency(
    block_bytes: list[int], prefetch_depth: int, fixed_bytes: int, trainable_bytes: int, activation_bytes: int,
    budget: int | None, graph_bytes: list[int] | None = None, attention_bytes: list[int] | None = None,
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
        attention_bytes: Each block's layers' attention outputs (:meth:`StepShape.kept_attention` per layer), what a
            recomputed block keeps so that its recompute runs no attention kernel; ``None``: none kept.

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
            f" streamed ({len(block_bytes)} blocks, {slots} slots of {format_mib(slot_bytes)}; a predicted peak"
            f" of {format_gib(streamed_peak)} allocated, and {ALLOCATOR_HEADROOM_PERCENT}% +"
            f" {ALLOCATOR_SLACK // 2**20} MiB for the allocator). Raise the budget to at least {format_gib(minimum)},"
            " or lower `prefetch_depth`, `block_size` or the tokens per micro-batch."
        )
    # Attention outputs first, from the last block down: they save the most compute per byte (NOTE [ Kept
    # attention ]); then whole graphs from the first block on, each replacing its block's attention outputs.
    attention = attention_bytes or []
    with_attention: set[int] = set()
    kept_bytes = 0
    for block in reversed(range(len(attention))):
        if not fits(0, kept_bytes + attention[block]):
            break
        kept_bytes += attention[block]
        with_attention.add(block)
    graphs = graph_bytes or []
    kept = 0
    while kept < len(graphs):
        more = graphs[kept] - (attention[kept] if kept in with_attention else 0)
        if not fits(kept + 1, kept_bytes + more):
            break
        kept_bytes += more
        kept += 1
    resident = kept
    while resident < len(block_bytes) and fits(resident + 1, kept_bytes):
        resident += 1
    kept_blocks = tuple(range(kept))
    attention_blocks = tuple(sorted(block for block in with_attention if block >= kept))
    predicted, slots, slot_bytes = peak(resident, kept_bytes)
    return ResidencyPlan(tuple(range(resident)), slots, slot_bytes, predicted, minimum, kept_blocks, attention_blocks)


__all__ = [
    "ALLOCATOR_HEADROOM_PERCENT",
    "ALLOCATOR_SLACK",
    "ResidencyPlan",
    "StepShape",
    "plan_residency",
    "with_headroom",
]
