"""Options that must be ``True`` or ``False``: refused when they are anything else, a string above all.

Example::

    check_flag("CausalLMFineTune", "use_dora", use_dora)  # "no" is refused, not read as True
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

# NOTE [ A string is not a flag ]
# Python reads every non-empty string as True, so `use_dora="no"` trained DoRA and `share="false"` shared, silently.
# A YAML `use_dora: "no"` (quoted) or a command line's `--model.init_args.use_dora=no` read by a parser that keeps
# strings arrive as such strings. So every option of ours that is a flag is checked by type, here, by the strategy,
# the recipes and the loaders alike, and the message says how to write it in Python and in YAML.


def check_flag(owner: str, name: str, value: Any, none_means: str | None = None) -> None:
    """Refuse an option that must be ``True`` or ``False`` (or ``None``, where ``none_means`` says what it does).

    Args:
        owner: What the option belongs to, as the user calls it: ``"BlockwiseStrategy"``, ``"load_blockwise"``.
        name: The option's name.
        value: The value given.
        none_means: What ``None`` does, if ``None`` is allowed (e.g. ``"decides from the plan"``).

    Raises:
        MisconfigurationException: Naming the option, the value, its type, and how to write a flag.
    """
    if isinstance(value, bool) or (value is None and none_means is not None):
        return
    allowed = "True or False" if none_means is None else f"True, False or None (None {none_means})"
    # Any non-empty string reads as True, so say so: `"no"` and `"false"` would otherwise look like False.
    truthy = " (every non-empty string reads as True)" if isinstance(value, str) else ""
    raise MisconfigurationException(
        f"`{owner}({name}={value!r})` must be {allowed}, not a {type(value).__name__}{truthy}. Write `{name}=True` or"
        f" `{name}=False` in Python, or `{name}: true` / `false` unquoted in YAML."
    )


__all__ = ["check_flag"]
