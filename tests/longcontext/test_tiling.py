"""Tiled MLPs: the same function as untiled to fp32 rounding, tiles really run, and blockwise == resident when tiled."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.longcontext.tiling import TiledMLP, tile_mlps, untile
from tests.helpers.models import (
    NUM_LAYERS,
    SEQ,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    padded_batches,
    runs_differ,
)

TILE = 5  # below SEQ, and not a divisor of it
ROWS = 2  # `padded_batches`: rows per micro-batch, each SEQ tokens long (padding included)
MICRO_BATCHES = 8  # `fit`: 4 optimizer steps of 2 micro-batches


@pytest.fixture
def tile_calls(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[int]]:
    """The tiles every tiled MLP runs: for each MLP (by id), the tokens of each of its tiles."""
    calls: dict[int, list[int]] = defaultdict(list)
    run_tile = TiledMLP._tile

    def counting(self: TiledMLP, tile: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        calls[id(self.mlp)].append(tile.shape[:-1].numel())
        return run_tile(self, tile, *args, **kwargs)

    monkeypatch.setattr(TiledMLP, "_tile", counting)
    return calls


def _assert_tiled(calls: dict[int, list[int]], forwards: int) -> None:
    """Every layer's MLP ran ``forwards`` forwards of ROWS x SEQ tokens, each in more than one tile."""
    assert len(calls) == NUM_LAYERS
    for tiles in calls.values():
        assert sum(tiles) == forwards * ROWS * SEQ and len(tiles) >= 2 * forwards


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [layer.mlp for layer in model.get_base_model().model.layers]


def _loss_and_grads(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_tiled_mlp_matches_untiled(tile_calls: dict[int, list[int]]) -> None:
    model, batch = build_model("llama").eval(), padded_batches(1)[0]
    reference, reference_grads = _loss_and_grads(model, batch)
    assert tile_mlps(model, TILE) == NUM_LAYERS
    loss, grads = _loss_and_grads(model, batch)
    # Control: the forward really ran in tiles.
    _assert_tiled(tile_calls, forwards=1)
    assert torch.allclose(loss, reference, rtol=1e-6, atol=1e-6)
    assert grads.keys() == reference_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(grad, reference_grads[name], rtol=1e-6, atol=1e-6), name


def test_inputs_within_one_tile_run_untiled(tile_calls: dict[int, list[int]]) -> None:
    model = build_model("llama").eval()
    tile_mlps(model, ROWS * SEQ)
    model(**padded_batches(1)[0])
    assert tile_calls == {}


def test_a_tile_holds_at_most_tile_tokens_tokens(tile_calls: dict[int, list[int]]) -> None:
    model = build_model("llama").eval()
    tile_mlps(model, TILE)
    model(**padded_batches(1, batch_size=ROWS)[0])
    _assert_tiled(tile_calls, forwards=1)
    assert max(max(tiles) for tiles in tile_calls.values()) <= TILE


def test_untile_restores_the_class_forward() -> None:
    model = build_model("llama")
    mlp = _mlps(model)[0]
    tile_mlps(model, TILE)
    tile_mlps(model, 7)  # tiling again replaces the tiled forward, it does not wrap it
    assert isinstance(vars(mlp)["forward"], TiledMLP) and mlp.forward.tile_tokens == 7
    assert mlp.forward._forward is type(mlp).forward
    for each in _mlps(model):
        untile(each)
        untile(each)  # a no-op once untiled
        assert "forward" not in vars(each) and each.forward.__func__ is type(each).forward


@pytest.mark.parametrize("tile_tokens", [0, -3, 2.5, True])
def test_tile_tokens_below_one_or_not_an_int_is_refused(tile_tokens: Any) -> None:
    model = build_model("llama")
    with pytest.raises(ValueError, match="tile_tokens"):
        tile_mlps(model, tile_tokens)
    assert all("forward" not in vars(mlp) for mlp in _mlps(model))


class _TiledModule(CausalLMModule):
    """Tiles its model where it builds it, so that every strategy trains the same function; declares the tile."""

    mlp_tile_tokens = TILE

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tile_mlps(self.model, self.mlp_tile_tokens)


def test_tiled_module_blockwise_equals_resident(tile_calls: dict[int, list[int]]) -> None:
    resident = fit(_TiledModule(lambda: build_model("llama")), "auto")
    # Control: every forward of the resident run ran in tiles (the backward recomputes each tile
    # through checkpoint, without `_tile`).
    _assert_tiled(tile_calls, forwards=MICRO_BATCHES)
    tile_calls.clear()
    strategy = BlockwiseStrategy()
    blockwise = fit(_TiledModule(lambda: build_model("llama")), strategy)
    assert strategy.step_plan is not None and strategy.step_plan.shape.mlp_tile_tokens == TILE  # the planner read it
    # The blockwise forward runs each layer without a graph and the backward recomputes it: tiles both times.
    _assert_tiled(tile_calls, forwards=2 * MICRO_BATCHES)
    assert_equal_runs(resident, blockwise)
    # Control: tiling is part of the function, so a run whose module does not tile differs from the
    # tiled ones: LoRA dropout draws its masks tile by tile (the losses differ from the first
    # micro-batch on), and the weight gradients sum over the tokens tile by tile.
    untiled = fit(CausalLMModule(lambda: build_model("llama")), "auto")
    assert runs_differ(resident, untiled)
