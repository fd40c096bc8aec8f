"""Tiled attention: untiled sdpa to rounding, tiles really run, refusals with the fix, and blockwise == resident."""

from __future__ import annotations

import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.kernels import forwards, liger
from lightning_blockwise.kernels.liger import use_liger_kernels
from lightning_blockwise.longcontext import attention
from lightning_blockwise.longcontext.attention import (
    TiledSDPA,
    tile_attention,
    tiled_attention_tokens,
    untile_attention,
)
from tests.helpers.models import (
    NUM_LAYERS,
    SEQ,
    VOCAB,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    runs_differ,
)
from tests.kernels.test_liger import _ReferenceRMSNorm

TILE = 5  # below SEQ, and not a divisor of it: tiles of 5, 5 and 2 queries
ROWS = 2
TILES_PER_FORWARD = -(-SEQ // TILE)
MICRO_BATCHES = 8  # `fit`: 4 optimizer steps of 2 micro-batches


def _model(model_type: str = "llama", **overrides: Any) -> nn.Module:
    """A PEFT-LoRA model without attention dropout (refused by tiling), LoRA dropout off unless asked."""
    return build_model(model_type, **{"attention_dropout": 0.0, "lora_dropout": 0.0, **overrides})


def _batches(count: int, rows: int = ROWS, seed: int = 1234) -> list[dict[str, Tensor]]:
    """Batches of full-length rows (no padding: transformers passes sdpa no mask), every token labelled."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        ids = torch.randint(1, VOCAB, (rows, SEQ), generator=generator)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return batches


@pytest.fixture
def tile_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every tile attended: (queries, keys) of each call of the tile's SDPA."""
    calls: list[tuple[int, int]] = []
    attend = attention._attend

    def counting(query: Tensor, key: Tensor, value: Tensor, scaling: float | None) -> Tensor:
        calls.append((query.shape[2], key.shape[2]))
        return attend(query, key, value, scaling)

    monkeypatch.setattr(attention, "_attend", counting)
    return calls


def _logits_and_grads(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    output = model(**batch)
    output.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return output.logits.detach(), grads


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_tiled_attention_matches_untiled_sdpa(model_type: str, tile_calls: list[tuple[int, int]]) -> None:
    # Grouped-query attention: 4 query heads share 2 key-value heads.
    model, batch = _model(model_type), _batches(1)[0]
    reference, reference_grads = _logits_and_grads(model, batch)
    assert tile_attention(model, TILE) == NUM_LAYERS
    logits, grads = _logits_and_grads(model, batch)
    # Control: each layer ran its queries in tiles, each against its key prefix (and again in the backward's recompute).
    assert tile_calls[:TILES_PER_FORWARD] == [(5, 5), (5, 10), (2, 12)]
    assert len(tile_calls) == 2 * NUM_LAYERS * TILES_PER_FORWARD
    # Not bit-equal by design (other matmul shapes and reductions): the same function to fp32 rounding.
    torch.testing.assert_close(logits, reference)
    assert grads.keys() == reference_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], msg=name)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_the_tiled_function_matches_sdpa_on_its_own(kv_heads: int, tile_calls: list[tuple[int, int]]) -> None:
    """Multi-query, grouped-query and multi-head attention, with a scale: outputs and input gradients."""
    module = nn.Module()
    module.is_causal, module.num_key_value_groups = True, 4 // kv_heads
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 4, 37, 8), (2, kv_heads, 37, 8), (2, kv_heads, 37, 8)]
    inputs = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in shapes]

    def run(function: Callable[..., tuple[Tensor, Any]]) -> tuple[Tensor, list[Tensor]]:
        leaves = [tensor.clone().requires_grad_() for tensor in inputs]
        output, weights = function(module, *leaves, None, dropout=0.0, scaling=0.3)
        assert weights is None
        output.pow(2).sum().backward()
        return output.detach(), [leaf.grad for leaf in leaves]

    expected, expected_grads = run(ALL_ATTENTION_FUNCTIONS["sdpa"])
    output, grads = run(TiledSDPA(8))
    assert len(tile_calls) == 2 * 5 and output.is_contiguous()  # 8, 8, 8, 8, 5 queries; forward and recompute
    torch.testing.assert_close(output, expected)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("tile_tokens", [SEQ, 100])
