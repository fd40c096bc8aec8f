"""The frozen input embedding, looked up in host memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# NOTE [ Host embedding lookup ]
# An embedding forward is a row gather (times a constant for Gemma's scaled embeddings),
# and a gather copies bits: the rows are the same wherever the table lives, and the
# scale multiply is one correctly rounded product on any device. So the table can stay in
# host RAM, the few rows a batch needs are gathered there, and only they travel to the
# device. At 32B that keeps a 1.56 GB table out of VRAM for a transfer of a few hundred KB
# per step. A table that trains, or that is tied to the LM head, stays on the device.


class HostEmbedding:
    """The forward installed on a frozen embedding whose table lives in host memory.

    Args:
        embedding: The input embedding module (any subclass; its own forward does the lookup).
        device: Where the looked-up rows go.
    """

    def __init__(self, embedding: nn.Module, device: torch.device) -> None:
        self.embedding = embedding
        self.device = device
        self._forward = type(embedding).forward

    def __call__(self, input_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """Gather the rows on the host and send them to the device."""
        rows = self._forward(self.embedding, input_ids.to("cpu"), *args, **kwargs)
        return rows.to(self.device)


def can_stay_on_host(embedding: nn.Module, model: nn.Module) -> bool:
    """Whether ``embedding`` is frozen and shares no parameter with the rest of ``model`` (a tied head)."""
    params = list(embedding.parameters())
    if not params or any(p.requires_grad for p in params):
        return False
    storages = {p.untyped_storage().data_ptr() for p in params}
    inside = {id(m) for m in embedding.modules()}
    return not any(
        p.untyped_storage().data_ptr() in storages
        for module in model.modules()
        if id(module) not in inside
        for p in module.parameters(recurse=False)
    )


def install(embedding: nn.Module, device: torch.device) -> None:
    """Move ``embedding``'s table to host memory and look rows up there (NOTE [ Host embedding lookup ])."""
    uninstall(embedding)
    embedding.to("cpu")
    embedding.forward = HostEmbedding(embedding, device)


def uninstall(embedding: nn.Module) -> None:
    """Remove an installed :class:`HostEmbedding` (the table stays in host memory)."""
    if isinstance(vars(embedding).get("forward"), HostEmbedding):
        del embedding.forward
