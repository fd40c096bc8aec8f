"""The pure planner: blocks, bytes, budgets and which blocks stay resident."""

from __future__ import annotations

import pytest

from lightning_blockwise.planning import StepShape, parse_bytes, plan_residency, step_shape
from lightning_blockwise.planning.memory import ALLOCATOR_SLACK, with_headroom
from lightning_blockwise.residency.blocks import BlockPlan

SLACK = ALLOCATOR_SLACK


def test_block_plan_partition() -> None:
    plan = BlockPlan(num_layers=10, block_size=4)
    assert plan.num_blocks == 3
    assert [list(plan.layers_of(b)) for b in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [plan.block_of(i) for i in (0, 3, 4, 9)] == [0, 0, 1, 2]


@pytest.mark.parametrize("block_size", [0, 11])
def test_block_plan_rejects_sizes(block_size: int) -> None:
    with pytest.raises(ValueError, match="between 1 and the model's 10 decoder layers"):
        BlockPlan(num_layers=10, block_size=block_size)


def test_activation_peak_by_hand() -> None:
    shape = StepShape(tokens=512, hidden_size=8, intermediate_size=16, vocab_size=100, num_layers=3)
    saved = 3 * 512 * 8 * 2
    logits = int(512 * 100 * 12.5)
    graph = 512 * (5 * 8 + 6 * 16) * 2  # one layer's recompute and backward, untiled
    dequantized = 2 * 8 * 16 * 2
    through = 4 * 512 * 8 * 2  # the last hidden states and the gradients through the stack
    assert shape.activation_peak() == int((saved + through + max(logits, graph + dequantized)) * 1.02)
    assert shape.offloaded_host_bytes() == 0


def test_activation_peak_with_offload_and_a_chunked_loss_by_hand() -> None:
    shape = StepShape(
        tokens=512, hidden_size=8, intermediate_size=16, vocab_size=100, num_layers=5, offload_inputs=True,
        loss_chunk_tokens=64,
    )  # fmt: skip
    in_flight = 3 * 512 * 8 * 2  # the input in use, the next coming back, one going out
    logits = 64 * 100 * 12
    graph = 512 * (5 * 8 + 6 * 16) * 2
    dequantized = 2 * 8 * 16 * 2
    through = 4 * 512 * 8 * 2
    assert shape.activation_peak() == int((in_flight + through + max(logits, graph + dequantized)) * 1.02)
    assert shape.offloaded_host_bytes() == 5 * 512 * 8 * 2


def test_no_budget_streams_everything() -> None:
    plan = plan_residency(
        [100, 100, 100, 100], 2, fixed_bytes=1000, trainable_bytes=10, activation_bytes=50, budget=None
    )
    assert plan.resident == ()
    assert (plan.num_slots, plan.slot_bytes) == (3, 100)
    assert plan.predicted_peak == 1000 + 30 + 50 + 300
    # The smallest budget leaves the allocator its headroom (NOTE [ A budget is a cap on the card ]).
    assert plan.minimum == plan.predicted_reserved == with_headroom(1380) == 1380 + 138 + ALLOCATOR_SLACK


def test_budget_keeps_blocks_resident() -> None:
    sizes = [100, 100, 100, 100, 100, 100]
    # Minimum: 1080 + 3 slots * 100 = 1380 allocated, 1518 + the slack with headroom. Each resident block adds
    # 100 while 3 slots remain: 1580 allocated needs 1738; from three on, each also frees a slot: 1680 (1848)
    # holds all six.
    plan = plan_residency(sizes, 2, fixed_bytes=1000, trainable_bytes=10, activation_bytes=50, budget=1847 + SLACK)
    assert plan.minimum == 1518 + SLACK
    assert plan.resident == (0, 1)
    assert plan.predicted_peak == 1580 and plan.predicted_reserved == 1738 + SLACK
    more = plan_residency(sizes, 2, fixed_bytes=1000, trainable_bytes=10, activation_bytes=50, budget=1848 + SLACK)
    assert more.resident == tuple(range(6)) and more.predicted_reserved == 1848 + SLACK
    everything = plan_residency(sizes, 2, fixed_bytes=1000, trainable_bytes=10, activation_bytes=50, budget=10**9)
    assert everything.resident == tuple(range(6)) and everything.num_slots == 0
    assert everything.predicted_peak == 1080 + 600


def test_fewer_slots_once_few_blocks_stream() -> None:
    # Each resident block frees a slot once fewer than three blocks stream, so 440 bytes (400 with the
    # allocator's headroom) hold all four.
    plan = plan_residency([100] * 4, 2, fixed_bytes=0, trainable_bytes=0, activation_bytes=0, budget=440 + SLACK)
    assert plan.resident == (0, 1, 2, 3)
    assert plan.num_slots == 0 and plan.predicted_peak == 400
    plan = plan_residency([100] * 4, 2, fixed_bytes=0, trainable_bytes=0, activation_bytes=0, budget=439 + SLACK)
    assert plan.resident == () and plan.num_slots == 3 and plan.predicted_peak == 300


def test_budget_below_minimum_names_it() -> None:
    with pytest.raises(ValueError, match=r"below the .* Raise the budget to at least"):
        plan_residency([2**30] * 4, 2, fixed_bytes=0, trainable_bytes=0, activation_bytes=0, budget=2**30)


@pytest.mark.parametrize(
    ("text", "expected"), [(1234, 1234), ("16GiB", 16 * 2**30), ("24GB", 24 * 10**9), ("512 MiB", 512 * 2**20)]
)
def test_parse_bytes(text: int | str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


@pytest.mark.parametrize("value", [0, -1, "-1GB", "inf", "nan", 1.5e9, True, None])
def test_parse_bytes_refuses_sizes_that_are_not_positive_finite_counts(value: object) -> None:
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes(value)  # type: ignore[arg-type]


def test_a_tiled_mlp_keeps_one_tile_of_intermediates_and_adds_a_hidden_state() -> None:
    def shape(tile: int | None) -> StepShape:
        return StepShape(tokens=512, hidden_size=8, intermediate_size=16, vocab_size=100, num_layers=5,
                         mlp_tile_tokens=tile)  # fmt: skip

    assert shape(None).mlp_working_set() == 512 * (5 * 8 + 6 * 16) * 2
    assert shape(64).mlp_working_set() == (6 * 512 * 8 + 6 * 64 * 16) * 2
    assert shape(4096).mlp_working_set() == shape(None).mlp_working_set()  # within one tile: untiled


def test_a_layer_peaks_at_the_larger_of_the_mlp_and_the_norm_backward() -> None:
    """NOTE [ A layer's backward peak ]: 15 hidden-sized bf16 equivalents and keys and values at the norm."""

    def shape(tile: int | None, kv_size: int | None = 4) -> StepShape:
        return StepShape(tokens=512, hidden_size=8, intermediate_size=16, vocab_size=100, num_layers=5,
                         mlp_tile_tokens=tile, kv_size=kv_size)  # fmt: skip

    dequantized = 2 * 8 * 16 * 2
    assert shape(None).norm_working_set() == (15 * 512 * 8 + 2 * 512 * 4) * 2
    assert shape(None, kv_size=None).norm_working_set() == (15 * 512 * 8 + 2 * 512 * 8) * 2  # no GQA: kv = hidden
    # Untiled, the MLP's six intermediates bind; tiled by 64 tokens, the norm does.
    assert shape(None).layer_working_set() == shape(None).mlp_working_set() + dequantized
    assert shape(64).mlp_working_set() + dequantized < shape(64).norm_working_set() == shape(64).layer_working_set()


def test_attention_backward_counts_its_block_over_the_whole_sequence_or_one_tile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOTE [ A layer's backward peak ]: SDPA's block of 4 hidden-sized tensors, over the queries it runs at once."""

    def shape(tile: int | None) -> StepShape:
        # The MLP tiled too, so that a layer peaks at the norm's backward or attention's, not the MLP's.
        return StepShape(tokens=512, hidden_size=8, intermediate_size=16, vocab_size=100, num_layers=5,
                         kv_size=4, mlp_tile_tokens=64, attention_tile_tokens=tile)  # fmt: skip

    assert shape(None).attention_working_set() == ((7 + 4) * 512 * 8 + 2 * 512 * 4) * 2
    # Tiled by 64 queries: the block is one tile's; the tiles' query gradients waiting for the last add one.
    assert shape(64).attention_working_set() == ((7 + 1) * 512 * 8 + 4 * 64 * 8 + 2 * 512 * 4) * 2
    assert shape(512).attention_working_set() == shape(None).attention_working_set()  # within one tile: untiled
    # With Hugging Face's RMSNorm the norm's backward stays the larger: tiling attention changes no prediction.
    for tile in (None, 64):
        assert shape(tile).attention_working_set() < shape(tile).norm_working_set()
        assert shape(tile).layer_working_set() == shape(None).layer_working_set() == shape(None).norm_working_set()
    # Control: the attention peak is in the max: a block that outgrew the norm's peak would bind, untiled only.
    monkeypatch.setattr(step_shape, "ATTENTION_BLOCK_HIDDEN", 12)
    assert shape(None).layer_working_set() == shape(None).attention_working_set() > shape(None).norm_working_set()
    assert shape(64).layer_working_set() == shape(64).norm_working_set()


def test_liger_rmsnorm_shrinks_every_working_set_and_attention_binds() -> None:
    """NOTE [ A layer's backward peak ]: with ``fused_norm`` no fp32 upcasts; control: the same shape without it."""

    def shape(fused_norm: bool, attention_tile: int | None = None, adapter_dropout: bool = False) -> StepShape:
        return StepShape(tokens=512, hidden_size=8, intermediate_size=16, vocab_size=100, num_layers=5, kv_size=4,
                         mlp_tile_tokens=64, attention_tile_tokens=attention_tile, fused_norm=fused_norm,
                         adapter_dropout=adapter_dropout, loss_chunk_tokens=64)  # fmt: skip

    kv = 2 * 512 * 4
    assert shape(True).norm_working_set() == (4 * 512 * 8 + kv) * 2
    assert shape(True).attention_working_set() == int((3.2 * 512 * 8 + 4 * 512 * 8 + kv) * 2)
    assert shape(True, 64).attention_working_set() == int(((3.2 + 1) * 512 * 8 + 4 * 64 * 8 + kv) * 2)
    assert shape(True).mlp_working_set() == ((6 - 3) * 512 * 8 + 6 * 64 * 16) * 2
    for dropout in (False, True):
        saved = shape(False, adapter_dropout=dropout).layer_graph() - shape(True, adapter_dropout=dropout).layer_graph()
        assert saved == pytest.approx(2 * 512 * 8 * 2 * 1.02, abs=1)
    # Attention's backward binds at every tiling (the norm's four stay under 3.2 + 1 + a tile's block).
    for tile in (None, 64, 1):
        assert shape(True, tile).layer_working_set() == shape(True, tile).attention_working_set()
        assert shape(True, tile).norm_working_set() < shape(True, tile).attention_working_set()
    # Control: without it the norm's fifteen bind, and each working set is larger.
    assert shape(False).layer_working_set() == shape(False).norm_working_set() > shape(True).layer_working_set()
    for method in ("norm_working_set", "attention_working_set", "mlp_working_set", "activation_peak"):
        assert getattr(shape(True), method)() < getattr(shape(False), method)(), method
