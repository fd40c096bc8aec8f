"""Code that runs right after a module is imported, by anyone: how the package acts on Lightning without importing it.

``import lightning_blockwise`` registers ``"blockwise"`` in Lightning's strategy registry and loads the
``pytorch_lightning`` twins, but importing Lightning costs seconds that ``lightning-blockwise --help`` or
``versions`` should not pay (NOTE [ Registration waits for Lightning ] in compat/strategy_registry.py). So the work
waits for the import of the module it needs: :func:`when_imported` runs it at once where that module is imported
already, else right after whoever imports it next.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType


class _WhenImported(importlib.abc.MetaPathFinder):
    """Runs ``then`` once, right after the module ``name`` has finished executing (imported by anyone).

    It leaves ``sys.meta_path`` only then: a ``find_spec`` that imports nothing (``importlib.util.find_spec``, how
    libraries ask whether a package is installed) must not use it up.
    """

    def __init__(self, name: str, then: Callable[[], object], before: Callable[[], object] | None) -> None:
        self.name, self.then, self.before, self.finding = name, then, before, False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name or self.finding:
            return None
        self.finding = True  # the real spec is found below, by the finders after this one
        try:
            # For a submodule (`lightning.pytorch`) the parent is in `sys.modules` already, being imported.
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def execute_then(module: ModuleType) -> None:
            # A loader may serve many modules (the twins' finder does): the next module it runs is this one only
            # where the import follows this `find_spec`, so the wrapper goes at once and looks at the name.
            vars(loader).pop("exec_module", None)
            if module.__name__ != self.name:
                execute(module)
                return
            if self.before is not None:
                self.before()
            execute(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
                self.then()

        loader.exec_module = execute_then  # type: ignore[method-assign]  # on the instance, until the next module
        return spec


def when_imported(name: str, then: Callable[[], object], before: Callable[[], object] | None = None) -> None:
    """Run ``then`` now if module ``name`` is imported, else once, right after it is (by anyone).

    A second call for the same ``name`` and function (``then.__qualname__``) before the import changes nothing, so
    a package that runs it as it loads may be reloaded.

    Args:
        name: A module's full name (``"lightning.pytorch"``).
        then: What to run; an exception it raises comes out of the import of ``name``.
        before: What to run first, just before the module's code, when it is not imported yet.
    """
    if sys.modules.get(name) is not None:
        then()
        return
    waiting = [(f.name, f.then.__qualname__) for f in sys.meta_path if isinstance(f, _WhenImported)]
    if (name, then.__qualname__) not in waiting:
        sys.meta_path.insert(0, _WhenImported(name, then, before))


def importing(prefix: str, but: tuple[str, ...] = ()) -> list[str]:
    """The modules under ``prefix`` (``"pkg."``) that are executing now, an import of them unfinished, but ``but``.

    Python marks a module's spec ``_initializing`` while its code runs; ``from module import name`` then fails for a
    name not defined yet ("partially initialized module").
    """
    return [
        name
        for name, module in list(sys.modules.items())
        if name.startswith(prefix)
        and name not in but
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
    ]


__all__ = ["importing", "when_imported"]
