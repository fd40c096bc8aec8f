"""Deprecated: moved to :mod:`lightning_blockwise.demos.tiny`; old imports and class paths still work."""

from lightning_blockwise._deprecated import alias

__getattr__ = alias(
    __name__,
    "lightning_blockwise.demos.tiny",
    "lightning_blockwise.demos.progressions",
    "lightning_blockwise.recipes.schedules",
)
