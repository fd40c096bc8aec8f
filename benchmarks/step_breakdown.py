"""Where a training step's time goes: resident training against blockwise, and the blockwise step taken apart.

One process, one model (``step_benchmark.build_model``: a random-init NF4 Qwen2.5 shape, LoRA r=16 on the seven
projections, bf16-mixed, batch 1, AdamW), for each ``--seq``:

1. ``--profile-steps`` steps of each arm under ``torch.profiler``: GPU busy time (the union of all kernels), copies,
   kernels, launches and host synchronizations per step, memory copies by kind, the top host operations (the
   profiler slows the host: its wall times are not step times);
2. ``resident`` (no checkpointing, the yardstick) and ``blockwise:1:2`` (``BlockwiseStrategy(vram_budget=None)``:
   every block streamed) through
   ``step_benchmark.run_arm``, alternated ``--repeats`` times in rotated order (run-order drift shows as spread);
3. the resident step's parts outside Lightning, each synchronized: the decoder's forward under ``no_grad``
   (``step_benchmark.forward_nograd``), the whole model's forward with grad (head and loss included), its backward;
   the recompute floor is (no-grad forward + resident step) / resident step;
4. ``--trace-steps`` blockwise steps traced: CUDA events where each layer, copy, wait and recompute begins and ends
   (the streamer's observer, ``profiling/trace.py``), the host clock at the same points and inside the wrappers
   (their host times include the observer's own event records: an upper bound).

Prints the tables and appends one JSON line per sequence length to ``--out``.

    python -m benchmarks.step_breakdown --shape 7b --seq 512 2048 [--deterministic] [--out FILE.jsonl]

``--baseline DIR``: ``streamer.py`` and ``activations.py`` of ``lightning_blockwise/residency`` as they were before
a change; a ``blockwise:1:2@baseline`` arm runs them in the same alternation (before and after in one process).
``--profile-only`` stops after item 1 (with ``--trace-dir``, the chrome traces are kept, gzipped).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.step_benchmark import SHAPES, BenchModule, build_model, forward_nograd, run_arm
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.profiling.trace import Trace
from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.remat import RematLayer
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.streamer import BlockStreamer
from lightning_blockwise.strategy import streamed_stack

RESIDENT = "resident"
BLOCKWISE = "blockwise:1:2"  # the defaults, named as step_benchmark names them
BASELINE = "blockwise:1:2@baseline"
#: Host calls that wait for the device (kineto's names).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
#: Host time inside the wrappers, per step: (class, attribute).
HOST_PARTS = {
    "acquire": (BlockStreamer, "acquire"),
    "release": (BlockStreamer, "release"),
    "capture_call": (LayerCall, "capture"),
    "capture_rng": (RngSnapshot, "capture"),
    "replay_rng": (RngSnapshot, "replay"),
}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _batches(vocab: int, seq: int, count: int) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (1, seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids})
    return DataLoader(batches, batch_size=None)


def _fit(
    model: nn.Module, strategy: Any, callbacks: list[pl.Callback], steps: int, vocab: int, seq: int, det: bool
) -> None:
    """``Trainer.fit`` as ``step_benchmark.run_arm`` runs it, with ``callbacks``."""
    model.to("cuda")  # a blockwise fit leaves the base in host memory
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        deterministic=det,
    )  # fmt: skip
    trainer.fit(BenchModule(model), _batches(vocab, seq, steps))
    torch.cuda.empty_cache()


# --- the resident step's parts -------------------------------------------------------------------------------------


def resident_parts(model: nn.Module, steps: int, warmup: int, vocab: int, seq: int) -> dict[str, float]:
    """The whole model's forward with grad (bf16 autocast, head and loss) and its backward: medians in seconds."""
    model.to("cuda")
    gen = torch.Generator().manual_seed(0)
    params = [p for p in model.parameters() if p.requires_grad]
    forward, backward = [], []
    model.train()
    for index in range(warmup + steps):
        ids = torch.randint(0, vocab, (1, seq), generator=gen).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        middle = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        if index >= warmup:
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
        for p in params:
            p.grad = None
    return {"forward_grad_s": _median(forward), "backward_s": _median(backward)}


# --- traced blockwise steps: CUDA events and the host clock --------------------------------------------------------


