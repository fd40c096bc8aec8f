"""lightning-blockwise: fine-tune adapters on a frozen 4-bit base streamed through the GPU block by block.

Importing the package registers ``"blockwise"`` in Lightning's strategy registry, so
``Trainer(strategy="blockwise")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_blockwise.architectures import VALIDATED_MODEL_TYPES
from lightning_blockwise.callbacks import BlockwiseProfiler, ParityCheck, ParityError, SampleGenerations
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.loading.random_base import random_blockwise
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

BlockwiseStrategy.register_strategies(StrategyRegistry)

__version__ = "0.1.0"
__all__ = [
    "VALIDATED_MODEL_TYPES",
    "BlockwiseProfiler",
    "BlockwiseStrategy",
    "ParityCheck",
    "ParityError",
    "SampleGenerations",
    "__version__",
    "load_blockwise",
    "random_blockwise",
]
