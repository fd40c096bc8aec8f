"""``"blockwise"`` in Lightning's strategy registries, registered without importing Lightning first."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from lightning_blockwise.compat.import_hooks import importing, when_imported
from lightning_blockwise.compat.lightning_namespaces import LIGHTNING, PACKAGE, STRATEGY_MODULE, TWIN_PACKAGE

#: The name ``Trainer(strategy=...)`` takes (``BlockwiseStrategy.strategy_name``).
STRATEGY_NAME = "blockwise"


# NOTE [ Registration waits for Lightning ]
# `import lightning_blockwise` imports no Lightning, torch or transformers (`--help`, `versions` and `plan --help` start
# in a fraction of the seconds Lightning takes), yet `Trainer(strategy="blockwise")` must find the name. Whoever holds
# a Trainer has imported Lightning, so the name is registered as Lightning's import finishes (`when_imported`), or at
# once where it is imported already; the package's public names import Lightning first (`lightning_blockwise.
# __getattr__`). Registering imports the strategy's module, which an import of one of our modules still under way
# (`from lightning_blockwise.residency.arena import ...` in a fresh process imports Lightning halfway) would meet
# half-made; there the registry holds a builder that imports the class at the Trainer's call, and the class takes its
# place as soon as its module has loaded.
def register_when_imported(namespace: str) -> None:
    """Register ``"blockwise"`` in ``namespace``'s strategy registry now if it is imported, else right after.

    Args:
        namespace: ``"lightning.pytorch"`` (the original's registry) or ``"pytorch_lightning"`` (the twin's).
    """
    module = f"{PACKAGE if namespace == LIGHTNING else TWIN_PACKAGE}.{STRATEGY_MODULE}"

    def register() -> None:
        registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
        if STRATEGY_NAME in registry:
            return
        if not importing(f"{PACKAGE}.", but=(TWIN_PACKAGE,)):
            register_class()
            return
        registry.register(STRATEGY_NAME, build_blockwise, description="lightning-blockwise (loads at first use)")
        if module not in sys.modules:
            when_imported(module, register_class)

    def register_class() -> type:
        registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
        if STRATEGY_NAME in registry and registry[STRATEGY_NAME]["strategy"] is build_blockwise:
            registry.pop(STRATEGY_NAME)
        strategy = importlib.import_module(module).BlockwiseStrategy
        strategy.register_strategies(registry)
        return strategy

    def build_blockwise(**init_params: Any) -> Any:
        return register_class()(**init_params)

    when_imported(namespace, register)


__all__ = ["STRATEGY_NAME", "register_when_imported"]
