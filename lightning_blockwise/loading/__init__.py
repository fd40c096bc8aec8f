"""A base straight into the host arena: a checkpoint loaded (``load_blockwise``) or random (``random_blockwise``)."""

from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.loading.random_base import random_blockwise

__all__ = ["load_blockwise", "random_blockwise"]
