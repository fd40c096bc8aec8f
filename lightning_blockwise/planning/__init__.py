"""Planning a blockwise run: the memory model, a step's budget and plan, sizes from a config alone, memory units.

Pure code: errors are ``ValueError`` with the reason and the fix, worded for no caller in
particular; the strategy and the ``plan`` command say them in their own terms.
"""

from lightning_blockwise.planning.memory import ResidencyPlan, StepShape, plan_residency
from lightning_blockwise.planning.units import card_bytes, format_gb, format_gib, parse_bytes

__all__ = [
    "ResidencyPlan",
    "StepShape",
    "card_bytes",
    "format_gb",
    "format_gib",
    "parse_bytes",
    "plan_residency",
]
