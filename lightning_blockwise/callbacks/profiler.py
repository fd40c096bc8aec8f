"""``BlockwiseProfiler``: VRAM, host-to-device traffic, copy stalls and throughput of a blockwise run.

A thin Lightning callback over :mod:`lightning_blockwise.profiling.trace` (marks and reads each
batch) and :mod:`lightning_blockwise.profiling.report` (aggregates, table, JSON, PNG).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override

from lightning_blockwise.compat.lightning_namespaces import FollowsTrainer, follow
from lightning_blockwise.profiling.report import Profile, draw_timeline, write_summary
from lightning_blockwise.profiling.trace import BatchTracer, Timeline
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy


def _input_ids_numel(batch: Any) -> int | None:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
    return ids.numel() if isinstance(ids, torch.Tensor) else None


class BlockwiseProfiler(FollowsTrainer, Callback):
    """Measures what streaming costs a run: VRAM, host-to-device traffic, copy stalls, step time, tokens/s.

    Every ``log_every_n_steps`` optimizer steps (the Trainer's), the profiler logs to the
    Trainer's loggers the aggregates over the training batches since its last log. A *step*
    here is one training batch (with gradient accumulation, a micro-batch; the optimizer step
    falls in the last one), timed from ``on_train_batch_start`` to ``on_train_batch_end``.
    Keys (those a device or strategy lacks are not logged):

    - ``blockwise/step_time_s``: mean time of a batch (CUDA events on the compute stream; host clock on the CPU).
    - ``blockwise/tokens_per_s``: mean tokens per batch over mean batch time. Tokens are
      ``batch["input_ids"].numel()``, padding included (no device sync), unless ``count_tokens`` is given.
    - ``blockwise/h2d_bytes_per_step``: mean bytes copied from the host arena to the device slots per batch,
      counted where the copies are issued. Needs ``strategy="blockwise"``.
    - ``blockwise/h2d_s_per_step``: mean time the copy stream spent copying per batch (on the CPU: the
      synchronous copies, host clock).
    - ``blockwise/h2d_gb_per_s``: achieved copy bandwidth, ``h2d_bytes_per_step / h2d_s_per_step`` in GB/s.
    - ``blockwise/wait_s_per_step``: mean time per batch the compute stream stood waiting for copies
      (CUDA only): the part of the traffic that did not hide under compute.
    - ``blockwise/wait_fraction``: ``wait_s_per_step / step_time_s`` (CUDA only).
    - ``blockwise/peak_allocated_bytes``, ``blockwise/peak_reserved_bytes``: the largest per-batch peak of
      ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (CUDA only; the profiler resets the peak
      counters at every batch start).

    At the end of fit it prints the same numbers over the whole fit as a table (the first batch,
    which fills the slots and warms up the allocator, is reported apart when there are more)
    and writes them as JSON to ``blockwise_profile.json`` in ``dirpath``. With ``timeline`` it
    also draws one batch as ``blockwise_timeline.png``: the copy lane against the compute lane,
    one bar per block, so you can see whether the transfers hide under compute.

    Timing reads CUDA events lazily and synchronizes only once per logged step (NOTE [ Profiler
    timing ] in profiling/trace.py); the profiler changes neither the computation nor the data
    the run sees. The strategy hands its observer to every streamer it builds
    (:meth:`~lightning_blockwise.BlockwiseStrategy.set_observer`), so the profiler sets it once
    per fit. The measuring is done by :mod:`lightning_blockwise.profiling.trace` and
    :mod:`lightning_blockwise.profiling.report`.

    Args:
        timeline: ``True`` draws the last batch of the fit; an ``int`` draws that training batch
            (counted from 0 in this fit); ``False`` draws nothing.
        dirpath: Where the JSON and PNG go. Defaults to ``trainer.log_dir`` (the default root dir without a logger).
        count_tokens: Tokens in a batch, if ``input_ids.numel()`` is not what you want (e.g.
            ``lambda batch: int(batch["attention_mask"].sum())``, at the price of a device sync per batch).

    Raises:
        MisconfigurationException: If ``timeline`` is a negative index.

    Example::

        from lightning_blockwise import BlockwiseProfiler

        trainer = Trainer(strategy="blockwise", accelerator="gpu", callbacks=[BlockwiseProfiler(timeline=True)])
        trainer.fit(module)  # logs blockwise/..., prints the summary, writes the JSON and the PNG
    """

    def __init__(
        self,
        timeline: bool | int = False,
        dirpath: str | Path | None = None,
        count_tokens: Callable[[Any], int | None] | None = None,
    ) -> None:
        if not isinstance(timeline, bool) and timeline < 0:
            raise MisconfigurationException(
                f"`BlockwiseProfiler(timeline={timeline})` must be True, False or the index of a training batch (>= 0)."
            )
        self.timeline = timeline
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.count_tokens = count_tokens or _input_ids_numel
        self.summary: dict[str, Any] = {}
        self._device = torch.device("cpu")
        self._tracer = BatchTracer(self._device)
        self._profile = Profile()
        self._strategy: BlockwiseStrategy | None = None
        self._step_at_start = 0
        self._drawn: Timeline | None = None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # The first hook a Trainer calls: one of the other Lightning namespace makes this callback its twin here
        # (NOTE [ Two Lightning namespaces ] in compat/lightning_namespaces.py).
        follow(self, trainer)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        self._device = strategy.root_device
        self._strategy = strategy if isinstance(strategy, BlockwiseStrategy) else None
        if self._strategy is None:
            self._tracer = BatchTracer(self._device)
            rank_zero_warn(
                "BlockwiseProfiler: the strategy does not stream weights, so only step time, tokens/s and VRAM are"
                " reported. Use `Trainer(strategy='blockwise')` to profile host-to-device traffic."
            )
        else:
            assert self._strategy.plan is not None
            self._tracer = BatchTracer(self._device, block_of=self._strategy.plan.block_of)
            # Once per fit: the strategy hands it to every streamer it builds (a parity check builds some).
            self._strategy.set_observer(self._tracer.trace)
        self._profile = Profile(streaming=self._strategy is not None, cuda=self._device.type == "cuda")
        self._drawn = None

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_start = trainer.global_step
        self._tracer.start_batch(self.count_tokens(batch))

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._tracer.end_batch()
        every = trainer.log_every_n_steps
        stepped = trainer.global_step != self._step_at_start
        if every > 0 and stepped and trainer.global_step % every == 0:
            self._read(wait=True)
            metrics = self._profile.compute_interval()
            # float64 host tensors: Lightning would store plain floats as float32, which rounds byte counts.
            logged = {f"blockwise/{k}": torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}
            pl_module.log_dict(logged, on_step=True, on_epoch=False)
        else:
            self._read(wait=False)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._read(wait=True)
        self._detach()
        streamer = None if self._strategy is None else self._strategy.streamer
        self.summary = self._profile.summary(self._device, self._tracer.batches, streamer)
        self._write(self._dirpath(trainer))

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        """Give the strategy the no-op observer back, unless another observer replaced the profiler's."""
        if self._strategy is not None and self._strategy.observer is self._tracer.trace:
            self._strategy.set_observer(None)

    def _read(self, wait: bool) -> None:
        """Aggregate the batches whose timings are ready, oldest first; with ``wait``, all of them."""
        for timeline, values in self._tracer.read(wait):
            self._profile.update(timeline.index, values)
            if self.timeline is True or (self.timeline is not False and timeline.index == self.timeline):
                self._drawn = timeline

    def _dirpath(self, trainer: Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        return Path(trainer.log_dir or trainer.default_root_dir)

    @rank_zero_only
    def _write(self, dirpath: Path) -> None:
        write_summary(self.summary, dirpath)
        if self.timeline is not False:
            if self._drawn is None:
                rank_zero_warn(
                    f"BlockwiseProfiler(timeline={self.timeline}): the fit ran {self._tracer.batches} training"
                    " batches, so there was no such batch to draw. Pass an index below that."
                )
            else:
                draw_timeline(self._drawn, dirpath / "blockwise_timeline.png", self._device)


__all__ = ["BlockwiseProfiler"]
