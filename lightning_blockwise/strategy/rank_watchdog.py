"""A dead rank ends the run in seconds, naming itself, instead of a collective's 30-minute timeout."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed

from lightning_blockwise.compat.processes import host_name, process_running

log = logging.getLogger(__name__)

# NOTE [ A dead rank ends the run ]
# A rank killed mid-step (SIGKILL, the kernel's OOM killer, a lost node) leaves the others blocked in a collective
# (DDP's all-reduce in the backward) until the process group's timeout, 30 minutes by default, and then fails with
# an NCCL message that does not say which rank is gone. Meanwhile the shared host copy (one per machine) and the
# GPUs stay taken. So each process of a data-parallel run starts a watchdog thread once the process group exists:
# it learns every rank's host and process id (one `all_gather_object` at setup) and checks, every `interval`
# seconds, that the ranks on its own host are still alive. A rank that ends its run normally first says so in the
# process group's store (`done`), so its exit is not taken for a death; the store's own host (rank 0) waits for the
# others' `done` before it may exit, so a rank that finishes a little later can still read it.
#
# When a peer is gone without `done`, the watchdog logs which rank (process id, host) died, that this rank stops
# because of it, and how to resume, then ends this process with exit status 1. It cannot unblock the collective
# the main thread is waiting in (NCCL offers no safe cancel from another thread), and a process exit is what
# returns the GPU, the pinned registration and this rank's mappings of the shared host copy to the machine; the
# copy's memory is freed when its last process is gone.
#
# NOTE [ Per host, and global ]
# What a host owns is watched per host, keyed by `host_name()` (NOTE [ Simulated hosts ] in compat/processes.py),
# never by the global rank: each node's watchdog watches that node's ranks, whose process ids it can check. Ranks on
# other hosts are not watched (their process ids mean nothing here): a dead rank there ends this one when the
# collective fails, at the process group's timeout (NCCL) or as soon as its connection closes (gloo). What a rank
# then says (`RankWatchdog.remote_failure`) names the other hosts' ranks and that one of them stopped, since no rank
# of this host did. What is global stays global: the process group, its store (the `done` keys below, on rank 0's
# host), DDP's all-reduce and the sampler's shards.

#: Seconds between two checks of the peers.
INTERVAL = 1.0
#: The longest a failed collective waits for a dead rank of this host to show (`RankWatchdog.local_failure`).
LOCAL_DEATH_WAIT_S = 5.0
#: Seconds the store's host waits at the end for the other ranks to say they are done, without a group timeout.
DONE_TIMEOUT = 1800.0


@dataclass(frozen=True)
class Peer:
    """One rank of the run: where it runs."""

    rank: int
    host: str
    pid: int


class RankWatchdog:
    """Watches the other ranks on this host and ends this process when one dies (NOTE [ A dead rank ends the run ]).

    Args:
        timeout: The process group's timeout, for the message (what the run would otherwise have waited).
        interval: Seconds between two checks.
    """

    #: Watchdogs made in this process so far: each run's `done` keys are its own (a fit, then a validate).
    _runs = 0

    def __init__(self, timeout: timedelta | None, interval: float = INTERVAL) -> None:
        RankWatchdog._runs += 1
        self.run = RankWatchdog._runs
        self.timeout = timeout
        self.interval = interval
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.here = Peer(self.rank, host_name(), os.getpid())
        everyone: list[Peer | None] = [None] * self.world_size
        torch.distributed.all_gather_object(everyone, self.here)
        self.peers, self.remote = split_by_host([p for p in everyone if p is not None], self.here)
        self._store = torch.distributed.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="blockwise-rank-watchdog", daemon=True)
        self._thread.start()

    def _done_key(self, rank: int) -> str:
        return f"lightning_blockwise/done/{self.run}/{rank}"

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            for peer in self.peers:
                if not process_running(peer.pid) and not self._finished(peer) and not self._stop.is_set():
                    self._end(peer)

    def _finished(self, peer: Peer) -> bool:
        """Whether ``peer`` said it ended its run normally (unknown, e.g. the store's host is gone: it did not)."""
        try:
            return self._store.check([self._done_key(peer.rank)])
        except Exception:  # the store's host is gone, or the store is closed: no word from the peer
            return False

    def _end(self, peer: Peer) -> None:
        if self._stop.is_set():
            return  # this rank ended its run while the check ran: nothing waits on the peer any more
        message = self._death_message(peer)
        log.error(message)
        print(message, file=sys.stderr, flush=True)
        os._exit(1)

    def _death_message(self, peer: Peer) -> str:
        waited = f"the process group's timeout ({self.timeout})" if self.timeout else "the process group's timeout"
        return (
            f"BlockwiseStrategy: rank {peer.rank} (process {peer.pid} on {peer.host}) died during training, so rank"
            f" {self.rank} (process {os.getpid()}) ends too, instead of waiting in a collective for {waited}. Find"
            f" why rank {peer.rank} stopped (killed, out of memory), then resume the run from its last checkpoint"
            " (`trainer.fit(..., ckpt_path=...)` or `--ckpt_path`)."
        )

    def local_failure(self, error: BaseException) -> str | None:
        """The watchdog's own message when a collective failed because a rank of this host died; else ``None``.

        gloo sees a dead peer's closed connection within milliseconds, before the watchdog's next check (every
        ``interval`` seconds), so the collective's error reaches Lightning first and would be all the user reads.
        The peers are looked at here for up to two intervals (at most ``LOCAL_DEATH_WAIT_S``): a killed process is
        not always gone at once.
        """
        if not self.peers or not is_collective_failure(error):
            return None
        deadline = time.monotonic() + min(2 * self.interval, LOCAL_DEATH_WAIT_S)
        while True:
            dead = [peer for peer in self.peers if not process_running(peer.pid) and not self._finished(peer)]
            if dead:
                return self._death_message(dead[0])
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(self.interval, 0.05))

    def remote_failure(self, error: BaseException) -> str | None:
        """What to say when a collective failed and no rank of this host died: a rank of another host stopped.

        ``None`` where there is no other host, or ``error`` is no collective's failure (NOTE [ Per host, and
        global ]).
        """
        if not self.remote or not is_collective_failure(error):
            return None
        if any(not process_running(peer.pid) for peer in self.peers):
            return None  # a rank of this host died: that is the cause, not the other hosts
        return remote_failure_message(self.here, self.remote, self.timeout, error)

    def finish(self, succeeded: bool) -> None:
        """Stop watching; after a normal end, tell the peers (and, on the store's host, wait until they have too).

        A rank other than 0 stops its own watching before it says `done`: once rank 0 has read every `done` it may
        exit, and a rank still watching then would take the store's host for dead. Rank 0 keeps watching while it
        waits, so a peer that dies instead of finishing still ends it; a live peer is waited for as long as the
        process group would wait in a collective.

        Args:
            succeeded: The run ended normally. After an error nothing is said, so the peers, blocked in a collective
                this rank will never join, take its exit for a death and end too.
        """
        if self.rank != 0:
            self._stop_watching()
        if succeeded:
            try:
                self._store.set(self._done_key(self.rank), "1")
                if self.rank == 0:
                    # Rank 0 holds the store: keep it up until every rank has read what it needs from it.
                    others = [self._done_key(rank) for rank in range(1, self.world_size)]
                    self._store.wait(others, self.timeout or timedelta(seconds=DONE_TIMEOUT))
            except Exception as error:  # a peer that died at the very end: the run's work is done anyway
                log.warning(f"BlockwiseStrategy: the ranks' end of run was not confirmed: {error}")
        self._stop_watching()

    def _stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval * 5)


