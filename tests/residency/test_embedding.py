"""The host embedding's inputs hook (NOTE [ Host embedding lookup ]): a forward's inputs reach the compute device."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_blockwise.residency import embedding


class _Model(nn.Module):
    """Reports the devices its forward's tensors arrive on, as ``generate``'s call would pass them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, scale: float = 1.0) -> list[str]:
        assert scale == 2.0  # what is not a tensor passes through
        return [input_ids.device.type, position_ids.device.type if position_ids is not None else "none"]


def test_the_model_forward_gets_its_inputs_on_the_compute_device_while_the_table_is_on_the_host() -> None:
    model = _Model()
    ids = torch.tensor([[1, 2]])
    # The meta device stands in for the GPU on a CPU-only machine: the hook's `.to` is what is checked.
    embedding.install(model.embed_tokens, torch.device("meta"), model)
    assert model(ids, position_ids=torch.arange(2)[None], scale=2.0) == ["meta", "meta"]
    assert model(ids.to("meta"), scale=2.0) == ["meta", "none"]
    assert model.embed_tokens.weight.device.type == "cpu"
    # Control: without the hook (uninstalled) the inputs arrive where the caller left them.
    embedding.uninstall(model.embed_tokens)
    assert model(ids, position_ids=torch.arange(2)[None], scale=2.0) == ["cpu", "cpu"]
    assert not model._forward_pre_hooks


def test_installing_twice_leaves_one_hook() -> None:
    model = _Model()
    embedding.install(model.embed_tokens, torch.device("meta"), model)
    embedding.install(model.embed_tokens, torch.device("meta"), model)
    assert len(model._forward_pre_hooks) == 1
