"""The Unsloth arm: the peer probe's loader (``load_unsloth``) and a plain PyTorch loop, its points in one process.

Unsloth patches transformers and PEFT when it is imported, so it runs in a process of its own, started with the
environment of ``.peer/peer-env.sh`` (benchmarks/peers.py does that)::

    bash -c 'source .peer/peer-env.sh && python -m benchmarks.peer_arms.unsloth_arm --arm unsloth \
        --ckpt /tmp/peers/7b-bf16 --probe .peer/unsloth_probe.py --points random:4096x1 --out rows.jsonl'

Unsloth's defaults: ``FastLanguageModel.from_pretrained(load_in_4bit=True, dtype=bfloat16)``, LoRA r=16 alpha 32 on
the seven projections, ``use_gradient_checkpointing="unsloth"``, its own loss (``model(**batch).loss``); the loop is
the probe's (AdamW lr 1e-5 on the trainable parameters, bf16 autocast around the forward).

``--profile`` runs one extra step after the timed ones at each point under ``measure.profiler`` (not timed, not in
the losses, its peaks left out) and adds ``measure.step_profile``'s fields of it to the row, as the Lightning arm does.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.peer_arms.spec import Point, parse_arm, parse_point

# Unsloth turns expandable segments on at its import unless the variable is set; torch is imported (to cap the
# allocator) before Unsloth is, so its default is set here, where it still takes effect.
os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

import torch

from benchmarks.peer_arms import measure

#: How a ``rows:`` point's batch reaches Unsloth (it reads packed sequences from a one-row batch only).
ROWS_AS_ONE = (
    "the batch's packed rows concatenated into one row (positions restart per example): Unsloth finds packed"
    " sequences from position_ids only in a batch of one row (unsloth/models/llama.py, get_packed_info_from_kwargs)"
)


def load_probe(path: Path) -> ModuleType:
    """The peer probe as a module (it is a script in a git-ignored folder, not a package).

    Raises:
        FileNotFoundError: If ``path`` does not exist (the lead copies it into ``.peer/``).
    """
    if not path.is_file():
        raise FileNotFoundError(f"--probe {path} does not exist: copy ../shared/peers/unsloth_probe.py there.")
    spec = importlib.util.spec_from_file_location("unsloth_probe", path)
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def batches(point: Point, count: int, vocab: int) -> list[dict[str, Any]]:
    """``count`` batches of ``point`` as Unsloth takes them: random ids, or packed rows as one (:data:`ROWS_AS_ONE`)."""
    if point.data == "random":
        gen = torch.Generator().manual_seed(point.tokens)
        ids = torch.randint(0, vocab, (count, point.batch, point.tokens), generator=gen)
        return [{"input_ids": row, "labels": row} for row in ids]
    from benchmarks.peer_arms.lightning_arm import batches as packed  # imports transformers: after Unsloth

    rows = packed(point, count, vocab)
    return [{k: v.reshape(1, -1) if torch.is_tensor(v) else v for k, v in b.items()} for b in rows]


def run_point(model: Any, point: Point, fixed_steps: int | None, device: torch.device, profile: bool = False) -> dict:
    """Time ``point`` in the probe's loop; an OOM is a result. ``profile``: profile one extra step after the timed."""
    steps, warmup = point.steps(fixed_steps)
    profiled = warmup + steps if profile else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    row: dict[str, Any] = {"steps": steps, "warmup": warmup}
    times: list[float] = []
    losses: list[float] = []
    peaks: dict[str, float | None] = {}
    measure.reset_peaks(device)
    try:  # the data's refusal is this point's result too
        data = batches(point, steps + warmup + int(profile), model.config.vocab_size)
        measured = data[: steps + warmup]  # a rows: point's extra batch may be longer: the mean is as without it
        row["step_tokens_mean"] = sum(int(b["input_ids"].numel()) for b in measured) / len(measured)
        for index, batch in enumerate(data):
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if index == warmup:
                measure.reset_peaks(device)
            if index == profiled:
                measure.now(device)  # the batch's copy done first: the profile is the step's
                peaks = measure.peaks(device)
            # The context stops the profiler should the step fail, so the next point can start its own.
            with measure.profiler(device) if index == profiled else contextlib.nullcontext() as prof:
                start = measure.now(device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                    loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                end = measure.now(device)
            if prof is not None:
                row.update(measure.step_profile(prof), profiled_step_s=round(end - start, 4), profiled_step=index)
                continue
            if index >= warmup:
                times.append(end - start)
            losses.append(float(loss))
    except Exception as error:  # an OOM is a measurement; anything else is recorded and the next point runs
        if not (profile and len(times) == steps):
            row.update(measure.failure(error), steps_done=len(losses))
        else:  # only the profiled step failed: the timed ones stand
            row["profile_error"] = measure.failure(error)["error"]
    if "status" not in row:
        row["status"] = "ok"
        row.update(measure.timing(times, row["step_tokens_mean"]), loss_first=losses[0], loss_last=losses[-1])
    row.update(measure.peaks(device), **peaks)  # the timed steps' peaks: the profiled one's, profiler on, left out
    del optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", type=parse_arm, required=True)
    parser.add_argument("--ckpt", type=Path, required=True, help="the bf16 (or pre-quantized) checkpoint to load")
    parser.add_argument("--probe", type=Path, default=Path(".peer/unsloth_probe.py"))
    parser.add_argument("--shape", default=None, help="recorded in the rows")
    parser.add_argument("--points", nargs="+", type=parse_point, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the tests' stand-in probe")
    parser.add_argument("--profile", action="store_true", help="profile one extra step per point (not timed)")
    args = parser.parse_args(argv)
    if args.arm.system != "unsloth":
        parser.error(f"--arm {args.arm.name}: this process runs the unsloth arm only.")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    gc_mode = str(args.arm.options.get("gc", "unsloth"))
    head: dict[str, Any] = {"system": "unsloth", "arm": args.arm.name, "shape": args.shape}
    head["settings"] = measure.cap_allocator(device, args.cap_gib)
    points = sorted(args.points)
    try:
        probe = load_probe(args.probe)
        max_seq = max(p.step_tokens if p.data == "rows" else p.tokens for p in points)
        options = argparse.Namespace(
            grad_ckpt=gc_mode, max_seq=max_seq, no_4bit=args.device == "cpu", device=args.device, rank=16,
            alpha=32, seed=0, expandable_segments="auto",
        )  # fmt: skip
        probe._set_env(options)
        path, notes = probe.prepare_checkpoint(str(args.ckpt), max_seq)
        model, arm_notes = probe.load_unsloth(path, options)  # imports unsloth before transformers and PEFT
    except Exception as error:
        head.update(device=measure.device_name(device), versions=measure.versions())
        for p in points:
            measure.emit({**head, **measure.where(p), **measure.failure(error), "phase": "load"}, args.out)
        return
    head["settings"].update(
        use_gradient_checkpointing=gc_mode, loss="unsloth (its patched cross-entropy)", kernels="unsloth",
        lora="r16 alpha32 dropout0 q,k,v,o,gate,up,down", base="NF4 (load_in_4bit) of a random bf16 checkpoint",
        precision="bf16 autocast", optimizer="AdamW lr 1e-5", loop="plain PyTorch (the peer probe's)",
        ckpt=str(args.ckpt), ckpt_notes=notes, unsloth=arm_notes, rows_as=ROWS_AS_ONE,
    )  # fmt: skip
    head.update(device=measure.device_name(device), versions=measure.versions())
    model.train()
    measure.run_points(points, head, args.out, lambda p: run_point(model, p, args.steps, device, args.profile))


if __name__ == "__main__":
    main()
