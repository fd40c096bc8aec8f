"""This package beside transformers + PEFT and Unsloth on one GPU: each arm in its own process, one after another.

On the GPU host, from the repository root, with ``.whl`` and ``.peer`` carried (``.peer/`` holds copies of
``../shared/peers/unsloth_probe.py`` and ``peer-env.sh``; ``.whl/peer/`` Unsloth's wheels)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD           # the usual setup; do NOT source .peer/peer-env.sh here
    python -m benchmarks.peers --shape 0.5b --tokens 1024 4096 --steps 2 --equal-memory   # a smoke run, minutes
    python -m benchmarks.peers --shape 7b --tokens 4096 16384 32768 --out /tmp/peers/7b.jsonl
    python -m benchmarks.peers --shape 7b --tokens 32768 49152 65536 --rows none --cap-gib 22 --equal-memory \
        --out /tmp/peers/7b-22gib.jsonl
    python -m benchmarks.peers --shape 7b --tokens 16384 --rows none --cap-gib 22 --arms unsloth ours+liger+fused \
        --steps 3 --profile --out /tmp/peers/7b-profile.jsonl      # where each arm's step spends its GPU time
    python -m benchmarks.peers --table /tmp/peers/7b.jsonl /tmp/peers/7b-22gib.jsonl   # for benchmarks/RESULTS.md

The driver sources ``.peer/peer-env.sh`` in the Unsloth arm's process only (it installs the wheels into
/tmp/peer_site on first use and puts that first on ``PYTHONPATH``); the other arms get the driver's environment
without /tmp/peer_site, so none of them can import what Unsloth patches at import. The bf16 checkpoint Unsloth loads
is written once into ``--work`` (``load_benchmark.py make``; pre-quantized NF4 above 7B) and reused.

Arms (``--arms``; a system and options joined by ``+``, see ``benchmarks/peer_arms/spec.py``):

- ``ours``: ``BlockwiseStrategy()`` defaults, ``chunked_causal_lm_loss``; ``+liger`` Liger kernels,
  ``+budget=7.5GB`` a ``vram_budget``, ``+offload``, ``+tiled``, ``+hfloss``, ``+noattn`` no kept attention
  outputs (NOTE [ Kept attention ]), ``+det`` deterministic mode (also on
  ``resident`` and ``peft``);
- ``resident``: ``strategy="auto"``, no checkpointing, the chunked loss: the compute floor;
- ``peft``: transformers + PEFT QLoRA, Hugging Face gradient checkpointing (non-reentrant), the chunked loss;
- ``unsloth``: Unsloth's defaults (``use_gradient_checkpointing="unsloth"``, its loss, its kernels), through the
  peer probe's loader; a skip line where it is not importable (or not on a GPU).

Points: ``random:T x 1`` for each ``--tokens`` T (random ids over the vocabulary, labels = ids) and ``--rows``
(default ``4096x2``: data/instructions.jsonl through the byte tokenizer, packed into 4096-token rows, two a step;
Unsloth gets the two rows as one, see ``peer_arms/unsloth_arm.py``). Each arm builds its model once and runs its
points shortest first, so an OOM at the longest loses nothing; an OOM is a row (``status: oom``), and so is a
timeout or a crash. s/step is the median of 5 timed steps after 2 warm-up steps up to 16384 tokens a step, 3 after
1 beyond (``--steps N``: N everywhere); each row says which. tokens/s counts a step's tokens, the padding of a
``rows:`` batch's shorter row included (``step_tokens_mean``). ``--cap-gib`` caps the allocator in every arm's
process from its start (``torch.cuda.set_per_process_memory_fraction``). ``--equal-memory`` runs Unsloth first and
adds ``ours+liger+fused+budget=unsloth`` (the fast switches on): at each random point, a
``vram_budget`` of Unsloth's peak reserved bytes there.

``--profile``: each arm trains one extra step after the timed ones at each point, under ``torch.profiler`` (CUDA
activity only: CPU activity off keeps the step at its pace); that step is not in the median, the losses or the peaks
(an extra step, rather than the last timed one left out: the timed steps are the same as without ``--profile``).
Its row adds, in ms for the whole step (``peer_arms/measure.py``, ``step_profile``): ``step_kernels_ms``, the GPU
time by kernel kind (``attention``, ``gemm``, ``dequantize``, ``loss``, ``triton``, ``other``; ``KERNEL_KINDS``,
shared with ``layer_levers.py``; overlapping kernels summed); ``busy_ms``, the union of the kernels' intervals
(kernels that overlap on other streams count once); ``window_ms``, the first kernel's start to the last one's end
(``busy_ms / window_ms`` below 1 is the GPU idle within the step); ``memcpy_ms``, the copies (device events named
Memcpy: a copy engine's, out of the kernels and busy time); ``top``, the 10 largest kernels ``[name, ms]``; and
``profiled_step_s``, its wall time with the profiler on, beside the median's ``s_per_step``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peer_arms.spec import SYSTEM_NAMES, UNSLOTH_BUDGET, Arm, Point, parse_arm, point
from benchmarks.peer_arms.table import read_rows, render

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARMS = ["unsloth", "ours", "ours+liger", "peft", "resident"]
#: Shapes whose Unsloth checkpoint is written pre-quantized (a bf16 32B is 65 GB).
PREQUANTIZED = ("32b", "72b")
#: The folder peer-env.sh installs Unsloth's wheels into, kept off every other arm's PYTHONPATH.
PEER_SITE = "/tmp/peer_site"


def plan_points(args: argparse.Namespace) -> list[Point]:
    """The points every arm runs at (an arm with ``budget=unsloth`` runs at the random ones Unsloth measured)."""
    points = [point(t) for t in args.tokens]
    if args.rows != "none":
        tokens, batch = (int(n) for n in args.rows.split("x"))
        points.append(point(tokens, batch, "rows"))
    return sorted(set(points))


def unsloth_skip(args: argparse.Namespace) -> str | None:
    """Why the Unsloth arm cannot run here, or ``None``."""
    if not args.probe.is_file():
        return f"no peer probe at {args.probe} (copy ../shared/peers/unsloth_probe.py there)"
    if not args.peer_env.is_file():
        return f"no {args.peer_env} (copy ../shared/peers/peer-env.sh there)"
    if args.device != "cuda":
        return "Unsloth runs on a CUDA GPU only"
    check = 'import importlib.util, sys; sys.exit(importlib.util.find_spec("unsloth") is None)'
    found = subprocess.run(_in_peer_env(args, "-c", check), cwd=ROOT, capture_output=True, timeout=600)
    if found.returncode != 0:
        return f"unsloth is not importable after sourcing {args.peer_env}"
    return None


def _in_peer_env(args: argparse.Namespace, *python_args: str) -> list[str]:
    script = 'source "$1" >&2 && shift && exec "$@"'
    return ["bash", "-c", script, "peers", str(args.peer_env), sys.executable, *python_args]


def checkpoint(args: argparse.Namespace) -> Path:
    """The checkpoint Unsloth loads: written once into ``--work`` (through a ``.partial`` folder), then reused."""
    quantized = args.shape in PREQUANTIZED
    path = args.work / f"{args.shape}-{'nf4' if quantized else 'bf16'}"
    if (path / "config.json").is_file():
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    command = [sys.executable, "benchmarks/load_benchmark.py", "make", "--shape", args.shape, "--out", str(partial)]
    subprocess.run(command + ["--prequantized"] * quantized, cwd=ROOT, check=True, timeout=args.arm_timeout)
    partial.rename(path)
    return path


def arm_command(arm: Arm, points: list[Point], args: argparse.Namespace, out: Path, budgets: dict[str, int]) -> list:
    """The command of ``arm``'s process."""
    common = ["--arm", arm.name, "--shape", args.shape, "--points", *[p.key for p in points], "--out", str(out)]
    common += ["--cap-gib", str(args.cap_gib)] * (args.cap_gib is not None)
    common += ["--steps", str(args.steps)] * (args.steps is not None)
    common += ["--profile"] * args.profile
    if arm.system == "unsloth":
        extra = ["--ckpt", str(checkpoint(args)), "--probe", str(args.probe)]
        return _in_peer_env(args, "-m", "benchmarks.peer_arms.unsloth_arm", *common, *extra)
    extra = ["--device", args.device]
    if budgets:
        extra += ["--budget-for", *[f"{key}={value}" for key, value in budgets.items()]]
    return [sys.executable, "-m", "benchmarks.peer_arms.lightning_arm", *common, *extra]


