"""The long-lived threads that run a block-major window's micro-batches, one thread each."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


class Workers:
    """Long-lived threads that run a window's micro-batches, one each, for the whole run.

    Threads made per window would each take fresh per-thread CUDA library state (cuBLAS handles)
    every window; these keep theirs.

    Args:
        count: Threads (the largest window).
        device: The compute device, made current in each thread.
    """

    def __init__(self, count: int, device: torch.device) -> None:
        self._queues: list[queue.SimpleQueue[Callable[[], None] | None]] = [queue.SimpleQueue() for _ in range(count)]
        self._threads = [
            threading.Thread(target=self._serve, args=(jobs, device), name=f"block-major-{k}", daemon=True)
            for k, jobs in enumerate(self._queues)
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Callable[[], None] | None], device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        while (job := jobs.get()) is not None:
            job()

    def submit(self, k: int, job: Callable[[], None]) -> None:
        """Run ``job`` on thread ``k`` (after its earlier jobs)."""
        self._queues[k].put(job)

    def close(self) -> None:
        """Stop the threads once their jobs are done."""
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join()


__all__ = ["Workers"]
