"""The disk's sequential read rate without the page cache (``O_DIRECT``), and what it implies for an NVMe tier.

    python -m benchmarks.disk_read_rate --path /tmp/disk_probe --size-gib 8 [--chunk-mib 16] [--threads 1 4]
        [--budget-s 40] [--existing DIR --existing-gib 4] [--out F]

Writes a file of ``--size-gib`` GiB of random bytes (``fsync``), then reads it back with ``O_DIRECT`` in
``--chunk-mib`` MiB reads, ``--passes`` passes for each count in ``--threads`` (each thread reads its own
contiguous part of the file into its own aligned buffer, as a reader that keeps several blocks in flight would);
reports GB/s per pass. The page cache is bypassed, so the rate is the device's, as a base that does not fit in
host RAM would be read (NOTE [ What O_DIRECT does not bypass ]). Each write and each pass stops after
``--budget-s`` seconds and reports the bytes it moved, so a slow disk costs time, not the whole run. With
``--existing`` it also reads the largest files under a directory (up to ``--existing-gib`` GiB), files this run
did not write. Then the step time the slowest rate implies when every block of a base is read once per forward
and once per backward (issue 17's NVMe tier), for the base sizes given (``--base-gb``, default: 123B NF4 ~68 GB
and 32B bf16 ~64 GB), per micro-batch with and without block-major accumulation over ``--accumulate``
micro-batches (which reads each block once for the forward of all of them and once for their backward).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time
from pathlib import Path

# NOTE [ What O_DIRECT does not bypass ]
# `O_DIRECT` skips this kernel's page cache, nothing below it. On a virtual machine the disk is a file or
# volume of the host, whose own page cache may hold what the guest just wrote (Firecracker's default block
# cache mode writes through the host's page cache): a probe file written seconds before can then read back at
# memory speed, and a drive's own DRAM cache holds a few GB as well. Hence a probe file larger than such a
# cache, a rate per pass (a first pass much slower than the second says a cache filled), and `--existing`:
# files that this run did not write, which no cache need hold. None of this proves the rate is the device's;
# read the numbers side by side.

_ALIGN = 4096
#: The smallest file `--existing` reads.
_EXISTING_MIN_SIZE = 64 * 2**20


def write_probe(path: Path, size: int, chunk: int, budget_s: float) -> tuple[int, float]:
    """Random bytes at ``path``, flushed to the device: up to ``size`` bytes or ``budget_s`` seconds of writing.

    Returns:
        The bytes written (whole chunks) and the seconds it took, ``fsync`` included.
    """
    block = os.urandom(chunk)
    written = 0
    start = time.perf_counter()
    with path.open("wb") as out:
        while written < size and time.perf_counter() - start < budget_s:
            out.write(block)
            written += chunk
        out.flush()
        os.fsync(out.fileno())
    return written, time.perf_counter() - start


def _read_range(path: Path, begin: int, end: int, chunk: int, deadline: float, done: list[int], slot: int) -> None:
    """``O_DIRECT`` reads of ``[begin, end)`` in ``chunk`` pieces until ``end``, end of file or ``deadline``."""
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        offset = begin
        while offset < end and time.perf_counter() < deadline:
            read = os.preadv(fd, [buffer], offset)
            if read <= 0:
                break
            offset += read
            done[slot] += read
    finally:
        os.close(fd)
        buffer.close()


def direct_read_rate(path: Path, chunk: int, threads: int = 1, budget_s: float = float("inf")) -> tuple[int, float]:
    """One ``O_DIRECT`` pass over ``path`` by ``threads`` readers of contiguous parts, for at most ``budget_s``.

    Args:
        path: The file to read.
        chunk: Bytes per read; a multiple of 4096 (``O_DIRECT`` reads whole aligned pages).
        threads: Readers at once; each reads its own part of the file, in order.
        budget_s: Seconds after which every reader stops.

    Returns:
        The bytes read and the seconds it took.

    Raises:
        ValueError: If ``chunk`` is not a positive multiple of 4096 or ``threads`` is below 1.
    """
    if chunk <= 0 or chunk % _ALIGN:
        raise ValueError(f"direct_read_rate: chunk={chunk} must be a positive multiple of {_ALIGN} for O_DIRECT.")
    if threads < 1:
        raise ValueError(f"direct_read_rate: threads={threads} must be at least 1.")
    size = path.stat().st_size
    # Parts start on chunk boundaries, so every read is aligned; the last part takes the remainder.
    part = -(-size // threads // chunk) * chunk
    done = [0] * threads
    start = time.perf_counter()
    deadline = start + budget_s
    readers = [
        threading.Thread(target=_read_range, args=(path, i * part, min((i + 1) * part, size), chunk, deadline, done, i))
        for i in range(threads)
    ]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    return sum(done), time.perf_counter() - start


def largest_files(folder: Path, limit: int, min_size: int = 0) -> list[Path]:
    """The largest regular files under ``folder`` of ``min_size`` bytes or more, largest first, until ``limit``."""
    files = sorted(
        (f for f in folder.rglob("*") if f.is_file() and not f.is_symlink()), key=lambda f: -f.stat().st_size
    )
    chosen, total = [], 0
    for file in files:
        if total >= limit or file.stat().st_size < min_size:
            break
        chosen.append(file)
        total += file.stat().st_size
    return chosen


def _implied(base_gb: float, rate: float, accumulate: int) -> dict[str, float]:
    """Seconds of reads per micro-batch: every block read for the forward and again for the backward, per
    micro-batch, or per ``accumulate`` micro-batches with block-major accumulation."""
    plain = 2 * base_gb * 1e9 / rate
    return {"plain": round(plain, 1), f"block_major_{accumulate}": round(plain / accumulate, 1)}


def _read_existing(folder: Path, limit: int, chunk: int, budget_s: float) -> dict[str, object]:
    """One ``O_DIRECT`` pass over the largest files under ``folder``; an error is reported, not raised.

    A folder on a filesystem without ``O_DIRECT`` (some overlay and FUSE mounts refuse it) must not cost the
    probe's numbers, which are already measured: its error is recorded in their place. Files under
    ``_EXISTING_MIN_SIZE`` are left out: opening many small files measures the filesystem, not the device.
    """
    files = largest_files(folder, limit, _EXISTING_MIN_SIZE)
    moved, start = 0, time.perf_counter()
    try:
        for file in files:
            left = budget_s - (time.perf_counter() - start)
            if left <= 0:
                break
            moved += direct_read_rate(file, chunk, 1, left)[0]
    except OSError as err:
        return {"folder": str(folder), "error": f"{type(err).__name__}: {err}"}
    seconds = time.perf_counter() - start
    return {"folder": str(folder), "files": len(files), "gb": round(moved / 1e9, 2), "gb_per_s": _gbps(moved, seconds)}


def _gbps(moved: int, seconds: float) -> float:
    return round(moved / seconds / 1e9, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", type=Path, default=Path("/tmp/disk_probe"))
    parser.add_argument("--size-gib", type=float, default=8.0)
    parser.add_argument("--chunk-mib", type=int, default=16)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--passes", type=int, default=2, help="passes per thread count")
    parser.add_argument("--budget-s", type=float, default=60.0, help="seconds at most for the write and each pass")
    parser.add_argument("--existing", type=Path, default=None, help="also read the largest files under this folder")
    parser.add_argument("--existing-gib", type=float, default=4.0)
    parser.add_argument("--base-gb", type=float, nargs="+", default=[68.0, 64.0])
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.existing is not None and not args.existing.is_dir():
        parser.error(
            f"--existing {args.existing} is not a directory; pass a folder of large files (e.g. site-packages)."
        )
    chunk = args.chunk_mib * 2**20
    size = int(args.size_gib * 2**30) // chunk * chunk
    written, write_s = write_probe(args.path, size, chunk, args.budget_s)
    passes = []
    try:
        for threads in args.threads:
            for _ in range(args.passes):
                moved, seconds = direct_read_rate(args.path, chunk, threads, args.budget_s)
                passes.append({"threads": threads, "gb": round(moved / 1e9, 2), "gb_per_s": _gbps(moved, seconds)})
    finally:
        args.path.unlink()
    result = {
        "path": str(args.path),
        "size_gb": round(written / 1e9, 2),
        "chunk_mib": args.chunk_mib,
        "write_gb_per_s": _gbps(written, write_s),
        "direct_read": passes,
    }
    rates = [p["gb_per_s"] * 1e9 for p in passes if p["gb"] > 0]
    if args.existing is not None:
        result["existing"] = existing = _read_existing(
            args.existing, int(args.existing_gib * 2**30), chunk, args.budget_s
        )
        if existing.get("gb", 0) > 0:
            rates.append(existing["gb_per_s"] * 1e9)
    if not rates:
        raise RuntimeError(f"disk_read_rate: nothing was read in {args.budget_s} s; raise --budget-s.")
    result["implied_s_per_micro_batch"] = {
        f"at_{which}_{rate / 1e9:.2f}_gb_per_s": {f"{b:g} GB": _implied(b, rate, args.accumulate) for b in args.base_gb}
        for which, rate in (("slowest", min(rates)), ("fastest", max(rates)))
    }
    line = json.dumps(result)
    print(line)
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