def test_a_sequence_within_one_tile_runs_untiled_sdpa_exactly(
    tile_tokens: int, tile_calls: list[tuple[int, int]]
) -> None:
    model, batch = _model(), _batches(1)[0]
    reference, reference_grads = _logits_and_grads(model, batch)
    tile_attention(model, tile_tokens)
    logits, grads = _logits_and_grads(model, batch)
    assert tile_calls == []
    assert torch.equal(logits, reference)
    assert all(torch.equal(grad, reference_grads[name]) for name, grad in grads.items())


def test_untile_restores_sdpa_and_tiling_again_replaces_the_tile() -> None:
    model, batch = _model(), _batches(1)[0]
    reference, _ = _logits_and_grads(model, batch)
    assert model.config._attn_implementation == "sdpa" and tiled_attention_tokens(model) is None
    tile_attention(model, TILE)
    tile_attention(model, 7)  # replaces the tile, does not wrap the tiled function
    assert tiled_attention_tokens(model) == 7
    untile_attention(model)
    untile_attention(model)  # a no-op once untiled
    assert model.config._attn_implementation == "sdpa" and tiled_attention_tokens(model) is None
    assert torch.equal(_logits_and_grads(model, batch)[0], reference)


def test_other_models_keep_their_attention() -> None:
    tiled, other = _model(), _model()
    tile_attention(tiled, TILE)
    assert tiled_attention_tokens(tiled) == TILE and other.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("tile_tokens", [0, -3, 2.5, True])
def test_tile_tokens_below_one_or_not_an_int_is_refused(tile_tokens: Any) -> None:
    model = _model()
    with pytest.raises(ValueError, match="tile_tokens"):
        tile_attention(model, tile_tokens)
    assert model.config._attn_implementation == "sdpa"


def test_attention_dropout_is_refused_when_tiling() -> None:
    model = _model(attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"attention_dropout=0\.0"):
        tile_attention(model, TILE)
    assert model.config._attn_implementation == "sdpa"
    # Dropout switched on after tiling is refused at the first tiled forward in training, never skipped.
    model = _model()
    tile_attention(model, TILE)
    for layer in model.get_base_model().model.layers:
        layer.self_attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention dropout 0.1"):
        model(**_batches(1)[0])
    # Control: in eval mode transformers passes no dropout, and the tiles run.
    model.eval()(**_batches(1)[0])


def test_a_non_sdpa_implementation_is_refused() -> None:
    model = _model(peft=False)
    model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'"):
        tile_attention(model, TILE)
    assert model.config._attn_implementation == "eager"