class StepTrace(Trace):
    """The profiler's trace (CUDA events on the streams) plus the host clock at each layer's start and end.

    ``recomputes`` holds (start, end, host start, host end) of each recompute in the backward.
    """

    def __init__(self) -> None:
        super().__init__(cuda=True)
        self.phase: Pass | None = None
        self.host_layers: list[tuple[Pass, float, float]] = []
        self.recomputes: list[tuple[Any, Any, float, float]] = []
        self._host_open = 0.0

    def start(self) -> None:
        super().start()
        self.host_layers, self.recomputes = [], []

    def layer_started(self, layer: int, phase: Pass) -> None:
        super().layer_started(layer, phase)
        self.phase = phase
        self._host_open = time.perf_counter()

    def layer_finished(self, layer: int, phase: Pass) -> None:
        if self.active:
            self.host_layers.append((phase, self._host_open, time.perf_counter()))
        super().layer_finished(layer, phase)


@contextmanager
def _recompute_marks(trace: StepTrace) -> Iterator[None]:
    """Mark each recompute (``RematLayer.run`` in the backward) on the compute stream and the host clock."""
    original = RematLayer.run

    def run(self: RematLayer, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        if not (trace.active and trace.phase is Pass.BACKWARD):
            return original(self, hidden, call)
        start, host = trace.mark(), time.perf_counter()
        output = original(self, hidden, call)
        trace.recomputes.append((start, trace.mark(), host, time.perf_counter()))
        return output

    RematLayer.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        RematLayer.run = original  # type: ignore[method-assign]


@contextmanager
def _host_timed(owner: type, name: str, totals: dict[str, float], key: str) -> Iterator[None]:
    """Add the host time of every call of ``owner.name`` to ``totals[key]`` (for ``replay``: entering and leaving)."""
    original = owner.__dict__[name]
    func = original.__func__ if isinstance(original, classmethod) else original
    timed: Any
    if name == "replay":

        @contextmanager
        def timed(*args: Any, **kwargs: Any) -> Iterator[None]:
            start = time.perf_counter()
            context = func(*args, **kwargs)
            context.__enter__()
            totals[key] += time.perf_counter() - start
            error: tuple[Any, Any, Any] = (None, None, None)
            try:
                yield
            except BaseException as exc:
                error = (type(exc), exc, exc.__traceback__)
                raise
            finally:
                start = time.perf_counter()
                context.__exit__(*error)
                totals[key] += time.perf_counter() - start

    else:

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return func(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start

    setattr(owner, name, classmethod(timed) if isinstance(original, classmethod) else timed)
    try:
        yield
    finally:
        setattr(owner, name, original)


class TraceSteps(pl.Callback):
    """Traces the training steps from ``warmup`` on; each becomes a dict of milliseconds (``steps``)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.trace = StepTrace()
        self.host = dict.fromkeys(HOST_PARTS, 0.0)
        self.steps: list[dict[str, float]] = []
        self._begin: Any = None
        self._wall = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, BlockwiseStrategy) and strategy.plan is not None
        self.trace.block_of = strategy.plan.block_of
        strategy.set_observer(self.trace)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        if idx >= self.warmup:
            for key in self.host:
                self.host[key] = 0.0
            self.trace.start()
            self._begin = self.trace.mark()
        self._wall = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        trace = self.trace
        if not trace.active:
            return
        end = trace.mark()
        torch.cuda.synchronize()
        wall = time.perf_counter() - self._wall
        trace.stop()
        self.steps.append(self._reduce(end, wall))
        spans = [*trace.copies, *trace.waits, *trace.layers]
        marks = [m for span in spans for m in span[-2:]] + [m for r in trace.recomputes for m in r[:2]]
        trace.recycle([self._begin, end, *marks])

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.set_observer(None)

    def _reduce(self, end: Any, wall: float) -> dict[str, float]:
        trace, begin = self.trace, self._begin

        def ms(a: Any, b: Any) -> float:
            return a.elapsed_time(b)

        step: dict[str, float] = {"wall_ms": wall * 1e3, "gpu_step_ms": ms(begin, end)}
        spans = {phase: [(s, e) for _, p, s, e in trace.layers if p is phase] for phase in Pass}
        for phase, layers in spans.items():
            host = [(s, e) for p, s, e in trace.host_layers if p is phase]
            step[f"{phase.value}_layers"] = len(layers)
            step[f"{phase.value}_span_ms"] = ms(layers[0][0], layers[-1][1])
            step[f"{phase.value}_layers_gpu_ms"] = sum(ms(s, e) for s, e in layers)
            step[f"{phase.value}_host_span_ms"] = (host[-1][1] - host[0][0]) * 1e3
            step[f"{phase.value}_host_inside_ms"] = sum(e - s for s, e in host) * 1e3
        forward, backward = spans[Pass.FORWARD], spans[Pass.BACKWARD]
        step["before_forward_ms"] = ms(begin, forward[0][0])  # embedding, Lightning
        step["between_ms"] = ms(forward[-1][1], backward[0][0])  # norm, head, loss and their backward
        step["after_backward_ms"] = ms(backward[-1][1], end)  # optimizer step, Lightning
        step["recompute_gpu_ms"] = sum(ms(s, e) for s, e, _, _ in trace.recomputes)
        step["recompute_host_ms"] = sum(he - hs for _, _, hs, he in trace.recomputes) * 1e3
        step["wait_ms"] = sum(ms(s, e) for _, s, e in trace.waits)
        step["copy_ms"] = sum(ms(s, e) for _, s, e in trace.copies)
        step["copy_gb"] = trace.bytes / 1e9
        step.update({f"host_{key}_ms": seconds * 1e3 for key, seconds in self.host.items()})
        return step


def traced_blockwise(model: nn.Module, steps: int, warmup: int, seq: int, det: bool) -> dict[str, float]:
    """``steps`` traced blockwise steps (defaults) after ``warmup``: the median of each quantity."""
    tracer = TraceSteps(warmup)
    with ExitStack() as stack:
        for key, (owner, name) in HOST_PARTS.items():
            stack.enter_context(_host_timed(owner, name, tracer.host, key))
        stack.enter_context(_recompute_marks(tracer.trace))
        _fit(
            model,
            BlockwiseStrategy(vram_budget=None, budget_tokens=seq),
            [tracer],
            warmup + steps,
            model_vocab(model),
            seq,
            det,
        )
    return {key: _median([step[key] for step in tracer.steps]) for key in tracer.steps[0]}


def model_vocab(model: nn.Module) -> int:
    """The vocabulary size of the PEFT-wrapped benchmark model."""
    return model.get_base_model().config.vocab_size


# --- torch.profiler: GPU busy time ---------------------------------------------------------------------------------


class ProfileSteps(pl.Callback):
    """Runs ``torch.profiler`` over the training steps from ``warmup`` on and keeps its chrome trace."""

    def __init__(self, warmup: int, path: Path) -> None:
        self.warmup = warmup
        self.path = path
        self.profiler: torch.profiler.profile | None = None
        self.steps = 0
        self.top = ""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            torch.cuda.synchronize()
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.profiler is not None:
            self.steps += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.profiler is not None
        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        self.profiler.export_chrome_trace(str(self.path))
        table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        self.top = f"(over {self.steps} steps)\n{table}"
        self.profiler = None


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, start, end = 0.0, None, None
    for s, e in sorted(spans):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def summarize_trace(path: Path, steps: int) -> dict[str, float]:
    """Per step, from a kineto chrome trace: GPU busy time, copies, kernels, host waits for the device."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    copies = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy"]
    streams: dict[int, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            stream = int(e.get("args", {}).get("stream", -1))
            streams[stream] = streams.get(stream, 0.0) + e["dur"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    syncs = [e for e in runtime if e["name"] in SYNC_CALLS]
    launches = [e for e in runtime if "LaunchKernel" in e["name"]]
    gpu = kernels + copies
    per = 1e3 * steps  # microseconds over steps to milliseconds per step

    def by_name(chosen: list[dict[str, Any]], top: int) -> dict[str, list[float]]:
        totals: dict[str, list[float]] = {}
        for e in chosen:
            count_ms = totals.setdefault(e["name"], [0.0, 0.0])
            count_ms[0] += 1 / steps
            count_ms[1] += e["dur"] / per
        return dict(sorted(totals.items(), key=lambda kv: -kv[1][1])[:top])

    return {
        "gpu_busy_ms": _union_us(kernels) / per,
        "gpu_busy_or_copying_ms": _union_us(gpu) / per,
        "gpu_window_ms": (max(e for _, e in gpu) - min(s for s, _ in gpu)) / per if gpu else 0.0,
        "kernel_ms_by_stream": {str(k): v / per for k, v in sorted(streams.items(), key=lambda kv: -kv[1])},
        "copy_ms": sum(e - s for s, e in copies) / per,
        "kernels": len(kernels) / steps,
        "launches": len(launches) / steps,
        "launch_host_ms": sum(e["dur"] for e in launches) / per,
        "syncs": len(syncs) / steps,
        "sync_host_ms": sum(e["dur"] for e in syncs) / per,
        # Pageable host-to-device copies wait for their stream (CUDA's API synchronization rules).
        "memcpy_by_kind": by_name([e for e in events if e.get("cat") == "gpu_memcpy"], 8),
        "runtime_by_call": by_name(runtime, 10),
    }


def profiled(model: nn.Module, strategy: Any, steps: int, warmup: int, seq: int, det: bool, keep: Path | None) -> dict:
    """GPU busy time and host figures per step over ``steps`` profiled steps of ``strategy``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        profiler = ProfileSteps(warmup, path)
        _fit(model, strategy, [profiler], warmup + steps, model_vocab(model), seq, det)
        summary = summarize_trace(path, profiler.steps)
        if keep is not None:
            with open(path, "rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    print(profiler.top, flush=True)
    return summary


# --- before and after in one process -------------------------------------------------------------------------------


@contextmanager
def baseline_residency(directory: Path) -> Iterator[None]:
    """Build the run's streamer and layer-input offload from ``directory``'s ``streamer.py`` / ``activations.py``."""
    classes = {"streamer": "BlockStreamer", "activations": "ActivationOffload"}
    saved = {name: getattr(streamed_stack, name) for name in classes.values()}
    for module_name, class_name in classes.items():
        spec = importlib.util.spec_from_file_location(f"_baseline_{module_name}", directory / f"{module_name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
        setattr(streamed_stack, class_name, getattr(module, class_name))
    try:
        yield
    finally:
        for name, cls in saved.items():
            setattr(streamed_stack, name, cls)


# --- the run -------------------------------------------------------------------------------------------------------


def breakdown(model: nn.Module, args: argparse.Namespace, seq: int) -> dict[str, Any]:
    """Every measurement of one sequence length, in the module docstring's order."""
    vocab, det = model_vocab(model), args.deterministic
    profiles = {}
    for arm, strategy in ((RESIDENT, "auto"), (BLOCKWISE, BlockwiseStrategy(vram_budget=None, budget_tokens=seq))):
        name = f"{args.shape}_{seq}_{arm.split(':')[0]}.json.gz"
        keep = None if args.trace_dir is None else Path(args.trace_dir) / name
        profiles[arm] = profiled(model, strategy, args.profile_steps, args.warmup, seq, det, keep)
    if args.profile_only:
        return {"shape": args.shape, "seq": seq, "mode": "deterministic" if det else "default", "profiled": profiles}
    arms = [RESIDENT, BLOCKWISE] + ([BASELINE] if args.baseline else [])
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    rows: dict[str, dict[str, Any]] = {}
    for repeat in range(args.repeats):
        order = arms[repeat % len(arms) :] + arms[: repeat % len(arms)]
        for arm in order:
            with baseline_residency(args.baseline) if arm == BASELINE else ExitStack():
                model.to("cuda")
                row = run_arm(model, arm.split("@")[0], args.steps, args.warmup, vocab, det, seq)
            times[arm].append(row["s_per_step"])
            rows.setdefault(arm, row)
            print(f"[{seq}] repeat {repeat} {arm}: {row['s_per_step']:.4f} s/step", flush=True)
    model.to("cuda")
    nograd = forward_nograd(model, args.steps, args.warmup, vocab, seq)["s_per_step"]
    parts = resident_parts(model, args.steps, args.warmup, vocab, seq)
    traced = traced_blockwise(model, args.trace_steps, args.warmup, seq, det)
    resident, blockwise = _median(times[RESIDENT]), _median(times[BLOCKWISE])
    result = {
        "shape": args.shape, "seq": seq, "mode": "deterministic" if det else "default",
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "s_per_step": {arm: values for arm, values in times.items()},
        "resident_s": resident, "blockwise_s": blockwise,
        "resident_peak_gb": rows[RESIDENT]["peak_gb"], "blockwise_peak_gb": rows[BLOCKWISE]["peak_gb"],
        "forward_nograd_s": nograd, **parts,
        "floor": (nograd + resident) / resident, "ratio": blockwise / resident,
        "traced": traced, "profiled": profiles,
    }  # fmt: skip
    if args.baseline:
        result["baseline_s"] = _median(times[BASELINE])
    return result


def print_tables(results: list[dict[str, Any]]) -> None:
    """The markdown tables RESULTS.md quotes."""
    r0 = results[0]
    print(
        f"\n{r0['device']} | torch {r0['torch']} | mode {r0['mode']} | median of {r0['steps']} steps x {r0['repeats']}"
    )
    print("| shape, seq | resident | no-grad fwd | fwd (grad) | bwd | floor | blockwise | ratio | over floor | peaks |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        baseline = f" (baseline {r['baseline_s']:.3f})" if "baseline_s" in r else ""
        print(
            f"| {r['shape']}, {r['seq']} | {r['resident_s']:.3f} | {r['forward_nograd_s']:.3f} |"
            f" {r['forward_grad_s']:.3f} | {r['backward_s']:.3f} | {r['floor']:.2f}x | {r['blockwise_s']:.3f}{baseline}"
            f" | {r['ratio']:.2f}x | {100 * (r['ratio'] / r['floor'] - 1):+.1f}% |"
            f" {r['resident_peak_gb']:.1f} / {r['blockwise_peak_gb']:.1f} GB |"
        )
    print("\nBlockwise step, traced (ms per step; GPU = CUDA events on the compute stream, host = perf_counter):")
    print(
        "| shape, seq | wall | GPU busy (res / bw) | forward span | head+loss | backward span | recompute | waits on"
        " copies | copies | host/layer fwd | host/layer bwd | host in wrappers |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        t, p = r["traced"], r["profiled"]
        layers = t["forward_layers"]
        wrappers = sum(t[f"host_{k}_ms"] for k in HOST_PARTS)
        print(
            f"| {r['shape']}, {r['seq']} | {t['wall_ms']:.1f} | {p[RESIDENT]['gpu_busy_ms']:.1f} /"
            f" {p[BLOCKWISE]['gpu_busy_ms']:.1f} | {t['forward_span_ms']:.1f} | {t['between_ms']:.1f} |"
            f" {t['backward_span_ms']:.1f} | {t['recompute_gpu_ms']:.1f} | {t['wait_ms']:.1f} |"
            f" {t['copy_gb']:.2f} GB in {t['copy_ms']:.1f} | {t['forward_host_span_ms'] / layers:.2f} (GPU"
            f" {t['forward_span_ms'] / layers:.2f}) | {t['backward_host_span_ms'] / layers:.2f} (GPU"
            f" {t['backward_span_ms'] / layers:.2f}) | {wrappers:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    parser.add_argument("--seq", type=int, nargs="+", default=[512])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per fit")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="fits per arm, alternated")
    parser.add_argument("--trace-steps", type=int, default=4)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--baseline", type=Path, default=None, help="a folder with the earlier streamer/activations")
    parser.add_argument("--profile-only", action="store_true", help="only the torch.profiler fits")
    parser.add_argument("--trace-dir", default=None, help="keep the profiler's chrome traces here (gzipped)")
    parser.add_argument("--out", default=None, help="append one JSON line per sequence length here")
    args = parser.parse_args()
    if args.deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        parser.error("--deterministic needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (cuBLAS reads it once)")
    if args.baseline is not None and not all((args.baseline / f).is_file() for f in ("streamer.py", "activations.py")):
        parser.error(f"--baseline {args.baseline} must hold streamer.py and activations.py")
    if args.deterministic:
        torch.use_deterministic_algorithms(True)  # the parts timed outside Lightning, as Trainer(deterministic=True)
    start = time.perf_counter()
    model, _ = build_model(args.shape, torch.device("cuda"))
    print(f"built {args.shape} in {time.perf_counter() - start:.0f} s", flush=True)
    results = []
    for seq in args.seq:
        results.append(breakdown(model, args, seq))
        print(json.dumps(results[-1]), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"command": " ".join(sys.argv), **results[-1]}) + "\n")
    if not args.profile_only:
        print_tables(results)


if __name__ == "__main__":
    main()
