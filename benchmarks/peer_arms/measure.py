"""What every arm records, whatever runs it: the versions, the device, the allocator cap, and one row per point.

Imports torch and the standard library only: the Unsloth arm reads it before ``import unsloth``, which must come
before transformers and PEFT.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

#: Distributions whose versions every row carries (None where not installed).
DISTRIBUTIONS = (
    "torch", "transformers", "peft", "bitsandbytes", "lightning", "liger_kernel", "triton", "unsloth", "unsloth_zoo",
    "cut_cross_entropy",
)  # fmt: skip
#: GB are 1e9 bytes, as everywhere in benchmarks/.
GB = 1e9


def versions() -> dict[str, str | None]:
    """The installed version of each of :data:`DISTRIBUTIONS`, and Python's."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_name(device: torch.device) -> str:
    """The card's name, or ``cpu``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cap_allocator(device: torch.device, cap_gib: float | None) -> dict[str, Any]:
    """Cap the caching allocator at ``cap_gib`` GiB from the process's start, as a card that size would be.

    Called before anything is allocated (a cap set later still lets what is cached stay). Returns what the rows
    record of it.

    Raises:
        ValueError: If a cap is asked for on the CPU (there is no allocator to cap), or exceeds the card.
    """
    settings: dict[str, Any] = {"cap_gib": cap_gib, "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF")}
    if cap_gib is None:
        return settings
    if device.type != "cuda":
        raise ValueError(f"--cap-gib {cap_gib} caps the CUDA allocator; the CPU has none. Leave it out on the CPU.")
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_gib * 2**30 > total:
        raise ValueError(f"--cap-gib {cap_gib} is more than the card's {total / 2**30:.1f} GiB; give a smaller cap.")
    torch.cuda.set_per_process_memory_fraction(cap_gib * 2**30 / total, device)
    return settings


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is the device running out of memory (torch's, cuBLAS's or the driver's way of saying it)."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA_ERROR_OUT_OF_MEMORY")
    )


def now(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (a step's end, not its launch)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def reset_peaks(device: torch.device) -> None:
    """Start the peaks afresh (after the warm-up)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def timing(times: list[float], step_tokens: float) -> dict[str, Any]:
    """The median step and its throughput, and the steps it is the median of."""
    median = statistics.median(times)
    return {"s_per_step": median, "tokens_per_s": step_tokens / median, "step_times": [round(t, 4) for t in times]}


def peaks(device: torch.device) -> dict[str, float | None]:
    """Peak allocated and reserved GB since :func:`reset_peaks` (``None`` on the CPU, which has no such count)."""
    if device.type != "cuda":
        return {"peak_allocated_gb": None, "peak_reserved_gb": None}
    return {
        "peak_allocated_gb": torch.cuda.max_memory_allocated(device) / GB,
        "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / GB,
    }


def failure(error: BaseException) -> dict[str, Any]:
    """The row fields of a point that failed: ``oom`` (a result) or ``error``, and the first line of the message."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    return {"status": "oom" if is_oom(error) else "error", "error": f"{type(error).__name__}: {first}"}


def emit(row: dict[str, Any], out: Path) -> None:
    """Append ``row`` to ``out`` (one JSON line, flushed: a process killed later keeps it) and print it."""
    line = json.dumps(row)
    with out.open("a") as f:
        f.write(line + "\n")
    print(line, flush=True)


def where(p: Any) -> dict[str, Any]:
    """A point's fields of a row (``spec.Point``)."""
    return {"point": p.key, "data": p.data, "tokens": p.tokens, "batch": p.batch, "step_tokens": p.step_tokens}


def run_points(points: list[Any], head: dict[str, Any], out: Path, run: Any) -> None:
    """``run(point)`` for each point, shortest first, one row each; after an OOM the longer points are rows saying so.

    Args:
        points: The arm's points, sorted shortest first.
        head: The fields every row of the arm carries.
        out: The JSON-lines file.
        run: Measures one point; returns its row's fields, ``status`` among them.
    """
    short_oom: str | None = None
    for p in points:
        if short_oom is not None:
            emit({**head, **where(p), "status": "skipped", "error": f"{short_oom} ran out of memory"}, out)
            continue
        row = run(p)
        emit({**head, **where(p), **row}, out)
        if row["status"] == "oom":
            short_oom = p.key
