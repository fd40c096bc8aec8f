"""Lightning's fit-loop internals that the strategy reads and replaces, fenced in one module.

NOTE [ The fit loop's private state ] says which, why, and how a Lightning that changed them is caught.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

# NOTE [ The fit loop's private state ]
# Two features need what Lightning's fit loop keeps private: a resumed run's loader state restored late (NOTE [ Loader
# state restored late ] in checkpoint_hooks.py) and a block-major window's batches read ahead of the loop (NOTE [ A
# window's batches ] in accumulation.py). Every such read or write is a function here, named for what it does; nothing
# else in the package touches the fit loop's underscored names. They are Lightning 2.6's (pyproject.toml's tested
# range); `check_fit_loop` runs at setup and, where a Lightning outside that range lacks one of them, stops the run
# there, naming the version and the fix, instead of an AttributeError mid-epoch. tests/cli/test_resume.py and
# tests/replay/test_block_major.py exercise every function here against the installed Lightning.

#: The fit loop's private attributes used here (NOTE [ The fit loop's private state ]).
PRIVATE_NAMES = ("_data_fetcher", "_combined_loader", "_combined_loader_states_to_load", "_load_combined_loader_states")


class Lookahead(Iterator):
    """An iterator whose next items can be read ahead without being taken: what :func:`lookahead` installs.

    Args:
        iterator: The iterator read from.
        loader_state: The loaders' states now (Lightning's checkpoint entry), taken after each item read ahead.
    """

    def __init__(self, iterator: Iterator, loader_state: Callable[[], Any]) -> None:
        self.iterator = iterator
        self.loader_state = loader_state
        self.ahead: deque[Any] = deque()
        self._states: deque[Any] = deque()
        #: The loaders' state after the items taken so far: what a checkpoint records without the read-ahead.
        self.state_taken: Any = None

    def __next__(self) -> Any:
        if not self.ahead:
            return next(self.iterator)
        self.state_taken = self._states.popleft()
        return self.ahead.popleft()

    def peek(self, count: int) -> list[Any]:
        """Up to ``count`` next items (fewer where the iterator ends), still to be taken."""
        if not self.ahead:
            self.state_taken = self.loader_state()
        while len(self.ahead) < count:
            try:
                self.ahead.append(next(self.iterator))
            except StopIteration:
                break
            self._states.append(self.loader_state())
        return list(self.ahead)[:count]


def check_fit_loop(fit_loop: Any) -> None:
    """Refuse a fit loop without the private state this module reads (a Lightning outside the tested range).

    Raises:
        RuntimeError: Naming the missing attributes, the installed Lightning and the fix.
    """
    missing = [name for name in PRIVATE_NAMES if not hasattr(fit_loop, name)]
    if missing:
        raise RuntimeError(
            f"BlockwiseStrategy reads Lightning's fit loop state {missing} (NOTE [ The fit loop's private state ] in"
            f" strategy/fit_loop.py), which this Lightning ({_lightning_version()}) does not have. Install the"
            " Lightning it was tested with: `lightning-blockwise versions` prints the range."
        )


def data_fetcher(trainer: Any) -> Any:
    """The fit loop's data fetcher (``None`` before its loader is set up)."""
    return trainer.fit_loop._data_fetcher


def takes_dataloader_iter(fetcher: Any) -> bool:
    """Whether the ``training_step`` takes the ``dataloader_iter`` and fetches its own batches."""
    return isinstance(fetcher, _DataLoaderIterDataFetcher)


def lookahead(trainer: Any, fetcher: Any) -> Lookahead:
    """``fetcher``'s iterator as a :class:`Lookahead`, put in its place the first time (NOTE [ A window's batches ]).

    It takes the loaders' states as the fit loop writes them into a checkpoint (``FitLoop.on_save_checkpoint``).
    """
    if not isinstance(fetcher.iterator, Lookahead):
        loaders = trainer.fit_loop._combined_loader
        states = (lambda: loaders._state_dicts()) if loaders is not None else list
        fetcher.iterator = Lookahead(fetcher.iterator, states)
    return fetcher.iterator


def held_batches(fetcher: Any) -> list[Any]:
    """The items a prefetching fetcher (a loader without a length) holds already, in order."""
    return list(getattr(fetcher, "batches", []))


def before_transfer(module: Any, batch: Any) -> Any:
    """``batch`` through the module's and its data module's ``on_before_batch_transfer``, as the loop runs them."""
    return module._on_before_batch_transfer(batch, dataloader_idx=0)


def restore_loader_states(fit_loop: Any) -> None:
    """Hand a resumed run's loaders the state read after they were built, and iterate afresh under it."""
    if not fit_loop._combined_loader_states_to_load or fit_loop._combined_loader is None:
        return
    fit_loop._load_combined_loader_states()
    if fit_loop._data_fetcher is not None:
        # A stateful loader applies a loaded state when it is iterated next.
        fit_loop._data_fetcher.setup(fit_loop._combined_loader)
        iter(fit_loop._data_fetcher)


def restart_iterator(fit_loop: Any) -> None:
    """Make the loaders' iterator again, their samplers' epoch set first, as the next epoch would."""
    if fit_loop._data_fetcher is None:
        return
    for loader in fit_loop._combined_loader.flattened:
        _set_sampler_epoch(loader, fit_loop.epoch_progress.current.processed)
    iter(fit_loop._data_fetcher)


def _lightning_version() -> str:
    try:
        return f"lightning {metadata.version('lightning')}"
    except metadata.PackageNotFoundError:
        return "a Lightning without its distribution metadata"


__all__ = [
    "PRIVATE_NAMES",
    "Lookahead",
    "before_transfer",
    "check_fit_loop",
    "data_fetcher",
    "held_batches",
    "lookahead",
    "restart_iterator",
    "restore_loader_states",
    "takes_dataloader_iter",
]
