"""Both Lightning namespaces: ``lightning.pytorch`` (the package's own) and ``pytorch_lightning``, through twins.

``lightning_blockwise.pl`` is the package as ``pytorch_lightning`` sees it: the modules that touch Lightning's
classes, loaded again from our own source with the Lightning names rewritten; every other module is the original.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import re
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

from lightning_blockwise.compat.import_hooks import when_imported

# NOTE [ Two Lightning namespaces ]
# `pip install lightning` installs two copies of Lightning: `lightning.pytorch` (over `lightning.fabric`) and the
# `pytorch-lightning` distribution, `pytorch_lightning` (over `lightning_fabric`), which Lightning builds from the same
# sources by renaming the imports. Their classes are distinct: a `pytorch_lightning.Trainer` accepts only
# `pytorch_lightning` strategies (by `isinstance`), LightningModules and callback roles, and keeps its own strategy
# registry. Most public scripts write `import pytorch_lightning as pl`, so the package exists in both, the way
# Lightning does it: the modules that subclass or test Lightning's classes (`TWINNED`) are loaded a second time as
# `lightning_blockwise.pl.<module>` from our own source with `lightning.pytorch` -> `pytorch_lightning` and
# `lightning.fabric` -> `lightning_fabric` (and our twinned module names -> their twins). User code is never
# rewritten. The rest of the package is shared: it uses Lightning only for exceptions and rank-zero logging.
#
# Which twin serves a Trainer:
# - the name: `import lightning_blockwise` registers "blockwise" in both registries (pytorch_lightning's only where
#   that distribution is installed, so it stays optional), each entry building its own namespace's class;
# - an instance: `lightning_blockwise.BlockwiseStrategy` is registered as a virtual subclass of pytorch_lightning's
#   `ParallelStrategy` (Lightning's strategies are ABCs), so the connector accepts it, and at the connector's first
#   write (`strategy.accelerator = ...`) it becomes the twin in place (`__class__` set, `__init__` re-run with the
#   arguments it was built with), before any other use. The twin is registered as a virtual subclass of the original,
#   so `isinstance(trainer.strategy, lightning_blockwise.BlockwiseStrategy)` holds under both Trainers;
# - a callback of ours converts the same way at `setup`, its first hook (a Trainer only calls a callback's hooks);
# - a LightningModule or data module cannot: the Trainer tests its type before any hook. Our recipe modules are
#   imported from `lightning_blockwise.pl.recipes...` (and `.pl.demos...`) under pytorch_lightning. Any other object of
#   the other namespace (a data module, callback, logger or plugin) is refused in one line with the fix when the
#   strategy launches a Trainer function, before any work (strategy/namespace_check.py). A LightningModule of the
#   other namespace meets Lightning's own `TypeError` first (`Trainer.fit` tests it before any strategy hook): it
#   names the class, not the namespace, and only patching Lightning would change that.

#: Lightning's import names in the namespace ``lightning_blockwise`` is written against, and their twins.
RENAMES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}
LIGHTNING, PYTORCH_LIGHTNING = "lightning.pytorch", "pytorch_lightning"
PACKAGE = "lightning_blockwise"
#: Where the ``pytorch_lightning`` twins live: ``lightning_blockwise.pl.<module>``.
TWIN_PACKAGE = f"{PACKAGE}.pl"
#: Where ``BlockwiseStrategy`` is defined, in the package and in the twin package.
STRATEGY_MODULE = "strategy.blockwise"
_ROOT = Path(__file__).resolve().parent.parent

#: Package modules (relative names, ``""`` the package) that import Lightning classes other than its exceptions and
#: rank-zero logging, the modules that import them, and their packages: loaded twice. tests/compat checks the list
#: against the sources; an entry without a file is skipped.
TWINNED = frozenset(
    {
        "",
        "callbacks",
        "callbacks.generation",
        "callbacks.metrics_plot",
        "callbacks.parity",
        "callbacks.profiler",
        "callbacks.progress_bar",
        "cli",
        "cli.data_check",
        "cli.generate_command",
        "cli.progress_bar_flag",
        "cli.trainer_cli",
        "demos",
        "demos.progressions",
        "demos.tiny",
        "recipes",
        "recipes.data",
        "recipes.finetune",
        "recipes.finetune_build",
        "recipes.finetune_model",
        "recipes.generation",
        "recipes.rank_zero_export",
        "strategy",
        "strategy.accumulation",
        "strategy.blockwise",
        "strategy.checkpoint_files",
        "strategy.checkpoint_hooks",
        "strategy.data_parallel",
        "strategy.fit_loop",
        "strategy.namespace_check",
        "strategy.options",
        "strategy.queries",
        "strategy.run",
        "verification",
        "verification.check",
    }
)

_LIGHTNING_NAME = re.compile(r"\blightning\.(pytorch|fabric)\b")
_OUR_NAME = re.compile(rf"\b{PACKAGE}((?:\.\w+)+)|\b(?<!\.){PACKAGE}(?= import\b)")


def _module_path(relative: str) -> Path | None:
    """The source file of package module ``relative``, or ``None`` where there is none."""
    base = _ROOT.joinpath(*relative.split(".")) if relative else _ROOT
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _twin_our_name(match: re.Match[str]) -> str:
    # The longest dotted prefix that is a module decides: `strategy.queries` is shared, `strategy` is twinned.
    parts = (match.group(1) or "").lstrip(".").split(".") if match.group(1) else []
    for end in range(len(parts), -1, -1):
        relative = ".".join(parts[:end])
        if _module_path(relative) is not None:
            if relative not in TWINNED:
                return match.group(0)
            return ".".join([TWIN_PACKAGE, *parts])
    return match.group(0)


def rewrite(source: str) -> str:
    """Our source as the ``pytorch_lightning`` twin reads it; line for line, so tracebacks point at the file.

    Args:
        source: The text of one of the package's modules.

    Returns:
        The text with Lightning's names and our twinned modules' names replaced.
    """
    source = _LIGHTNING_NAME.sub(lambda m: RENAMES[m.group(0)], source)
    return _OUR_NAME.sub(_twin_our_name, source)


class _TwinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``lightning_blockwise.pl.<module>``: a rewritten twin if it is twinned, the original module otherwise."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != TWIN_PACKAGE and not fullname.startswith(TWIN_PACKAGE + "."):
            return None
        relative = fullname[len(TWIN_PACKAGE) + 1 :]
        file = _module_path(relative)
        if file is None:
            return None
        # No search locations: every submodule of a twin comes through this finder, never from the directory.
        spec = importlib.util.spec_from_file_location(
            fullname, file, loader=self, submodule_search_locations=[] if file.name == "__init__.py" else None
        )
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        relative = module.__name__[len(TWIN_PACKAGE) + 1 :]
        if relative not in TWINNED:
            # The import system returns what the loader left in `sys.modules`: the shared original, one copy.
            sys.modules[module.__name__] = importlib.import_module(".".join(filter(None, [PACKAGE, relative])))
            return
        assert module.__file__ is not None
        source = rewrite(Path(module.__file__).read_text())
        exec(compile(source, module.__file__, "exec", dont_inherit=True), module.__dict__)


_FINDER = _TwinFinder()


def namespace_of(kind: type) -> str | None:
    """``"lightning.pytorch"``, ``"pytorch_lightning"``, or ``None``: the Lightning that ``kind``'s bases come from."""
    for klass in kind.__mro__:
        module = klass.__module__
        if module.startswith(tuple(RENAMES)):
            return LIGHTNING
        if module.startswith(tuple(RENAMES.values())):
            return PYTORCH_LIGHTNING
    return None


