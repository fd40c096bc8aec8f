"""Objects of the other Lightning namespace than the Trainer's, refused in one line before any work."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_blockwise.compat.lightning_namespaces import (
    LIGHTNING,
    PACKAGE,
    TWIN_PACKAGE,
    FollowsTrainer,
    lightning_base,
    namespace_of,
)

_STYLE = {LIGHTNING: "import lightning.pytorch as pl", "pytorch_lightning": "import pytorch_lightning as pl"}


def mixed_namespace_error(trainer: Trainer, objects: Iterable[object]) -> MisconfigurationException | None:
    """The refusal for the first of ``objects`` built on the other Lightning namespace than ``trainer``'s, if any.

    Our strategy and callbacks are not among them: they turn into their twins (NOTE [ Two Lightning namespaces ] in
    compat/lightning_namespaces.py). A LightningModule, data module, callback or logger cannot: Lightning tests
    their types or relies on their roles.

    Args:
        trainer: The Trainer about to run.
        objects: What it runs with: the function's arguments, its callbacks, loggers and the strategy's plugins.

    Returns:
        The exception to raise, or ``None`` when every object is of ``trainer``'s namespace or of neither.
    """
    expected = namespace_of(type(trainer))
    for candidate in objects:
        found = namespace_of(type(candidate))
        if found is None or found == expected or isinstance(candidate, FollowsTrainer):
            continue
        kind = type(candidate)
        role = lightning_base(kind).__name__
        where = f"`{kind.__qualname__}` ({kind.__module__}) is a `{found}` {role}, but the Trainer is a"
        where += f" `{expected}.Trainer`, which cannot run it."
        if kind.__module__.split(".")[0] == PACKAGE:
            ours = kind.__module__[len(TWIN_PACKAGE) :] if kind.__module__.startswith(TWIN_PACKAGE) else None
            module = PACKAGE + ours if ours is not None else TWIN_PACKAGE + kind.__module__[len(PACKAGE) :]
            fix = f"Import it for this Trainer: `from {module} import {kind.__qualname__}`."
        else:
            fix = f"Use one Lightning namespace throughout: `{_STYLE[expected or LIGHTNING]}` for every import."
        return MisconfigurationException(f"{where} {fix}")
    return None


def _objects(trainer: Trainer | None, strategy: Strategy, arguments: Iterable[object]) -> list[object]:
    found = list(arguments)
    if trainer is not None:
        found += [*trainer.callbacks, *trainer.loggers]
    plugins = ("_accelerator", "_precision_plugin", "_checkpoint_io", "cluster_environment")
    return found + [getattr(strategy, name, None) for name in plugins]


class _InProcessLauncher(_Launcher):
    """Runs the Trainer's function in this process, as with no launcher, after the namespace check."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        refuse_mixed_namespaces(trainer, self._strategy, (*args, *kwargs.values()))
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: no process was started."""


def refuse_mixed_namespaces(trainer: Trainer | None, strategy: Strategy, arguments: Iterable[object]) -> None:
    """Raise the refusal of :func:`mixed_namespace_error` for a Trainer function's arguments, if any.

    Raises:
        MisconfigurationException: If one of them is of the other Lightning namespace than the Trainer's.
    """
    if trainer is not None and (error := mixed_namespace_error(trainer, _objects(trainer, strategy, arguments))):
        raise error


def checking_launcher(strategy: Strategy, launcher: _Launcher | None) -> _Launcher:
    """``launcher`` (or an in-process one) that checks namespaces before it runs a Trainer function.

    The launcher is the first hook a Trainer function reaches with its arguments (data module, loaders), callbacks
    and loggers in place, before any work. (``Trainer.fit`` tests the module's own type earlier, with Lightning's
    ``TypeError``.) An existing launcher is wrapped on the instance, its class untouched (Lightning tests
    launchers' types).
    """
    if launcher is None:
        return _InProcessLauncher(strategy)
    launch = launcher.launch

    def checked(function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        refuse_mixed_namespaces(trainer, strategy, (*args, *kwargs.values()))
        return launch(function, *args, trainer=trainer, **kwargs)

    launcher.launch = checked  # type: ignore[method-assign]
    return launcher
