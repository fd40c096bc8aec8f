"""Old module paths, kept as aliases of the modules that now live in the package's folders."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def alias(old: str, new: str, *more: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves every name of ``new`` (then of ``more``) under ``old``, warning on import.

    Keeps imports, ``class_path`` values in YAML configs, and the class paths stored in checkpoints
    (which the CLI imports again on ``--ckpt_path``) working after a module moved.

    Args:
        old: The old module's name (its ``__name__``).
        new: Where the module lives now.
        more: Modules that took some of its names.
    """
    modules = [importlib.import_module(name) for name in (new, *more)]
    where = " and ".join(f"`{name}`" for name in (new, *more))
    warnings.warn(f"`{old}` moved to {where}; import it from there.", DeprecationWarning, stacklevel=3)

    def __getattr__(name: str) -> Any:
        for module in modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