def twin_class(kind: type, namespace: str) -> type:
    """One of our classes as written for ``namespace``: itself, or its twin.

    Raises:
        ModuleNotFoundError: If ``namespace`` is ``pytorch_lightning`` and that distribution is not installed.
    """
    module = kind.__module__
    if namespace_of(kind) == namespace:
        return kind
    if module == TWIN_PACKAGE or module.startswith(TWIN_PACKAGE + "."):
        module = PACKAGE + module[len(TWIN_PACKAGE) :]
    else:
        install()
        module = TWIN_PACKAGE + module[len(PACKAGE) :]
    found: Any = importlib.import_module(module)
    for name in kind.__qualname__.split("."):
        found = getattr(found, name)
    return found


def install() -> None:
    """Put the twins' finder on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def pytorch_lightning_installed() -> bool:
    """Whether the optional ``pytorch-lightning`` distribution can be imported (without importing it)."""
    # `find_spec` answers `None` for a name set to `None` in `sys.modules` (how Python blocks an import).
    return importlib.util.find_spec(PYTORCH_LIGHTNING) is not None


# NOTE [ The twins load when pytorch_lightning does ]
# Importing `pytorch_lightning` changes a `lightning.pytorch` process: both set the one `lightning_utilities` rank-zero
# logger to their own, so Lightning's messages would go to `pytorch_lightning...` loggers and a user's settings of
# `logging.getLogger("lightning.pytorch")` would stop applying. So the twins load only where `pytorch_lightning` is
# imported already, else right after the user's own `import pytorch_lightning` (compat/import_hooks.py). The twins use
# the shared modules, which import `lightning.pytorch` for its exceptions: it is imported just before
# `pytorch_lightning`, so that `pytorch_lightning` sets the logger last, as it did when `import lightning_blockwise`
# imported `lightning.pytorch` itself (NOTE [ Registration waits for Lightning ] in compat/strategy_registry.py).
def load_twins_with_pytorch_lightning() -> None:
    """Load the twins now if ``pytorch_lightning`` is imported already, else right after it is (NOTE above)."""
    if pytorch_lightning_installed():
        install()  # `import lightning_blockwise.pl` works before `pytorch_lightning` is imported too
        when_imported(PYTORCH_LIGHTNING, load_twins, before=lambda: importlib.import_module(LIGHTNING))


def load_twins() -> ModuleType | None:
    """Load ``lightning_blockwise.pl`` where ``pytorch_lightning`` is installed.

    The twin package registers its strategy in ``pytorch_lightning``'s registry and pairs it with the original
    (:func:`pair`) as it runs; where it is being imported already (``import lightning_blockwise.pl``, which imports
    ``pytorch_lightning``), the half-made package is returned and finishes by itself.

    Returns:
        The twin package, or ``None`` without ``pytorch_lightning``.
    """
    if not pytorch_lightning_installed():
        return None
    install()
    try:
        return importlib.import_module(TWIN_PACKAGE)
    except ImportError as error:  # a broken optional install must not take lightning.pytorch users down with it
        warnings.warn(f"lightning-blockwise: `pytorch_lightning` is installed but not usable ({error})", stacklevel=2)
        return None


def pair() -> None:
    """Pair the twin strategy class with the original, from the twin package as it finishes loading.

    The connector's `isinstance(strategy, Strategy)` for an instance built from the original class (converted at its
    first write), and our own `isinstance(x, BlockwiseStrategy)` checks for the twin. One direction each: a pair of
    ABCs that register each other recurses forever on a negative check. It waits for both classes' modules (NOTE
    [ The twins load when pytorch_lightning does ]).
    """
    original, twin = f"{PACKAGE}.{STRATEGY_MODULE}", f"{TWIN_PACKAGE}.{STRATEGY_MODULE}"

    def pair_now() -> None:
        original_class, twin_class = (sys.modules[name].BlockwiseStrategy for name in (original, twin))
        lightning_base(twin_class).register(original_class)
        original_class.register(twin_class)

    when_imported(original, lambda: when_imported(twin, pair_now))


def lightning_base(kind: type) -> Any:
    """The nearest of ``kind``'s bases that is Lightning's own (``ParallelStrategy``, ``Callback``, ...)."""
    lightning = tuple(RENAMES) + tuple(RENAMES.values())
    return next(klass for klass in kind.__mro__ if klass.__module__.startswith(lightning))


class FollowsTrainer:
    """Mixin for our strategy and callbacks: built in one namespace, adopted by a Trainer of the other, it turns.

    It keeps the arguments an instance was built with, so that :func:`follow` can build it again as its twin in place
    (the same object: the Trainer and the user hold it). See NOTE [ Two Lightning namespaces ].
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """A new instance that remembers ``args`` and ``kwargs`` for its twin (``__init__`` runs as usual)."""
        instance = super().__new__(cls)
        instance.__dict__["_built_with"] = (args, kwargs)
        return instance


def follow(instance: FollowsTrainer, lightning_object: object) -> bool:
    """Turn ``instance`` into its twin if ``lightning_object`` (a Trainer, an accelerator) is of the other namespace.

    Args:
        instance: One of our strategies or callbacks.
        lightning_object: What the Trainer hands it first.

    Returns:
        Whether ``instance`` changed class (then the caller re-dispatches the hook it is in).
    """
    theirs, mine = namespace_of(type(lightning_object)), namespace_of(type(instance))
    if theirs is None or theirs == mine:
        return False
    twin = twin_class(type(instance), theirs)
    args, kwargs = instance.__dict__.get("_built_with", ((), {}))
    instance.__dict__.clear()
    instance.__class__ = twin
    instance.__dict__["_built_with"] = (args, kwargs)
    twin.__init__(instance, *args, **kwargs)  # type: ignore[misc]
    return True
