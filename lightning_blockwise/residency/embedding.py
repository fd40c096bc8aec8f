"""The frozen input embedding, looked up in host memory."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

# NOTE [ Host embedding lookup ]
# An embedding forward is a row gather (times a constant for Gemma's scaled embeddings),
# and a gather copies bits: the rows are the same wherever the table lives, and the
# scale multiply is one correctly rounded product on any device. So the table can stay in
# host RAM, the few rows a batch needs are gathered there, and only they travel to the
# device. At 32B that keeps a 1.56 GB table out of VRAM for a transfer of a few hundred KB
# per step. A table that trains, or that is tied to the LM head, stays on the device.
#
# The table is the model's first parameter, so the model's `device` (Hugging Face's: the first
# parameter's) reads "cpu" once it moves, and `generate` moves each step's inputs (position ids,
# attention mask) there before calling the model, away from the rotary tables and layers on the
# device. So while the table lives on the host, a pre-hook on the model moves the tensors a forward
# is called with to the compute device, as accelerate's hooks do for a model dispatched over
# devices; inputs already there are passed through untouched.


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
        #: The pre-hook on the model that brings its inputs to ``device``, removed with this forward.
        self.inputs_hook: RemovableHandle | None = None

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


_Inputs = tuple[tuple[Any, ...], dict[str, Any]]


def inputs_to(device: torch.device) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], _Inputs]:
    """A forward pre-hook (``with_kwargs=True``) that moves the tensors a forward is called with to ``device``."""

    def moved(value: Any) -> Any:
        return value.to(device) if isinstance(value, Tensor) and value.device != device else value

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Inputs:
        return tuple(moved(value) for value in args), {name: moved(value) for name, value in kwargs.items()}

    return hook


def install(embedding: nn.Module, device: torch.device, model: nn.Module) -> None:
    """Move ``embedding``'s table to host memory and look rows up there (NOTE [ Host embedding lookup ]).

    Args:
        embedding: The input embedding.
        device: The compute device.
        model: The Hugging Face model that holds ``embedding``: its forward's inputs are moved to ``device``.
    """
    uninstall(embedding)
    embedding.to("cpu")
    forward = HostEmbedding(embedding, device)
    forward.inputs_hook = model.register_forward_pre_hook(inputs_to(device), with_kwargs=True)
    embedding.forward = forward


def uninstall(embedding: nn.Module) -> None:
    """Remove an installed :class:`HostEmbedding` and its inputs hook (the table stays in host memory)."""
    forward = vars(embedding).get("forward")
    if isinstance(forward, HostEmbedding):
        if forward.inputs_hook is not None:
            forward.inputs_hook.remove()
        del embedding.forward
