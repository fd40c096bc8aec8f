"""Memory sizes: reading them from the user, writing them for the user."""

from __future__ import annotations

import math


def parse_bytes(value: int | str) -> int:
    """Bytes from a positive int or a string like ``"16GiB"``, ``"24GB"``, ``"512MiB"``.

    Raises:
        ValueError: If ``value`` is not an int or a string (a bool or a float is
            refused: a size is a count of bytes), the string is not a finite number with a known
            unit, or the size is not positive.
    """
    hint = "Give an integer number of bytes or a number with a unit, e.g. '16GiB' or '24GB'."
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"Cannot read {value!r} ({type(value).__name__}) as a memory size. {hint}")
    if isinstance(value, int):
        nbytes = value
    else:
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
        units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        text = value.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number) :]
        try:
            amount = float(number) * units[unit]
        except (KeyError, ValueError):
            raise ValueError(f"Cannot read {value!r} as a memory size. {hint}") from None
        if not math.isfinite(amount):
            raise ValueError(f"Cannot read {value!r} as a memory size: it is not finite. {hint}")
        nbytes = int(amount)
    if nbytes <= 0:
        raise ValueError(f"The memory size {value!r} must be positive. {hint}")
    return nbytes


def format_gb(nbytes: int | float, *, digits: int = 2) -> str:
    """``nbytes`` in decimal gigabytes, as the package's reports print them: ``"3.11 GB"``.

    Args:
        nbytes: The size in bytes.
        digits: Decimal places; the parity report prints three (``"0.012 GB"``).
    """
    return f"{nbytes / 1e9:.{digits}f} GB"


def format_gib(nbytes: int | float) -> str:
    """``nbytes`` in binary gibibytes, as budgets are given: ``"16.00 GiB"``."""
    return f"{nbytes / 2**30:.2f} GiB"


__all__ = ["format_gb", "format_gib", "parse_bytes"]
