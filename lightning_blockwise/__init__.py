"""lightning-blockwise: fine-tune adapters on a frozen 4-bit base streamed through the GPU block by block.

Importing the package registers ``"blockwise"`` in Lightning's strategy registry, so
``Trainer(strategy="blockwise")`` works, under ``lightning.pytorch`` and, where the ``pytorch-lightning``
distribution is installed, under ``pytorch_lightning`` too (``lightning_blockwise.pl`` is the package for it).
"""

# First, before anything imports bitsandbytes, whose warnings come at import time (NOTE [ The bitsandbytes "pip
# install kernels" warning ] in compat/quiet_logs.py).
from lightning_blockwise.compat import quiet_logs  # noqa: F401

# isort: split
from lightning.pytorch.strategies import StrategyRegistry

from lightning_blockwise.architectures import VALIDATED_MODEL_TYPES
from lightning_blockwise.callbacks import BlockwiseProfiler, ParityCheck, ParityError, SampleGenerations
from lightning_blockwise.compat import lightning_namespaces
from lightning_blockwise.compat.bitsandbytes import keep_4bit_trainable_on_cpu
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.loading.random_base import random_blockwise
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

BlockwiseStrategy.register_strategies(StrategyRegistry)
# This file also runs as `lightning_blockwise.pl`, the package for `pytorch_lightning` (NOTE [ Two Lightning
# namespaces ] in compat/lightning_namespaces.py): the line above registers each twin in its own registry; the original
# loads the twin when `pytorch_lightning` is imported (now, or later by the user), and never imports it itself
# (NOTE [ The twins load when pytorch_lightning does ]).
if __name__ == lightning_namespaces.PACKAGE:
    lightning_namespaces.load_twins_with_pytorch_lightning(BlockwiseStrategy)
else:
    lightning_namespaces.pair(BlockwiseStrategy)

__version__ = "0.1.0"
__all__ = [
    "VALIDATED_MODEL_TYPES",
    "BlockwiseProfiler",
    "BlockwiseStrategy",
    "ParityCheck",
    "ParityError",
    "SampleGenerations",
    "__version__",
    "keep_4bit_trainable_on_cpu",
    "load_blockwise",
    "random_blockwise",
]