def _padded(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    mask = batch["attention_mask"].clone()
    mask[1, -3:] = 0
    return {**batch, "attention_mask": mask, "labels": batch["labels"].masked_fill(mask == 0, -100)}


def test_a_padding_mask_is_refused_in_a_tiled_sequence() -> None:
    model = _model()
    tile_attention(model, TILE)
    with pytest.raises(ValueError, match=r"attention mask.*without padding"):
        model(**_padded(_batches(1)[0]))
    # Control: a batch of one tile or less is transformers' sdpa as before, its padding mask included.
    reference = _model()
    tile_attention(model, SEQ)
    batch = _padded(_batches(1)[0])
    assert torch.equal(model(**batch).logits, reference(**batch).logits)


def test_packed_sequences_are_refused() -> None:
    model = _model()
    tile_attention(model, TILE)
    ids = _batches(1, rows=1)[0]["input_ids"]
    # Two examples in one row: positions restart, so transformers builds a mask keeping them apart.
    packed = {"input_ids": ids, "position_ids": torch.tensor([[*range(7), *range(SEQ - 7)]]), "use_cache": False}
    with pytest.raises(ValueError, match=r"attention mask.*packed"):
        model(**packed)
    # Control: the same row with positions that do not restart is one sequence, no mask, and tiles.
    model(**{**packed, "position_ids": torch.arange(SEQ)[None]})


def test_sliding_windows_shorter_than_the_sequence_are_refused() -> None:
    model = _model("qwen2")  # sliding windows of 4 tokens on its last layers
    tile_attention(model, TILE)
    with pytest.raises(ValueError, match=r"attention mask.*sliding windows"):
        model(**_batches(1)[0])
    # Control: without sliding windows the same architecture tiles.
    unwindowed = _model("qwen2", use_sliding_window=False, layer_types=["full_attention"] * NUM_LAYERS)
    tile_attention(unwindowed, TILE)
    unwindowed(**_batches(1)[0])


@pytest.fixture
def liger_references(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Liger's RMSNorm and RoPE swapped for torch references of Hugging Face's arithmetic (as tests/kernels does)."""
    counts: Counter[str] = Counter()

    def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Any, unsqueeze_dim: int) -> Any:
        counts["rope"] += 1
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    namespace = types.SimpleNamespace(rms_norm=_ReferenceRMSNorm, rope=rope, mlp_forwards={})
    monkeypatch.setattr(liger, "_liger", lambda: namespace)
    monkeypatch.setattr(forwards, "_on_cuda", lambda tensor, where: None)
    return counts


def test_liger_rope_and_norms_compute_around_tiled_attention(
    liger_references: Counter[str], tile_calls: list[tuple[int, int]]
) -> None:
    """Liger's rebuilt attention forward still takes its attention function from the config: the tiled one."""
    plain, batch = _model(), _batches(1)[0]
    tile_attention(plain, TILE)
    reference, reference_grads = _logits_and_grads(plain, batch)
    tile_calls.clear()
    model = _model()
    use_liger_kernels(model, swiglu=False)
    tile_attention(model, TILE)
    logits, grads = _logits_and_grads(model, batch)
    assert liger_references["rope"] == NUM_LAYERS and len(tile_calls) == 2 * NUM_LAYERS * TILES_PER_FORWARD
    # The references compute Hugging Face's arithmetic: the same bits as the tiled model without Liger.
    assert torch.equal(logits, reference)
    assert all(torch.equal(grad, reference_grads[name]) for name, grad in grads.items())


class _TiledModule(CausalLMModule):
    """Tiles its model's attention where it builds it, so that every strategy trains the same function."""

    attention_tile_tokens = TILE

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__(build)
        tile_attention(self.model, self.attention_tile_tokens)


@pytest.mark.parametrize("base", ["fp32", "nf4"])
def test_tiled_module_blockwise_equals_resident(
    base: str, llama_no_attention_dropout: Path, tile_calls: list[tuple[int, int]]
) -> None:
    def build() -> nn.Module:
        # LoRA dropout on: the recompute replays its masks, the tiles draw nothing.
        if base == "nf4":
            return build_model("llama", checkpoint=llama_no_attention_dropout, quantized=True, lora_dropout=0.1)
        return _model(lora_dropout=0.1)

    batches = _batches(MICRO_BATCHES)
    resident = fit(_TiledModule(build), "auto", batches)
    # Control: the resident run's forwards ran in tiles (and their recomputes in the backward).
    assert len(tile_calls) == 2 * MICRO_BATCHES * NUM_LAYERS * TILES_PER_FORWARD
    tile_calls.clear()
    strategy = BlockwiseStrategy()
    blockwise = fit(_TiledModule(build), strategy, batches)
    assert strategy.step_plan is not None and strategy.step_plan.shape.attention_tile_tokens == TILE  # planner read it
    # Blockwise: a forward without a graph, then the layer's recompute with one and the tiles' own recomputes.
    assert len(tile_calls) == 3 * MICRO_BATCHES * NUM_LAYERS * TILES_PER_FORWARD
    assert_equal_runs(resident, blockwise)
    if base == "fp32":
        # Control: tiling is part of the function. The module that does not tile trains to within rounding of the tiled
        # one, not bit for bit, so a comparison blind to the tiling would fail here.
        untiled = fit(CausalLMModule(build), "auto", batches)
        assert runs_differ(resident, untiled)
