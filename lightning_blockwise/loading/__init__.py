"""Loading a checkpoint block by block straight into the host arena (``load_blockwise``)."""

from lightning_blockwise.loading.load import load_blockwise

__all__ = ["load_blockwise"]