def run_arm(arm: Arm, points: list[Point], args: argparse.Namespace, budgets: dict[str, int]) -> list[dict[str, Any]]:
    """Run ``arm``'s process within ``--arm-timeout``; its rows, and a row for each point it did not report."""
    name = re.sub(r"[^A-Za-z0-9._=-]", "_", arm.name)
    out, log = args.work / "rows" / f"{name}.jsonl", args.work / "logs" / f"{name}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *_without_peer_site(env.get("PYTHONPATH", ""))])
    status, started = "crashed", time.perf_counter()
    try:
        command = arm_command(arm, points, args, out, budgets)
    except (subprocess.SubprocessError, OSError) as error:  # the checkpoint could not be written
        return [_missing(arm, p, args, "error", f"checkpoint: {error}") for p in points]
    with log.open("w") as sink:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            code = process.wait(timeout=args.arm_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the arm and what it started (compile workers)
            code, status = process.wait(), "timeout"
    rows = read_rows(out) if out.is_file() else []
    seen = {row["point"] for row in rows}
    tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
    why = f"{status} after {time.perf_counter() - started:.0f} s (exit {code}; log {log}): {tail[-400:]}"
    return rows + [_missing(arm, p, args, status, why) for p in points if p.key not in seen]


def _without_peer_site(path: str) -> list[str]:
    return [entry for entry in path.split(os.pathsep) if entry and entry.rstrip("/") != PEER_SITE]


def _missing(arm: Arm, p: Point, args: argparse.Namespace, status: str, why: str) -> dict[str, Any]:
    where = {"point": p.key, "data": p.data, "tokens": p.tokens, "batch": p.batch, "step_tokens": p.step_tokens}
    head = {"system": SYSTEM_NAMES[arm.system], "arm": arm.name, "shape": args.shape}
    return {**head, "settings": {"cap_gib": args.cap_gib}, **where, "status": status, "error": why}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every arm at every point, Unsloth first; the rows, also appended to ``--out``."""
    points = plan_points(args)
    said = "; ".join(f"{p.key}: {p.steps(args.steps)[0]} after {p.steps(args.steps)[1]} warm-up" for p in points)
    print(f"peers: s/step is the median of the timed steps ({said})", file=sys.stderr, flush=True)
    arms = sorted(args.arms, key=lambda a: a.system != "unsloth")  # stable: the others keep their order
    results: list[dict[str, Any]] = []
    peer_peaks: dict[str, int] = {}
    for arm in arms:
        mine = points
        budgets: dict[str, int] = {}
        if arm.budget == UNSLOTH_BUDGET:
            mine = [p for p in points if p.key in peer_peaks]
            budgets = {p.key: peer_peaks[p.key] for p in mine}
            why = "no Unsloth peak at this point (--equal-memory gives this arm Unsloth's peak as its vram_budget)"
            rows = [_missing(arm, p, args, "skipped", why) for p in points if p.key not in peer_peaks]
        elif arm.system == "unsloth" and (skip := unsloth_skip(args)) is not None:
            mine, rows = [], [_missing(arm, p, args, "skipped", skip) for p in points]
        else:
            rows = []
        if mine:
            print(f"peers: {arm.name} at {' '.join(p.key for p in mine)}", file=sys.stderr, flush=True)
            rows += run_arm(arm, mine, args, budgets)
        if arm.system == "unsloth":
            peak = f"peak_{args.equal_memory_peak}_gb"
            peer_peaks = {r["point"]: int(r[peak] * 1e9) for r in rows if r["status"] == "ok" and r["data"] == "random"}
        for row in rows:
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
        results += rows
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", nargs="+", type=Path, help="print the markdown table of these JSONL files, only")
    parser.add_argument("--shape", default="7b", help="a step_benchmark shape (7b, 32b, 72b), or tiny (CPU tests)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384, 32768], help="random points, batch 1")
    parser.add_argument("--rows", default="4096x2", help="TOKENSxBATCH of the shipped data packed, or none")
    parser.add_argument("--arms", nargs="+", type=parse_arm, default=[parse_arm(a) for a in DEFAULT_ARMS])
    parser.add_argument("--cap-gib", type=float, default=None, help="cap the allocator from each process's start")
    parser.add_argument("--steps", type=int, default=None, help="timed steps at every point (default: 5, 3 >16k)")
    parser.add_argument("--equal-memory", action="store_true", help="add ours+liger+fused+budget=unsloth")
    parser.add_argument("--equal-memory-peak", choices=["reserved", "allocated"], default="reserved")
    parser.add_argument("--profile", action="store_true", help="GPU time by kernel kind of one extra step per point")
    parser.add_argument("--arm-timeout", type=float, default=3600.0, help="seconds per arm's process")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the tests' tiny runs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/peers"), help="checkpoints, logs, per-arm rows")
    parser.add_argument("--out", type=Path, default=None, help="append the rows here (default: WORK/rows.jsonl)")
    parser.add_argument("--probe", type=Path, default=ROOT / ".peer" / "unsloth_probe.py")
    parser.add_argument("--peer-env", type=Path, default=ROOT / ".peer" / "peer-env.sh")
    args = parser.parse_args(argv)
    if args.table:
        print(render([row for path in args.table for row in read_rows(path)]))
        return
    if args.rows != "none" and not re.fullmatch(r"\d+x\d+", args.rows):
        parser.error(f"--rows {args.rows!r} must read TOKENSxBATCH (e.g. 4096x2) or none.")
    if args.cap_gib is not None and args.device == "cpu":
        parser.error(f"--cap-gib {args.cap_gib} caps the CUDA allocator; leave it out with --device cpu.")
    if args.equal_memory and not any(a.budget == UNSLOTH_BUDGET for a in args.arms):
        args.arms.append(parse_arm(f"ours+liger+fused+budget={UNSLOTH_BUDGET}"))
    if any(a.budget == UNSLOTH_BUDGET for a in args.arms) and not any(a.name == "unsloth" for a in args.arms):
        parser.error("budget=unsloth (--equal-memory) needs the unsloth arm in --arms: its peaks are the budgets.")
    args.work.mkdir(parents=True, exist_ok=True)
    args.out = args.out or args.work / "rows.jsonl"
    rows = run(args)
    print("\n" + render(rows))


if __name__ == "__main__":
    main()
