"""benchmarks/peer_arms/gaps.py: a step's GPU idle gaps split into host-late and device-waiting, on a made-up trace."""

from __future__ import annotations

from typing import Any

from benchmarks.peer_arms.gaps import gap_report


def _x(cat: str, name: str, ts: float, dur: float, tid: Any = 1, correlation: int | None = None) -> dict[str, Any]:
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0, "args": args}


def _trace() -> dict[str, Any]:
    """Kernels at 0-100, 300-400 and 500-600 us. The second is launched at 250 us, inside `backward > aten::mm`,
    after a stream synchronize that returned at 120 us: host late. The third was launched at 50 us: it waited."""
    return {
        "traceEvents": [
            _x("cpu_op", "backward", 0, 1000),
            _x("cpu_op", "aten::mm", 240, 20),
            _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
            _x("cuda_runtime", "cudaStreamSynchronize", 60, 60),
            _x("cuda_runtime", "cudaLaunchKernel", 250, 5, correlation=2),
            _x("cuda_runtime", "cudaLaunchKernel", 50, 5, correlation=3),
            _x("kernel", "gemm_a", 0, 100, tid=7, correlation=1),
            _x("kernel", "gemm_b", 300, 100, tid=7, correlation=2),
            _x("kernel", "gemm_c", 500, 100, tid=7, correlation=3),
            _x("gpu_memcpy", "Memcpy HtoD", 100, 400, tid=9),  # copies are not busy time
        ]
    }


def test_gaps_are_charged_to_the_late_host_or_to_the_waiting_device() -> None:
    report = gap_report(_trace())
    assert report["window_ms"] == 0.6 and report["busy_ms"] == 0.3 and report["gaps"] == 2
    assert report["host_late_ms"] == 0.2 and report["device_wait_ms"] == 0.1
    assert report["host_late_by_stack"] == [["backward > aten::mm", 0.2, 1]]
    assert report["after_sync"] == [["cudaStreamSynchronize in backward", 0.2, 1]]
    assert report["syncs"] == [["cudaStreamSynchronize in backward", 1, 0.06]]
    assert [kind for _, kind, _ in report["largest"]] == ["host late", "device waiting"]


def test_holes_shorter_than_the_threshold_are_not_gaps() -> None:
    report = gap_report(_trace(), min_gap_us=250)
    assert report["gaps"] == 0 and report["idle_ms"] == 0 and report["busy_ms"] == 0.3
