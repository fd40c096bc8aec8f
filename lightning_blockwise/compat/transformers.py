"""What lightning_blockwise knows about the arguments transformers hands its decoder layers.

On a transformers upgrade, check this module first: the rematerialized layers are called with
whatever the model's forward passes them, and a renamed argument slips past a check by name.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import Cache

# NOTE [ The KV cache under every name ]
# transformers has called the decoder layers' KV cache `layer_past` (GPT-2 era), `past_key_value`
# (4.x), `past_key_values` (5.0-5.23) and, since 5.24, `cache` (`@deprecate_kwarg("past_key_values",
# "5.40.0", new_name="cache")` on every layer). A cache that reaches a rematerialized layer is written
# twice, in the forward and in the recompute, and the recomputed attention then sees its keys twice
# (5.24 on a fresh install: every architecture failed that way). So a cache is recognized by its type
# first, whatever it is called, and by these names where it is a legacy tuple or a type we do not know.
CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")


def is_cache(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache, whatever the argument that carries it is called."""
    return isinstance(value, Cache)


def is_cache_argument(name: str, value: Any) -> bool:
    """Whether a layer's keyword argument ``name=value`` is a KV cache (NOTE [ The KV cache under every name ])."""
    return name in CACHE_ARGUMENTS or is_cache(value)
