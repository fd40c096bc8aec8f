"""`move_rest_to_device` moves a module through public calls: modules that override how they move (torchmetrics)
move as under `.to()`, the decoder layers' frozen tensors stay (NOTE [ Placement through public calls ])."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torchmetrics import MeanMetric

from lightning_blockwise.residency import placement

META = torch.device("meta")


class _Tree(nn.Module):
    """Decoder layers, a head, a metric that holds state, and a buffer of the container's own."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)
        self.mean = MeanMetric()
        self.mean.update(torch.tensor([1.0, 3.0]))
        self.register_buffer("scale", torch.ones(1))


def _placed() -> _Tree:
    """The tree placed on the meta device, its layers' tensors excluded (they stay bound to the host arena)."""
    tree = _Tree()
    placement.move_rest_to_device(tree, SimpleNamespace(layers=list(tree.layers)), META, skip=[])  # type: ignore[arg-type]
    return tree


def test_a_metric_moves_with_its_states_and_the_layers_stay() -> None:
    tree = _placed()
    assert tree.mean.mean_value.device == tree.mean.weight.device == META
    assert tree.mean.device == META  # the metric's own record of its device, which its `_apply` keeps
    assert tree.head.weight.device == tree.scale.device == META
    assert all(p.device.type == "cpu" for p in tree.layers.parameters())


def test_control_the_private_call_per_module_crashes_on_this_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree shows the bug: walked module by module with `_apply(fn, recurse=False)`, as placement did before
    issue 42, the metric's `_apply` (which takes no `recurse`) raises."""
    monkeypatch.setattr(placement, "_above", lambda module, skipped: {id(m) for m in module.modules()})
    monkeypatch.setattr(
        placement, "_move_own_tensors", lambda sub, device: sub._apply(lambda t: t.to(device), recurse=False)
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'recurse'"):
        _placed()
