"""The base of ``BlockwiseStrategy`` that owns its run: what callbacks ask of the strategy, answered from the run.

A read-only surface (and two context managers) over the run the strategy builds at setup, so that callbacks such
as ``ParityCheck`` and ``BlockwiseProfiler`` never reach into its internals (issue 11).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from lightning_blockwise.planning import ResidencyPlan
from lightning_blockwise.planning.step_plan import StepPlan
from lightning_blockwise.residency.activations import ActivationOffload
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.placement import HostCopy
from lightning_blockwise.residency.stream_observer import StreamObserver
from lightning_blockwise.residency.streamer import BlockStreamer
from lightning_blockwise.strategy.data_parallel import DataParallelStrategy
from lightning_blockwise.strategy.module_budget import reference_headroom
from lightning_blockwise.strategy.options import BlockwiseOptions
from lightning_blockwise.strategy.run import BlockwiseRun
from lightning_blockwise.strategy.step_planner import StepPlanner


class BlockwiseQueries(DataParallelStrategy):
    """A data-parallel strategy that owns a blockwise run and answers its callbacks from it.

    :class:`~lightning_blockwise.BlockwiseStrategy` builds the run at setup and closes it at
    teardown; what it keeps between runs lives here too: the decoder stack's blocks, the host copy (it lives with
    the module) and the observer its streamers report to.

    Args:
        options: The user's options, checked.
        kwargs: :class:`~lightning_blockwise.strategy.data_parallel.DataParallelStrategy`'s arguments.
    """

    def __init__(self, options: BlockwiseOptions, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: The user's options, checked (:class:`~lightning_blockwise.strategy.options.BlockwiseOptions`).
        self.options = options
        #: The decoder stack's blocks, set at setup.
        self.plan: BlockPlan | None = None
        # The run set up for the Trainer function in progress; `None` before setup and after teardown.
        self._run: BlockwiseRun | None = None
        # The latest run's planner, kept after teardown as the host copy is: its plans stay what it planned.
        self._planner: StepPlanner | None = None
        self._host_copy: HostCopy | None = None
        self._observer = StreamObserver()

    @property
    def planned_budget(self) -> int | None:
        """The budget the run plans for: the user's ``vram_budget``, or the card's measured at setup, else ``None``."""
        return self._run.budget if self._run is not None else self.options.vram_budget

    @property
    def streamer(self) -> BlockStreamer | None:
        """The streamer feeding the decoder layers now (replaced at times: :meth:`set_observer`)."""
        return None if self._run is None else self._run.layers.streamer

    @property
    def layers(self) -> list[torch.nn.Module]:
        """The rematerialized decoder layers, in order (empty before setup and after teardown)."""
        return [] if self._run is None else self._run.layers.layers

    @property
    def activation_offload(self) -> ActivationOffload | None:
        """Where layer inputs wait for the backward when offloaded (NOTE [ Layer-input offload ]), else ``None``."""
        return None if self._run is None else self._run.layers.offload

    @property
    def host_copy(self) -> HostCopy | None:
        """The module's host arena and block layouts (kept after teardown: the arena lives with the module)."""
        return self._host_copy

    @property
    def step_plan(self) -> StepPlan | None:
        """The plan of a training step for the longest micro-batch planned for so far (``None`` before setup)."""
        return None if self._planner is None else self._planner.plan

    @property
    def residency_plan(self) -> ResidencyPlan | None:
        """Which blocks stay resident and the predicted peak, for the longest micro-batch planned for so far."""
        return None if self.step_plan is None else self.step_plan.residency

    def resident_prefix_bytes(self, num_blocks: int) -> int:
        """Device bytes that running the first ``num_blocks`` blocks resident needs beyond the run's planned peak.

        The slabs of those blocks not resident already plus one layer's autograd graph per layer at the planned
        tokens (:meth:`~lightning_blockwise.strategy.streamed_stack.StreamedStack.prefix_bytes`), in the planner's
        terms.

        Args:
            num_blocks: Leading blocks run resident, from ``0`` to ``plan.num_blocks``.
        """
        assert self._run is not None
        return self._run.planner.resident_prefix_bytes(num_blocks)

    def reference_headroom(self) -> int | None:
        """Device bytes a resident reference step may take now beyond the run's planned peak (``None``: no limit).

        What ``vram_budget``, the free device memory and a per-process cap leave
        (:func:`~lightning_blockwise.strategy.module_budget.reference_headroom`). Compare it with
        :meth:`resident_prefix_bytes` to see how many blocks fit.
        """
        assert self.residency_plan is not None
        return reference_headroom(self.root_device, self.planned_budget, self.residency_plan.predicted_peak)

    @property
    def observer(self) -> StreamObserver:
        """What every streamer of this strategy reports its copies, waits and layer runs to (:meth:`set_observer`)."""
        return self._observer

    def set_observer(self, observer: StreamObserver | None) -> None:
        """Hand ``observer`` to the current streamer and to every streamer the strategy builds later.

        The strategy replaces its streamer at times (:meth:`resident_prefix`, loading a checkpoint with the frozen
        base); each new one reports to the observer set here, so it is set once (NOTE [ Stream observer ] in
        residency/streamer.py).

        Args:
            observer: The observer, or ``None`` for the no-op
                :class:`~lightning_blockwise.residency.stream_observer.StreamObserver`.

        Example::

            strategy.set_observer(trace)  # in on_train_start
            strategy.set_observer(None)  # in on_train_end
        """
        self._observer = StreamObserver() if observer is None else observer
        if self._run is not None:
            self._run.layers.set_observer(self._observer)

    @contextmanager
    def resident_prefix(self, num_blocks: int) -> Iterator[None]:
        """Run the layers of the first ``num_blocks`` blocks the resident way while the context is open.

        Inside, those layers have their own forward back (plain autograd, no recompute) and read their frozen
        tensors from device copies of their host slabs; the other layers stay rematerialized and streamed.
        ``num_blocks=plan.num_blocks`` is resident training of the whole stack. On exit a fresh streamer of the
        run's residency plan takes over, reporting to :attr:`observer` (NOTE [ Resident prefix ] in
        streamed_stack.py); the host arena is never written, so what the run computes afterwards is unchanged.

        Args:
            num_blocks: Leading blocks to run resident, from ``0`` to ``plan.num_blocks``.

        Raises:
            ValueError: If ``num_blocks`` is out of range.

        Example::

            with strategy.resident_prefix(strategy.plan.num_blocks):
                loss = module.training_step(batch, 0)  # as under strategy="auto"
                loss.backward()
        """
        assert self._run is not None
        # NOTE [ Resident prefix ] in streamed_stack.py. Steps run inside are not the run's: the planner sits out.
        with self._run.layers.resident_prefix(num_blocks), self._planner_paused():
            yield

    @contextmanager
    def all_rematerialized(self) -> Iterator[None]:
        """Rematerialize every layer while the context is open, those of blocks that keep their activations too.

        What ``ParityCheck``'s blockwise arm runs (NOTE [ Kept activations ] in planning/memory.py).
        """
        assert self._run is not None
        with self._run.layers.all_rematerialized(), self._planner_paused():
            yield

    def _planner_paused(self) -> AbstractContextManager[None]:
        return self._run.planner.paused() if self._run is not None else nullcontext()


__all__ = ["BlockwiseQueries"]
