"""What a decoder layer was called with: its keyword arguments and the autocast state."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_blockwise.compat.transformers import is_cache, is_cache_argument

# NOTE [ Per-layer call replay ]
# Decoder layers of one model are not called with one set of arguments. Hybrid models
# (Gemma 2/3, Qwen2 with ``use_sliding_window``) hand sliding-window layers a different
# attention mask than global ones, and Gemma 3 also a different rotary table. So every
# layer's own keyword arguments are kept with its saved input and handed back to the
# same layer in its recompute. The tensors among them (masks, cos/sin tables, position
# ids) are shared by all layers of a step, so keeping references costs no memory.
#
# The KV cache is the one argument not replayed: a recompute that wrote into the cache
# again would attend over its own keys twice. Like Hugging Face's gradient
# checkpointing, a captured call runs without a cache in both the forward and the
# recompute; training never reads it. Its name changes between transformers releases
# (NOTE [ The KV cache under every name ] in compat/transformers.py).


@dataclass(frozen=True)
class AutocastState:
    """The autocast settings in force for one device type, as ``torch.amp.autocast`` takes them."""

    device_type: str
    enabled: bool
    dtype: torch.dtype
    cache_enabled: bool

    @classmethod
    def capture(cls, device_type: str) -> AutocastState:
        """Read the current autocast state of ``device_type``."""
        return cls(
            device_type=device_type,
            enabled=torch.is_autocast_enabled(device_type),
            dtype=torch.get_autocast_dtype(device_type),
            cache_enabled=torch.is_autocast_cache_enabled(),
        )

    def context(self) -> torch.amp.autocast:
        """An autocast context that restores this state."""
        return torch.amp.autocast(
            device_type=self.device_type, enabled=self.enabled, dtype=self.dtype, cache_enabled=self.cache_enabled
        )


@dataclass(frozen=True)
class LayerCall:
    """One layer's call arguments (beyond the hidden states) and the autocast state around it.

    Mirrors ``torch.utils.checkpoint``: the autocast state of the layer's device type and
    of the CPU are both restored, since a user may have autocast on for both.
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    autocast: tuple[AutocastState, ...]

    @classmethod
    def capture(cls, device: torch.device, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> LayerCall:
        """Record a layer's call made on ``device``, dropping the KV cache (NOTE [ Per-layer call replay ]).

        Raises:
            RuntimeError: If an argument other than the hidden states requires grad: its
                gradient would be lost, since only the hidden states and adapters get one.
        """
        kwargs = {name: None if is_cache_argument(name, value) else value for name, value in kwargs.items()}
        if "use_cache" in kwargs:
            kwargs["use_cache"] = False
        for name, value in [*enumerate(args), *kwargs.items()]:
            if any(t.requires_grad for t in _tensors(value)):
                raise RuntimeError(
                    f"BlockwiseStrategy: decoder layer argument {name!r} requires grad, but only the hidden states"
                    " and the adapter parameters can receive gradients through a rematerialized layer. Detach it"
                    " before the decoder stack or train with `strategy='auto'`."
                )
        states = [AutocastState.capture(device.type)]
        if device.type != "cpu":
            states.append(AutocastState.capture("cpu"))
        args = tuple(None if is_cache(value) else value for value in args)
        return cls(args=args, kwargs=kwargs, autocast=tuple(states))

    @contextmanager
    def autocast_context(self) -> Iterator[None]:
        """Restore the captured autocast state of every recorded device type."""
        with ExitStack() as stack:
            for state in self.autocast:
                stack.enter_context(state.context())
            yield


def _tensors(value: Any) -> Iterator[Tensor]:
    """The tensors in an argument, looking one level into tuples, lists and dicts (rotary ``(cos, sin)``)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        yield from (v for v in value if isinstance(v, Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, Tensor))
