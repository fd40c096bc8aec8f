"""Where a profiled step leaves the GPU idle, and why: the host late to launch, or the device waiting on a stream.

Reads a Chrome trace that ``torch.profiler`` wrote with CPU and CUDA activity (``export_chrome_trace``). The GPU's
busy time is the union of its kernels (copies left out, as in ``measure.step_profile``); a gap is a hole in it of at
least ``min_gap_us``. For the kernel that ends a gap, its launch is found by the trace's correlation id:

- **host late**: the launch call ended after the gap began, so nothing was queued; the gap is charged to the CPU ops
  around the launch (``stack``: outermost to innermost, cut to a few names), and to a host synchronization when one
  returned inside the gap (the host waited for the device to drain, then had to refill its queue);
- **device waiting**: the kernel was queued before the gap began and waited (another stream's event, a copy).

    report = gap_report(json.loads(Path("trace.json").read_text()))
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from typing import Any

#: Host calls that block until the device (or a stream, an event) is done, matched as name prefixes. ``cudaMemcpy``
#: also matches ``cudaMemcpyAsync``, which blocks only for pageable host memory: it is listed so the report shows
#: where copies are launched (how the fused update's device copies were found), not as a sync.
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
#: Device events that are work on the GPU's compute engines.
BUSY = ("kernel", "gpu_memset")
#: Host calls that launch device work (the runtime's and the driver's, which cuBLAS and cuDNN use).
LAUNCHES = ("cuda_runtime", "cuda_driver")


def _enclosing(ops: list[dict[str, Any]], times: list[float]) -> list[list[str]]:
    """For each time of ``times`` (sorted), the names of the ``ops`` of one thread around it, outermost first."""
    out: list[list[str]] = []
    stack: list[dict[str, Any]] = []
    index = 0
    for time in times:
        while index < len(ops) and ops[index]["ts"] <= time:
            op = ops[index]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < op["ts"]:
                stack.pop()
            stack.append(op)
            index += 1
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < time:
            stack.pop()
        out.append([op["name"] for op in stack if op["ts"] + op["dur"] >= time])
    return out


def _short(stack: list[str], depth: int) -> str:
    """The stack's first name and its innermost ``depth``, joined by ``>``."""
    if len(stack) <= depth + 1:
        return " > ".join(stack)
    return " > ".join([stack[0], "...", *stack[-depth:]])


def gap_report(trace: dict[str, Any], min_gap_us: float = 20.0, depth: int = 3, top: int = 12) -> dict[str, Any]:
    """Idle time of the GPU in ``trace``, by cause (module docstring).

    Args:
        trace: A Chrome trace (``{"traceEvents": [...]}``) of one step, CPU and CUDA activity on.
        min_gap_us: The shortest hole in the GPU's busy time that counts.
        depth: CPU op names kept from the innermost end of a launch's stack.
        top: Causes (and largest gaps) listed.

    Returns:
        ``window_ms``, ``busy_ms``, ``idle_ms`` (in gaps of at least ``min_gap_us``), ``host_late_ms``,
        ``device_wait_ms``, ``gaps``; ``host_late_by_stack`` and ``after_sync`` (``[cause, ms, gaps]``, largest first);
        ``syncs`` (each :data:`SYNCS` call by where it was made: count and ms the host spent in it); ``largest``
        gaps.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    busy = sorted((e for e in events if e.get("cat") in BUSY), key=lambda e: e["ts"])
    if not busy:
        return {"gaps": 0, "error": "no kernels in the trace (was CUDA activity on?)"}
    launches = {
        e["args"]["correlation"]: e for e in events if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})
    }
    syncs = sorted(
        (e for e in events if e.get("cat") == "cuda_runtime" and e["name"].startswith(SYNCS)), key=lambda e: e["ts"]
    )
    ops_by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for event in events:
        if event.get("cat") in ("cpu_op", "user_annotation", "python_function"):
            ops_by_thread[event.get("tid")].append(event)
    for ops in ops_by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))

    gaps: list[tuple[float, float, dict[str, Any]]] = []
    reach, busy_total = busy[0]["ts"], 0.0
    start = reach
    for kernel in busy:
        end = kernel["ts"] + kernel["dur"]
        if kernel["ts"] - reach >= min_gap_us:
            gaps.append((reach, kernel["ts"], kernel))
        if end > reach:
            busy_total += end - max(kernel["ts"], reach)
            reach = end
    window = reach - start

    host_late, waiting = [], []
    for begin, finish, kernel in gaps:
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is not None and launch["ts"] + launch["dur"] > begin:
            host_late.append((begin, finish, launch))
        else:
            waiting.append((begin, finish, kernel))

    by_stack: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_sync: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    largest = []
    late_by_thread: dict[Any, list[tuple[float, float, float]]] = defaultdict(list)
    for begin, finish, launch in host_late:
        late_by_thread[launch.get("tid")].append((launch["ts"], begin, finish))
    sync_ends = [s["ts"] + s["dur"] for s in syncs]
    for tid, items in late_by_thread.items():
        items.sort()
        stacks = _enclosing(ops_by_thread.get(tid, []), [t for t, _, _ in items])
        for (_, begin, finish), stack in zip(items, stacks, strict=True):
            key = _short(stack, depth) or "(no CPU op)"
            by_stack[key][0] += (finish - begin) / 1e3
            by_stack[key][1] += 1
            first = bisect.bisect_left(sync_ends, begin)
            if first < len(syncs) and sync_ends[first] <= finish:
                sync = syncs[first]
                sync_stack = _enclosing(ops_by_thread.get(sync.get("tid"), []), [sync["ts"]])[0]
                cause = f"{sync['name']} in {_short(sync_stack, depth) or '(no CPU op)'}"
                by_sync[cause][0] += (finish - begin) / 1e3
                by_sync[cause][1] += 1
            largest.append(((finish - begin) / 1e3, "host late", key))
    for begin, finish, kernel in waiting:
        largest.append(
            ((finish - begin) / 1e3, "device waiting", f"{kernel['name'][:60]} on stream {kernel.get('tid')}")
        )

    sync_counts: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for sync in syncs:
        stack = _enclosing(ops_by_thread.get(sync.get("tid"), []), [sync["ts"]])[0]
        key = f"{sync['name']} in {_short(stack, depth) or '(no CPU op)'}"
        sync_counts[key][0] += 1
        sync_counts[key][1] += sync["dur"] / 1e3

    def ranked(table: dict[str, list[float]]) -> list[list[Any]]:
        rows = sorted(table.items(), key=lambda item: item[1][0], reverse=True)[:top]
        return [[name, round(ms, 3), int(count)] for name, (ms, count) in rows]

    return {
        "window_ms": round(window / 1e3, 3),
        "busy_ms": round(busy_total / 1e3, 3),
        "idle_ms": round(sum(f - b for b, f, _ in gaps) / 1e3, 3),
        "host_late_ms": round(sum(f - b for b, f, _ in host_late) / 1e3, 3),
        "device_wait_ms": round(sum(f - b for b, f, _ in waiting) / 1e3, 3),
        "gaps": len(gaps),
        "host_late_by_stack": ranked(by_stack),
        "after_sync": ranked(by_sync),
        "syncs": sorted(
            ([name, int(count), round(ms, 3)] for name, (count, ms) in sync_counts.items()),
            key=lambda row: row[2], reverse=True,
        )[:top],
        "largest": [[round(ms, 3), kind, where] for ms, kind, where in sorted(largest, reverse=True)[:top]],
    }  # fmt: skip
