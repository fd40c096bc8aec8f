"""Deprecated: moved to :mod:`lightning_blockwise.recipes.finetune`; old imports and class paths still work."""

from lightning_blockwise._deprecated import alias

__getattr__ = alias(__name__, "lightning_blockwise.recipes.finetune")
