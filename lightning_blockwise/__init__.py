"""lightning-blockwise: fine-tune adapters on a frozen 4-bit base streamed through the GPU block by block.

Importing the package registers ``"blockwise"`` in Lightning's strategy registry, so
``Trainer(strategy="blockwise")`` works, under ``lightning.pytorch`` and, where the ``pytorch-lightning``
distribution is installed, under ``pytorch_lightning`` too (``lightning_blockwise.pl`` is the package for it).
The import itself loads neither Lightning nor torch: the names below load at first use, and the registration
happens as Lightning's own import finishes (NOTE [ Registration waits for Lightning ] in compat/strategy_registry.py).
"""

import importlib
from typing import TYPE_CHECKING, Any

# First, before anything imports bitsandbytes, whose warnings come at import time (NOTE [ The bitsandbytes "pip
# install kernels" warning ] in compat/quiet_logs.py).
from lightning_blockwise.compat import quiet_logs  # noqa: F401

# isort: split
from lightning_blockwise.compat import lightning_namespaces, strategy_registry

if TYPE_CHECKING:
    from lightning_blockwise.architectures import VALIDATED_MODEL_TYPES
    from lightning_blockwise.callbacks import BlockwiseProfiler, ParityCheck, ParityError, SampleGenerations
    from lightning_blockwise.compat.bitsandbytes import keep_4bit_trainable_on_cpu
    from lightning_blockwise.loading.load import load_blockwise
    from lightning_blockwise.loading.random_base import random_blockwise
    from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

__version__ = "0.1.0"

#: Each public name and the module it comes from, imported at its first use (PEP 562 ``__getattr__``).
_PUBLIC = {
    "VALIDATED_MODEL_TYPES": "lightning_blockwise.architectures",
    "BlockwiseProfiler": "lightning_blockwise.callbacks",
    "BlockwiseStrategy": "lightning_blockwise.strategy.blockwise",
    "ParityCheck": "lightning_blockwise.callbacks",
    "ParityError": "lightning_blockwise.callbacks",
    "SampleGenerations": "lightning_blockwise.callbacks",
    "keep_4bit_trainable_on_cpu": "lightning_blockwise.compat.bitsandbytes",
    "load_blockwise": "lightning_blockwise.loading.load",
    "random_blockwise": "lightning_blockwise.loading.random_base",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module at first use (then kept as an attribute).

    Raises:
        AttributeError: If ``name`` is not one of the package's names.
    """
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Lightning first, so that its import registers "blockwise" before any of our modules starts loading (NOTE
    # [ Registration waits for Lightning ]): every public name but the version needs Lightning anyway.
    importlib.import_module("lightning.pytorch")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})


# This file also runs as `lightning_blockwise.pl`, the package for `pytorch_lightning` (NOTE [ Two Lightning
# namespaces ] in compat/lightning_namespaces.py), where the names above read `pytorch_lightning` and
# `lightning_blockwise.pl...`: each twin registers its own class in its own registry. The original loads the twin when
# `pytorch_lightning` is imported (now, or later by the user), and never imports it itself (NOTE [ The twins load when
# pytorch_lightning does ]).
strategy_registry.register_when_imported("lightning.pytorch")
if __name__ == lightning_namespaces.PACKAGE:
    lightning_namespaces.load_twins_with_pytorch_lightning()
else:
    lightning_namespaces.pair()

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
