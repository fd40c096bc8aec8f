"""The model shapes the documentation measures and plans for: the Qwen2.5 7B, 32B and 72B configs, no checkpoint needed.

The same shapes as the benchmarks' (``benchmarks/step_benchmark.py``'s ``SHAPES``), so that ``lightning-blockwise plan
--shape 7b`` answers for the very configs the measured numbers come from.
"""

from __future__ import annotations

from typing import Any

#: The published Qwen2.5 configs' sizes (vocabulary 152064, untied head), by the name ``plan --shape`` takes.
DOCUMENTED_SHAPES: dict[str, dict[str, int]] = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
}  # fmt: skip


def shape_config(name: str) -> Any:
    """The ``Qwen2Config`` of a documented shape (``"7b"``, ``"32b"``, ``"72b"``).

    Raises:
        ValueError: If ``name`` is not one of them.
    """
    if name not in DOCUMENTED_SHAPES:
        raise ValueError(
            f"there is no documented shape {name!r}; pick one of {', '.join(DOCUMENTED_SHAPES)}, or give a checkpoint."
        )
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=152064, tie_word_embeddings=False, **DOCUMENTED_SHAPES[name])


__all__ = ["DOCUMENTED_SHAPES", "shape_config"]
