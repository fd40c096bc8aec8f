"""The disk's sequential read rate without the page cache (``O_DIRECT``), and what it implies for an NVMe tier.

    python -m benchmarks.disk_read_rate --path /tmp/disk_probe --size-gib 8 [--chunk-mib 16] [--out F]

Writes a file of ``--size-gib`` GiB of random bytes (``fsync``), then reads it back with ``O_DIRECT`` in
``--chunk-mib`` MiB reads into one aligned buffer, twice; reports GB/s per pass. The page cache is bypassed,
so the rate is the device's, as a base that does not fit in host RAM would be read. Then the step time that
rate implies when every block of a base is read once per forward and once per backward (issue 17's NVMe tier),
for the base sizes given (``--base-gb``, default: 123B NF4 ~68 GB and 32B bf16 ~64 GB), per micro-batch with
and without block-major accumulation over ``--accumulate`` micro-batches (which reads each block once for the
forward of all of them and once for their backward).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from pathlib import Path

_ALIGN = 4096


def write_probe(path: Path, size: int, chunk: int) -> None:
    """``size`` bytes of random data at ``path``, flushed to the device."""
    block = os.urandom(chunk)
    with path.open("wb") as out:
        for _ in range(size // chunk):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())


def direct_read_rate(path: Path, chunk: int) -> float:
    """Bytes per second of one sequential ``O_DIRECT`` pass over ``path``."""
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        total = 0
        start = time.perf_counter()
        while True:
            read = os.readv(fd, [buffer])
            if read <= 0:
                break
            total += read
        return total / (time.perf_counter() - start)
    finally:
        os.close(fd)
        buffer.close()


def _implied(base_gb: float, rate: float, accumulate: int) -> dict[str, float]:
    """Seconds of reads per micro-batch: every block read for the forward and again for the backward, per
    micro-batch, or per ``accumulate`` micro-batches with block-major accumulation."""
    plain = 2 * base_gb * 1e9 / rate
    return {"plain": round(plain, 1), f"block_major_{accumulate}": round(plain / accumulate, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=Path("/tmp/disk_probe"))
    parser.add_argument("--size-gib", type=float, default=8.0)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--base-gb", type=float, nargs="+", default=[68.0, 64.0])
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    chunk = args.chunk_mib * 2**20
    size = int(args.size_gib * 2**30) // chunk * chunk
    start = time.perf_counter()
    write_probe(args.path, size, chunk)
    written = time.perf_counter() - start
    try:
        rates = [direct_read_rate(args.path, chunk) for _ in range(2)]
    finally:
        args.path.unlink()
    rate = min(rates)
    result = {
        "size_gb": round(size / 1e9, 2),
        "chunk_mib": args.chunk_mib,
        "write_gb_per_s": round(size / written / 1e9, 2),
        "direct_read_gb_per_s": [round(r / 1e9, 2) for r in rates],
        "implied_s_per_micro_batch": {f"{base:g} GB": _implied(base, rate, args.accumulate) for base in args.base_gb},
    }
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
