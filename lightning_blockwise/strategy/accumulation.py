"""The strategy's side of block-major gradient accumulation: a window's batches read ahead of Lightning's loop."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_blockwise.architectures import DecoderStack
from lightning_blockwise.replay.block_major import Window
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.replay.window_forward import unwrap, wrap
from lightning_blockwise.replay.window_refusals import WindowError
from lightning_blockwise.replay.window_workers import Workers
from lightning_blockwise.strategy.batch_comparison import batches_differ, clone_batch
from lightning_blockwise.strategy.fit_loop import (
    Lookahead,
    before_transfer,
    data_fetcher,
    held_batches,
    lookahead,
    takes_dataloader_iter,
)

# NOTE [ A window's batches ]
# A window's micro-batches must all be at hand when its first one is due (NOTE [ Block-major
# accumulation ] in replay/block_major.py). The strategy reads them ahead from the iterator
# inside Lightning's data fetcher, through a wrapper that keeps what it read and hands it to
# the fetcher when the loop asks, in order: the fetcher counts and finishes its batches as
# without it, and the loop sees the same batches at the same indices. What the loop does to a
# batch before `training_step` (`convert_input`, `on_before_batch_transfer`, `batch_to_device`
# with `transfer_batch_to_device` and `on_after_batch_transfer`) the strategy does to the ones
# it reads ahead, so those hooks run twice for micro-batches 1..G-1 of a window (once when read
# ahead, once when the loop reaches them), and when the loop hands micro-batch k to
# `training_step`, it is compared with the one read ahead (bit for bit; on a GPU the results are
# read once per window, before the optimizer step, not per micro-batch): a hook that
# transforms at random is refused there (the batches read ahead are transformed from copies, so
# a hook that works in place does not run twice on the loop's tensors). A checkpoint written
# inside a window records the loaders' state as of the batches the loop has taken, not past the
# ones read ahead, so a resume from it skips nothing (it runs the rest of that window the usual
# way). A window ends where Lightning's accumulation ends it: after `accumulate_grad_batches`
# batches or at the epoch's last batch.


def refuse_unsupported(module: LightningModule, stack: DecoderStack) -> None:
    """Refuse what block-major accumulation cannot run exactly, at setup (before any model work).

    Several processes are fine: NOTE [ Block-major windows on several ranks ] in replay/window_backward.py.

    Raises:
        MisconfigurationException: With manual optimization, or dropout in the decoder layers.
    """
    prefix = "`BlockwiseStrategy(block_major_accumulation=True)`"
    if not module.automatic_optimization:
        raise MisconfigurationException(
            f"{prefix} needs Lightning's automatic optimization (it follows `accumulate_grad_batches`); this module"
            " sets `automatic_optimization = False`."
        )
    dropout = [m.p for layer in stack.layers for m in layer.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    config_dropout = getattr(stack.model.config, "attention_dropout", 0.0) or 0.0
    if dropout or config_dropout > 0:
        p = dropout[0] if dropout else config_dropout
        raise MisconfigurationException(
            f"{prefix}: the decoder layers apply dropout (p={p}). Block-major accumulation runs a window's"
            " micro-batches layer by layer, which changes the order of their random numbers, so it would not be"
            " exact; set the adapters' `lora_dropout` (and the model's attention dropout) to 0, or set"
            " `block_major_accumulation=False`."
        )


def _read_like_the_loop(strategy: Strategy, batch: Any) -> Any:
    """What Lightning's training loop makes of a batch before ``training_step`` (NOTE [ A window's batches ])."""
    module = strategy.lightning_module
    batch = module.trainer.precision_plugin.convert_input(batch)
    batch = before_transfer(module, batch)
    return strategy.batch_to_device(batch, dataloader_idx=0)


def planned_window(trainer: Trainer) -> int:
    """The largest ``accumulate_grad_batches`` of the run: the Trainer's, or a ``GradientAccumulationScheduler``'s."""
    schedules = [
        max(callback.scheduling.values())
        for callback in trainer.callbacks
        if isinstance(callback, GradientAccumulationScheduler)
    ]
    return max([trainer.accumulate_grad_batches, *schedules])


class BlockMajorSteps:
    """Runs Lightning's training steps in block-major windows (NOTE [ A window's batches ]).

    While a window is open, each decoder layer's forward is wrapped by the window's own
    (:class:`~lightning_blockwise.replay.window_forward.WindowForward`); outside windows the layers run as
    without block-major accumulation.

    Args:
        window: The ``accumulate_grad_batches`` planned for at setup (the largest window allowed).
        layers: The decoder layers, their rematerializing forward installed before a window opens.
        device: The compute device.
    """

    def __init__(self, window: int, layers: Sequence[nn.Module], device: torch.device) -> None:
        self.window = window
        self.layers = list(layers)
        self.num_layers = len(self.layers)
        self.device = device
        self._current: Window | None = None
        self._workers: Workers | None = None
        self._lookahead: Lookahead | None = None
        #: Device-side comparisons of the loop's batches with those read ahead, not read yet: (batch index, flag).
        self._unchecked: list[tuple[int, Tensor]] = []
        self._batches: list[Any] = []

    def training_step(
        self,
        strategy: Strategy,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run: Callable[..., Any],
        see_batch: Callable[[Any], None],
    ) -> Any:
        """Micro-batch ``args[0]``'s training step: starts a window at its first micro-batch, answers from it after.

        Args:
            strategy: The strategy (its trainer, module, precision and ``batch_to_device``).
            args: The loop's ``training_step`` arguments (the batch, and its index if the step takes one).
            kwargs: Keyword arguments (Lightning passes none).
            run: The strategy's own ``training_step`` for one micro-batch's arguments.
            see_batch: Plans for a batch before it runs (NOTE [ A budget that sees the batches ]).

        Raises:
            MisconfigurationException: If called with keyword arguments, or ``accumulate_grad_batches`` grew past
                the planned window.
            WindowError: If the loop's batch differs from the one read ahead for it.
        """
        if kwargs or not args:
            raise MisconfigurationException(
                "`BlockwiseStrategy(block_major_accumulation=True)` takes the batch as `training_step`'s first"
                " positional argument, as Lightning's loop passes it."
            )
        trainer = strategy.lightning_module.trainer
        epoch_loop = trainer.fit_loop.epoch_loop
        ready = epoch_loop.batch_progress.current.ready  # this batch included
        accumulate = trainer.accumulate_grad_batches
        if accumulate > self.window:
            raise MisconfigurationException(
                f"`BlockwiseStrategy(block_major_accumulation=True)` planned device memory for windows of"
                f" {self.window} micro-batches (`accumulate_grad_batches` at setup), now {accumulate}. Set the largest"
                " `accumulate_grad_batches` on the Trainer, or turn block-major accumulation off."
            )
        position = (ready - 1) % accumulate
        if position == 0:
            self._close_window()
            remaining = trainer.num_training_batches - ready
            count = int(min(accumulate, 1 + remaining))
            if count > 1:
                rng = RngSnapshot.capture(self.device)
                # Copies: a hook that works in place must not run twice on the tensors the loop gets.
                ahead = [_read_like_the_loop(strategy, clone_batch(item[0])) for item in self._peek(trainer, count - 1)]
                drew_ahead = not rng.unchanged()
                batches = [args[0], *ahead]
                if len(batches) > 1:
                    for batch in batches:
                        see_batch(batch)
                    # NOTE [ Block-major windows on several ranks ] in replay/window_backward.py.
                    reduced = isinstance(strategy.model, DistributedDataParallel)
                    return self._open(batches, args, run, drew_ahead, reduced)
            see_batch(args[0])
            return run(*args)
        window = self._current
        if window is None or position >= window.count:
            # No window covers this batch (a resume that starts inside one): the usual step, exact as well.
            see_batch(args[0])
            return run(*args)
        differs = batches_differ(args[0], self._batches[position])
        if differs is True:
            raise WindowError(_differs_message(ready - 1))
        if isinstance(differs, Tensor):
            # On the device: read once per window, before the optimizer step (`check_batches`), not per micro-batch.
            self._unchecked.append((ready - 1, differs))
        return window.result(position)

    def closure_then_window(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """``closure`` (the last micro-batch's step and backward), then the window's backward if it did not run.

        Where the last micro-batch returned ``None`` Lightning runs no backward for it; the window's backward still
        has to run before the optimizer steps.
        """

        def wrapped() -> Any:
            result = closure()
            self.finish()
            self.check_batches()
            return result

        return wrapped

    def check_batches(self) -> None:
        """Raise if a batch compared on the device differed from the one read ahead (one synchronization).

        Raises:
            WindowError: Naming the first such batch.
        """
        if not self._unchecked:
            return
        indices, flags = zip(*self._unchecked, strict=True)
        self._unchecked = []
        for index, flag in zip(indices, torch.stack(flags).tolist(), strict=True):
            if flag:
                raise WindowError(_differs_message(index))

    def finish(self) -> None:
        """Run the open window's backward if its last micro-batch's did not (Lightning's optimizer step is next)."""
        if self._current is not None:
            self._current.backward()

    def close(self) -> None:
        """Abandon the open window (its micro-batches unwind) and stop the worker threads."""
        self._close_window()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def checkpoint_loader_state(self, checkpoint: dict[str, Any]) -> None:
        """Record in ``checkpoint`` the loaders' state without the batches read ahead (NOTE [ A window's batches ]).

        A checkpoint written inside a window (after a validation, a timed one, a resumed run's first batch)
        would otherwise record the loaders past the batches read ahead, and a resume from it would skip them.
        """
        ahead = self._lookahead
        loop_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if ahead is not None and ahead.ahead and "combined_loader" in loop_state:
            loop_state["combined_loader"] = ahead.state_taken

    def _open(
        self, batches: list[Any], args: tuple[Any, ...], run: Callable[..., Any], drew_ahead: bool, reduced: bool
    ) -> Any:
        window = Window(len(batches), self.num_layers, self.device, hooks_once=reduced)
        window.drew_ahead = drew_ahead

        def step(k: int) -> Any:
            step_args = (batches[k], args[1] + k, *args[2:]) if len(args) > 1 else (batches[k],)
            return run(*step_args)

        self._current, self._batches = window, batches
        if self._workers is None:
            self._workers = Workers(self.window, self.device)
        wrap(self.layers)
        window.start(step, self._workers)
        return window.result(0)

    def _close_window(self) -> None:
        self._unchecked = []
        if self._current is not None:
            self._current.abort()
            self._current, self._batches = None, []
        unwrap(self.layers)

    def _peek(self, trainer: Trainer, count: int) -> list[Any]:
        """The next ``count`` items of the loop's data fetcher (fewer at the end), not taken from it."""
        # NOTE [ The fit loop's private state ] in fit_loop.py.
        fetcher = data_fetcher(trainer)
        if takes_dataloader_iter(fetcher):
            raise MisconfigurationException(
                "`BlockwiseStrategy(block_major_accumulation=True)` reads a window's batches ahead of the loop; a"
                " `training_step` that takes the `dataloader_iter` fetches its own. Take `batch` instead, or set"
                " `block_major_accumulation=False`."
            )
        assert fetcher is not None and fetcher.iterator is not None
        self._lookahead = ahead = lookahead(trainer, fetcher)
        held = held_batches(fetcher)[:count]
        return held + ahead.peek(count - len(held))


def _differs_message(index: int) -> str:
    return (
        f"BlockwiseStrategy(block_major_accumulation=True): batch {index} of this epoch differs from the one read ahead"
        " for it (NOTE [ A window's batches ]): a batch transfer hook (`on_before_batch_transfer`,"
        " `transfer_batch_to_device`, `on_after_batch_transfer`) that is not deterministic, or an"
        " `on_train_batch_start` hook that changes the batch. Make it deterministic and leave the batch unchanged,"
        " or set `block_major_accumulation=False`."
    )


__all__ = [
    "BlockMajorSteps",
    "planned_window",
    "refuse_unsupported",
]
