"""Memory sizes: reading them from the user, writing them for the user."""

from __future__ import annotations

import math
import re


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


# NOTE [ Cards are sold in binary gigabytes ]
# A card sold as "24 GB" (an RTX 4090, an L4) has 24 GiB of memory: GPU makers write GB for 2**30 bytes. Read
# decimally, `plan --card 24GB` planned a 22.35 GiB card, 7% less than the user has, and answered 112,640 tokens
# where `--card 24GiB` answered 122,880. A card's size given in GB (or MB, TB) is therefore read in the binary
# unit; sizes of other things (a vram_budget, a file) keep the decimal meaning `parse_bytes` gives them.
def card_bytes(value: int | str) -> int:
    """A GPU's memory from an int or a string like ``"24GB"`` or ``"24GiB"``, GB read as GiB (NOTE above).

    Raises:
        ValueError: As :func:`parse_bytes`.
    """
    if not isinstance(value, str):
        return parse_bytes(value)
    # "24GB", "24 gb", "24000MB": the decimal spellings of a card's size mean the binary units.
    binary = re.sub(r"(?i)([KMGT])B$", r"\1iB", value.strip())
    try:
        return parse_bytes(binary)
    except ValueError:
        # The same mistake either way (a bad number, not the unit): worded with what the user wrote.
        return parse_bytes(value)


def format_gb(nbytes: int | float, *, digits: int = 2) -> str:
    """``nbytes`` in decimal gigabytes, as the package's reports print them: ``"3.11 GB"``.

    Args:
        nbytes: The size in bytes.
        digits: Decimal places; the parity report prints three (``"0.012 GB"``). A size that rounds to zero in GB
            is written in MB or kB (NOTE [ No size printed as zero ]).
    """
    return _scaled(nbytes, _DECIMAL, digits)


def format_card(nbytes: int) -> str:
    """A card's memory in both units, so that the size planned for is plain: ``"24 GiB card (25.77 GB)"``."""
    return f"{nbytes / 2**30:g} GiB card ({nbytes / 1e9:.2f} GB)"


def format_gib(nbytes: int | float) -> str:
    """``nbytes`` in binary gibibytes, as budgets are given: ``"16.00 GiB"`` (NOTE [ No size printed as zero ])."""
    return _scaled(nbytes, _BINARY, 2)


def format_mib(nbytes: int | float) -> str:
    """``nbytes`` in whole binary mebibytes, as slots are sized: ``"270 MiB"`` (NOTE [ No size printed as zero ])."""
    return _scaled(nbytes, _BINARY[1:], 0)


# NOTE [ No size printed as zero ]
# A tiny model's host arena (the demo's: 50 kB) printed as "0.000 GB" and its slots as "0 MiB": a size that is not
# zero must not read as one. Where a size rounds to zero in the unit a report uses, it is written in the largest
# smaller unit where it does not (kB/KiB, then bytes), with as many decimals; sizes that do not round to zero, and
# zero itself, read as before.
_DECIMAL = (("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
_BINARY = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _scaled(nbytes: int | float, units: tuple[tuple[str, int], ...], digits: int) -> str:
    """``nbytes`` in the first of ``units`` (largest first) where it does not round to zero, else in bytes."""
    if nbytes == 0:
        return f"{0:.{digits}f} {units[0][0]}"
    for name, size in units:
        text = f"{nbytes / size:.{digits}f}"
        if float(text) != 0:
            return f"{text} {name}"
    return f"{nbytes:.0f} B"


__all__ = ["card_bytes", "format_card", "format_gb", "format_gib", "format_mib", "parse_bytes"]
