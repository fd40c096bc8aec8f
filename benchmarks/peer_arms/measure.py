"""What every arm records, whatever runs it: the versions, the device, the allocator cap, and one row per point.

Also where a profiled step spends its GPU time (:func:`step_profile`, :func:`kernel_split_of`), which
benchmarks/layer_levers.py shares. Imports torch and the standard library only: the Unsloth arm reads it before
``import unsloth``, which must come before transformers and PEFT.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
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
#: Kernel names by what they compute (CUDA kernel names of torch 2.11 / cuBLAS / cuDNN / bitsandbytes / Triton on an
#: H100), matched lowercased; the first kind that matches wins, so a kernel counts once. ``loss`` comes before
#: ``triton``: Liger's ``liger_cross_entropy_kernel``, Unsloth's ``_cross_entropy_forward`` and inductor's
#: ``triton_red_fused__log_softmax_..`` are Triton kernels too, but count as the loss; torch's own cross-entropy is
#: ``cunn_SoftMaxForward<.., LogSoftMaxForwardEpilogue>`` and ``nll_loss_*`` (plain softmax, attention's math path,
#: stays ``other``).
KERNEL_KINDS = (
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("gemm", ("gemm", "sm90_", "cutlass", "nvjet", "xmma", "ampere_")),
    ("dequantize", ("dequantize",)),
    ("loss", ("cross_entropy", "crossentropy", "nll_loss", "log_softmax", "logsoftmax", "cce_")),
    ("triton", ("triton",)),
)
#: Also ``triton``: a name that is a bare identifier and matched no kind above. Triton names a kernel after its
#: Python function (Liger's ``_rms_norm_forward_kernel``, ``_swiglu_forward_kernel``; Unsloth's
#: ``_rms_layernorm_forward``, ``_rope_embedding``, ``_fg_kernel``, ``_DWf_DW_dfg_kernel``), while a C++ kernel's
#: demangled name carries its parameters (``void at::native::foo<..>(..)``); the bare names of cuBLAS and cuDNN
#: (``nvjet_..``, ``sm90_xmma_..``, ``cudnn_..``) are caught by ``gemm`` and ``attention`` first.
_BARE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Device events that are copies (``Memcpy HtoD (Pinned -> Device)``, ..), not kernels: a copy engine runs them beside
#: the kernels, so they are reported on their own and kept out of the GPU's busy time.
_MEMCPY = "memcpy"


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


def profiler(device: torch.device, host: bool = False) -> torch.profiler.profile:
    """A profiler of the device's kernels only: CPU activity off, so the profiled step runs at its usual pace.

    With ``host`` the CPU's ops and runtime calls too (what ``gaps.gap_report`` reads; the step runs slower).
    On the CPU (the tests' tiny runs) it records CPU ops, which are no device events: the split is all zeros there.
    """
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    if host or not cuda:
        activities.append(torch.profiler.ProfilerActivity.CPU)
    return torch.profiler.profile(activities=activities)


def kernel_kind(name: str) -> str:
    """The kind of the kernel ``name`` (:data:`KERNEL_KINDS`; an unmatched bare name ``triton``; else ``other``)."""
    lower = name.lower()
    kind = next((k for k, needles in KERNEL_KINDS if any(n in lower for n in needles)), None)
    if kind is not None:
        return kind
    return "triton" if _BARE_NAME.fullmatch(name) else "other"


def device_events(prof: Any) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of each device (CUDA) event of ``prof``, kernels and copies, by start.

    ``prof`` is a stopped ``torch.profiler.profile`` (or anything whose ``events()`` yields events with ``name``,
    ``device_type`` and ``time_range``): ``events()`` holds the device events themselves even with CPU activity off
    (torch 2.11 and 2.13), their ``time_range`` in us from the trace's start.
    """
    found = [
        (event.name, float(event.time_range.start), float(event.time_range.end))
        for event in prof.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
        and event.time_range.end > event.time_range.start
        # With CPU activity on, a range such as ``Optimizer.step#AdamW.step`` is mirrored on the device's timeline.
        and not getattr(event, "is_user_annotation", False)
    ]
    return sorted(found, key=lambda e: e[1])


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: kernels that overlap (on other streams) count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def kernel_split_of(prof: Any, divisor: float = 1.0, top: int = 8) -> dict[str, Any]:
    """GPU time of ``prof``'s device events by kernel kind, in ms divided by ``divisor`` (e.g. per layer).

    Returns:
        Each kind of :data:`KERNEL_KINDS` and ``other`` (kernels only; their sum is the kernels' time, overlapping
        ones summed), ``memcpy`` (the copies, no kind), and ``top``: the ``top`` kernels by time, ``[name, ms]``
        summed over a name's calls, the name cut at 80 characters.
    """
    split = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0, _MEMCPY: 0.0}
    by_name: dict[str, float] = {}
    for name, start, end in device_events(prof):
        ms = (end - start) / 1e3 / divisor
        if _MEMCPY in name.lower():
            split[_MEMCPY] += ms
            continue
        split[kernel_kind(name)] += ms
        by_name[name] = by_name.get(name, 0.0) + ms
    out: dict[str, Any] = {k: round(v, 3) for k, v in split.items()}
    largest = sorted(by_name.items(), key=lambda item: item[1], reverse=True)[:top]
    out["top"] = [[name[:80], round(ms, 3)] for name, ms in largest]
    return out


def step_profile(prof: Any) -> dict[str, Any]:
    """The row fields of one profiled step, in ms for the whole step.

    Returns:
        ``step_kernels_ms`` (GPU time by kernel kind, :func:`kernel_split_of`), ``busy_ms`` (the union of the
        kernels' intervals: overlapping kernels on other streams count once), ``window_ms`` (the first kernel's
        start to the last one's end: ``busy_ms / window_ms`` below 1 is the GPU idle within the step),
        ``memcpy_ms`` (the copies, out of both), and ``top`` (the 10 largest kernels, ``[name, ms]``).
    """
    split = kernel_split_of(prof, top=10)
    kernels = [(start, end) for name, start, end in device_events(prof) if _MEMCPY not in name.lower()]
    window = max(end for _, end in kernels) - min(start for start, _ in kernels) if kernels else 0.0
    return {
        "memcpy_ms": split.pop(_MEMCPY), "top": split.pop("top"), "step_kernels_ms": split,
        "busy_ms": round(busy_us(kernels) / 1e3, 3), "window_ms": round(window / 1e3, 3),
    }  # fmt: skip
