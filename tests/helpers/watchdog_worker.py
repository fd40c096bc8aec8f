"""One rank of the watchdog test: join a gloo group, start `RankWatchdog`, then rank 1 dies and rank 0 waits.

Run as ``python -m tests.helpers.watchdog_worker [--no-watchdog]`` with the variables torchrun sets. Rank 0 stands for
a rank blocked in a collective its dead peer will never join: it sleeps, and prints ``survived`` if nothing ends it.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import torch.distributed

from lightning_blockwise.strategy.rank_watchdog import RankWatchdog


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-watchdog", action="store_true")
    parser.add_argument("--finish", action="store_true", help="both ranks end normally, one after the other")
    parser.add_argument("--sleep", type=float, default=60.0)
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = torch.distributed.get_rank()
    watchdog = None if args.no_watchdog else RankWatchdog(timedelta(minutes=30))
    torch.distributed.barrier()
    if args.finish:
        # Rank 1 ends its run and exits at once; rank 0 is still busy a while: that is no death.
        time.sleep(3.0 if rank == 0 else 0.0)
        assert watchdog is not None
        watchdog.finish(succeeded=True)
        print(f"rank {rank} finished", flush=True)
        return
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(args.sleep)
    print("survived", flush=True)


if __name__ == "__main__":
    main()
