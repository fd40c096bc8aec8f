"""The host link's limit with one and with two GPUs: pinned host -> device copy rates, alone and at once.

Arms (each GPU copies ``--gb`` GB in slabs of ``--slab-mb`` MB on a side stream, ``--repeat`` times, median):
- ``one GPU``: each GPU alone, from a private arena (the package's `HostArena`: memfd, `cudaHostRegister`).
- ``two GPUs, one arena``: both GPUs at once, from the same pages (what ranks sharing one host copy do).
- ``two GPUs, one arena + read-only mapping``: GPU 1 reads a second, read-only registered mapping of the same
  memfd (`HostArena.from_shared`, what a peer rank maps), GPU 0 the owner's mapping.
- ``two GPUs, two arenas``: each GPU its own pages (two host copies).
Prints the NUMA node of each GPU and `nvidia-smi topo -m`. Threads issue the copies (one per GPU): each
`copy_` releases the GIL, so the copies run concurrently.

    python benchmarks/host_link.py [--gb 4] [--slab-mb 256] [--repeat 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

from lightning_blockwise.residency.arena import HostArena


def _numa_nodes() -> dict[str, str]:
    """Each GPU's PCI address and NUMA node, as ``nvidia-smi`` and sysfs report them."""
    try:
        query = ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"]
        lines = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as error:
        return {"nvidia-smi": str(error)}
    nodes = {}
    for line in lines:
        index, bus = (part.strip() for part in line.split(","))
        address = bus.lower()[-12:]  # `00000000:00:06.0` -> `0000:00:06.0`, sysfs's name
        path = Path(f"/sys/bus/pci/devices/{address}/numa_node")
        nodes[f"cuda:{index}"] = f"{address}, NUMA node {path.read_text().strip() if path.exists() else '?'}"
    return nodes


def _copy_rate(sources: dict[int, torch.Tensor], slab: int, repeat: int) -> dict[int, float]:
    """GB/s per device while every device in ``sources`` copies its source at the same time (median of repeats)."""
    targets = {d: torch.empty(slab, dtype=torch.uint8, device=f"cuda:{d}") for d in sources}
    streams = {d: torch.cuda.Stream(device=d) for d in sources}
    rates: dict[int, list[float]] = {d: [] for d in sources}

    def run(device: int, barrier: threading.Barrier, elapsed: dict[int, float]) -> None:
        source, target, stream = sources[device], targets[device], streams[device]
        torch.cuda.set_device(device)
        barrier.wait()
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            for offset in range(0, source.numel() - slab + 1, slab):
                target.copy_(source[offset : offset + slab], non_blocking=True)
        stream.synchronize()
        elapsed[device] = time.perf_counter() - start

    for index in range(repeat + 1):  # the first round warms up
        elapsed: dict[int, float] = {}
        barrier = threading.Barrier(len(sources))
        threads = [threading.Thread(target=run, args=(d, barrier, elapsed)) for d in sources]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if index:
            for device, seconds in elapsed.items():
                moved = (sources[device].numel() // slab) * slab
                rates[device].append(moved / seconds / 1e9)
    return {d: statistics.median(r) for d, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--slab-mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    nbytes, slab = int(args.gb * 1e9), args.slab_mb * 2**20
    devices = list(range(torch.cuda.device_count()))
    try:
        print(subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout)
    except (OSError, subprocess.SubprocessError) as error:
        print(f"nvidia-smi topo -m: {error}")
    print(_numa_nodes())
    owner = HostArena([nbytes], pin=True)
    owner.storage.fill_(7)
    rows = []

    def arm(name: str, sources: dict[int, torch.Tensor]) -> None:
        rows.append({"arm": name, **_rates(_copy_rate(sources, slab, args.repeat))})

    for device in devices:
        arm(f"one GPU (cuda:{device})", {device: owner.storage})
    if len(devices) >= 2:
        first, second = devices[:2]
        arm("two GPUs, one arena", {first: owner.storage, second: owner.storage})
        assert owner.fd is not None
        peer = HostArena.from_shared(owner.fd, [nbytes], pin=True)
        arm(f"one GPU, read-only mapping (cuda:{second})", {second: peer.storage})
        arm("two GPUs, one arena + read-only mapping", {first: owner.storage, second: peer.storage})
        del peer
        other = HostArena([nbytes], pin=True)
        other.storage.fill_(7)
        arm("two GPUs, two arenas", {first: owner.storage, second: other.storage})
    print(f"\n{torch.cuda.get_device_name()} x{len(devices)} | {args.gb} GB per GPU in {args.slab_mb} MB slabs")
    print("| arm | GB/s per GPU | GB/s together |")
    print("| --- | --- | --- |")
    for row in rows:
        print(f"| {row['arm']} | {row['per_gpu']} | {row['total']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def _rates(rates: dict[int, float]) -> dict[str, object]:
    return {"per_gpu": ", ".join(f"cuda:{d} {r:.1f}" for d, r in rates.items()), "total": sum(rates.values())}


if __name__ == "__main__":
    main()
