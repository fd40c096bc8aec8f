"""Checks of ``CausalLMFineTune``'s options, in its constructor, before any work: errors that say the fix."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.compat.flags import check_flag
from lightning_blockwise.recipes.optimizers import OPTIMIZERS

_OWNER = "CausalLMFineTune"
#: The names ``loader`` takes.
LOADERS = ("auto", "standard", "blockwise")
#: The names ``dora_norm`` takes.
DORA_NORMS = ("dense", "factored")


def check_recipe_options(options: dict[str, Any]) -> None:
    """Refuse an option of ``CausalLMFineTune`` that is not one of its choices or of its type.

    Args:
        options: The constructor's arguments by name (those it does not check are ignored).

    Raises:
        MisconfigurationException: If ``loader``, ``optimizer`` or ``dora_norm`` is not one of its choices, a flag
            (``use_dora``, ``random_init``, ...) is not ``True`` or ``False`` (a string above all: NOTE [ A string is
            not a flag ] in compat/flags.py), or a long-context option is neither ``None`` nor an integer of at least 1.
    """
    for name, choices in (("loader", LOADERS), ("optimizer", OPTIMIZERS), ("dora_norm", DORA_NORMS)):
        if options[name] not in choices:
            listed = " or ".join(map(repr, choices)) if len(choices) == 2 else f"one of {', '.join(map(repr, choices))}"
            raise MisconfigurationException(f"{_OWNER}({name}={options[name]!r}): choose {listed}.")
    for name in ("use_dora", "random_init", "overwrite_adapter", "allow_other_base"):
        check_flag(_OWNER, name, options[name])
    check_flag(_OWNER, "quantize", options["quantize"], none_means="takes adapter_path's record, else NF4")
    _check_count("loss_chunk_tokens", options["loss_chunk_tokens"], "1024 rows of logits at a time")
    _check_count("mlp_tile_tokens", options["mlp_tile_tokens"], "4096 tokens per tile")
    _check_count("attention_tile_tokens", options["attention_tile_tokens"], "16384 queries per tile")


def _check_count(name: str, value: int | None, example: str) -> None:
    """Refuse a long-context option that is neither ``None`` nor an integer of at least 1."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return
    raise MisconfigurationException(
        f"{_OWNER}({name}={value!r}) must be an integer of at least 1 (e.g. {example}), or None to leave it off."
    )


__all__ = ["DORA_NORMS", "LOADERS", "check_recipe_options"]
