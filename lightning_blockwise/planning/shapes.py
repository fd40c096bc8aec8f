"""The model shapes the documentation measures and plans for, no checkpoint needed.

The Qwen2.5 7B, 32B and 72B configs are the benchmarks' (``benchmarks/step_benchmark.py``'s ``SHAPES``), so that
``lightning-blockwise plan --shape 7b`` answers for the very configs the measured numbers come from. ``405b`` is
Llama-3.1-405B's published config, the largest model planned for one 8-GPU node (docs/several-gpus.md).
"""

from __future__ import annotations

from typing import Any

#: The published configs' sizes, by the name ``plan --shape`` takes (their family: :data:`_FAMILIES`).
DOCUMENTED_SHAPES: dict[str, dict[str, int]] = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8),
}  # fmt: skip

#: What a family's configs share beyond the sizes: the Qwen2.5 configs' vocabulary and untied head; Llama 3.1's
#: vocabulary and special tokens, untied head, RoPE (theta 500000, the "llama3" scaling to 131072 positions) and norm
#: epsilon, as meta-llama/Llama-3.1-405B's config.json states them.
_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", dict(vocab_size=152064, tie_word_embeddings=False)),
    "llama3.1": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            tie_word_embeddings=False,
            bos_token_id=128000,
            eos_token_id=128001,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_scaling=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        ),
    ),
}
_FAMILY_OF = {"7b": "qwen2", "32b": "qwen2", "72b": "qwen2", "405b": "llama3.1"}


def shape_config(name: str) -> Any:
    """The config of a documented shape: a ``Qwen2Config`` (``7b``, ``32b``, ``72b``) or a ``LlamaConfig`` (``405b``).

    Raises:
        ValueError: If ``name`` is not one of them.
    """
    if name not in DOCUMENTED_SHAPES:
        raise ValueError(
            f"there is no documented shape {name!r}; pick one of {', '.join(DOCUMENTED_SHAPES)}, or give a checkpoint."
        )
    import transformers

    class_name, shared = _FAMILIES[_FAMILY_OF[name]]
    return getattr(transformers, class_name)(**shared, **DOCUMENTED_SHAPES[name])


__all__ = ["DOCUMENTED_SHAPES", "shape_config"]