def split_by_host(everyone: list[Peer], here: Peer) -> tuple[list[Peer], list[Peer]]:
    """The other ranks of ``here``'s host (watched) and the ranks of other hosts (left to the group's timeout)."""
    others = [peer for peer in everyone if peer.rank != here.rank]
    return [p for p in others if p.host == here.host], [p for p in others if p.host != here.host]


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure: a backend error, or gloo's and NCCL's runtime errors."""
    if isinstance(error, torch.distributed.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(word in text for word in ("gloo", "NCCL", "Connection closed"))


def remote_failure_message(here: Peer, remote: list[Peer], timeout: timedelta | None, error: BaseException) -> str:
    """The message of a rank whose collective failed while every rank of its host lived: a remote rank stopped."""
    hosts: dict[str, list[int]] = {}
    for peer in remote:
        hosts.setdefault(peer.host, []).append(peer.rank)
    where = "; ".join(f"ranks {', '.join(map(str, ranks))} on {host}" for host, ranks in sorted(hosts.items()))
    waited = f"the process group's timeout ({timeout})" if timeout else "the process group's timeout"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"BlockwiseStrategy: rank {here.rank} (process {here.pid} on {here.host}) stops: a collective failed"
        f" ({first_line}). No rank of {here.host} died; ranks on other hosts ({where}) are not watched from here, so"
        f" one of them that died or hung ends this rank at {waited} or when its connection closes. Read the logs of"
        " the other hosts for the rank that stopped first, fix the cause, then resume from the last checkpoint"
        " (`trainer.fit(..., ckpt_path=...)` or `--ckpt_path`)."
    )


__all__ = ["Peer", "RankWatchdog", "remote_failure_message", "split_by_host"]
