"""Concurrent jobs on one GPU that share one host copy of the base: aggregate tokens/s, per-job VRAM, host memory.

    python -m benchmarks.concurrent_jobs --shape 7b --jobs 1 2 3 --steps 10 --workdir /tmp/concurrent
    python -m benchmarks.concurrent_jobs --shape 32b --prequantized --jobs 1 2 3 --steps 5 --workdir /tmp/concurrent

Writes a random-init checkpoint of the shape into ``--workdir`` once (seed 0): bf16, or with ``--prequantized``
NF4 with double quantization as a ``*-bnb-4bit`` checkpoint is (NOTE [ Pre-quantized random checkpoint ]; a 32B
bf16 checkpoint is ~65 GB, an NF4 one ~19 GB; a checkpoint that does not fit the free disk is refused before
anything is written). Then for each N in ``--jobs`` it starts N job processes at once. Each loads the base with
``load_blockwise`` (the first to claim it loads the host copy, the others map it read-only: NOTE [ One host copy
per machine ] in residency/shared_arena.py), adds LoRA r16 on the seven projections and trains through
``Trainer.fit`` under ``BlockwiseStrategy(vram_budget=None)`` (every block streamed, bf16-mixed, seq 512, batch 1,
random tokens). The jobs
wait for each other before their first step, so that their measured steps overlap. Each reports its median step
time over ``--steps`` steps after 2 warm-up steps, its tokens/s, its ``max_memory_reserved`` (the CUDA context,
~0.5 GB per process, comes on top), whether it maps another process's copy, and its ``Rss``/``Pss_Shmem`` from
``/proc/self/smaps_rollup``; the parent adds ``Shmem`` growth from ``/proc/meminfo``. One JSON line per N is
printed and appended to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from benchmarks.step_benchmark import SHAPES, TARGETS, BenchModule, StepTimer
from lightning_blockwise import BlockwiseStrategy, load_blockwise
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.residency.placement import host_copy_of
from lightning_blockwise.residency.shared_arena import shmem_bytes

SEQ = 512
WARMUP = 2


def _smaps_rollup() -> dict[str, int]:
    """This process's ``/proc/self/smaps_rollup`` fields in bytes (Linux)."""
    fields = {}
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


class _Rendezvous(pl.Callback):
    """Before the first step: say ready, then wait until every job of the arm is (their steps overlap)."""

    def __init__(self, folder: Path, index: int, jobs: int) -> None:
        self.folder, self.index, self.jobs = folder, index, jobs

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.folder / f"ready{self.index}").touch()
        while len(list(self.folder.glob("ready*"))) < self.jobs:
            time.sleep(0.05)


def run_job(checkpoint: Path, folder: Path, index: int, jobs: int, steps: int) -> None:
    """One job: load (shared), train, write ``job{index}.json`` into ``folder``."""
    start = time.perf_counter()
    torch.manual_seed(index)
    base = load_blockwise(checkpoint, compute_dtype=torch.bfloat16, progress=False)
    loaded = time.perf_counter() - start
    copy = host_copy_of(base)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(index)
    batches = [
        {"input_ids": (ids := torch.randint(0, vocab, (1, SEQ), generator=generator)), "labels": ids.clone()}
        for _ in range(WARMUP + steps)
    ]
    timer = StepTimer(WARMUP)
    trainer = pl.Trainer(
        strategy=BlockwiseStrategy(vram_budget=None),
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=WARMUP + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_Rendezvous(folder, index, jobs), timer],
    )
    trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
    step = statistics.median(timer.times)
    rollup = _smaps_rollup()
    report = {
        "job": index,
        "load_s": round(loaded, 1),
        "maps_another_copy": bool(copy is not None and copy.arena.read_only),
        "step_s": round(step, 4),
        "tokens_per_s": round(SEQ / step, 1),
        "max_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2),
        "max_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
        "rss_gb": round(rollup.get("Rss", 0) / 1e9, 2),
        "pss_shmem_gb": round(rollup.get("Pss_Shmem", 0) / 1e9, 2),
    }
    (folder / f"job{index}.json").write_text(json.dumps(report))


# NOTE [ Pre-quantized random checkpoint ]
# A 32B bf16 checkpoint is ~65 GB: it does not fit the single-H100 machine's 64 GB disk, and building the bf16
# model whole would take 65 GB of host RAM or VRAM as well. A pre-quantized NF4 checkpoint of the same shape is
# ~19 GB, and `load_blockwise` takes it as it takes a downloaded `*-bnb-4bit` one (deserialized, no quantizer).
# `random_nf4_model` builds it on the device one linear at a time: each bf16 weight exists only until it is
# quantized, so the bf16 model never exists whole anywhere; the NF4 model (~19 GB at 32B) is on the device. Then
# transformers' own `save_pretrained` writes it, in shards of `shard_size`: it moves one shard at a time to the
# host, so host memory holds one shard (4 GB), never the model. `save_pretrained` writes the quantization
# settings that the config carries; `random_nf4_model` quantizes outside `from_pretrained`, so the config is
# given `nf4_config`, the settings `nf4_linear` quantizes with. Written into `<path>.partial` and renamed when
# complete, so that a run killed while writing leaves nothing that a later run would take for a checkpoint.

#: Shards of a pre-quantized checkpoint: one on the host at a time while it is written.
NF4_SHARD_SIZE = "4GB"


def write_nf4_checkpoint(
    config: transformers.PretrainedConfig, path: Path, device: torch.device | str, shard_size: str = NF4_SHARD_SIZE
) -> None:
    """A random-init NF4 (double quant) checkpoint of ``config`` at ``path`` (seed 0), as ``*-bnb-4bit`` ones are.

    NOTE [ Pre-quantized random checkpoint ]. ``load_blockwise(path)`` loads exactly
    ``random_nf4_model(config, device)`` built under ``torch.manual_seed(0)``.

    Args:
        config: The model's shape.
        path: The checkpoint directory to write (must not exist).
        device: Where the model is built and quantized (the GPU for real shapes).
        shard_size: ``save_pretrained``'s ``max_shard_size``.
    """
    torch.manual_seed(0)
    model = random_nf4_model(config, device)
    model.config.quantization_config = nf4_config(torch.bfloat16)
    model.save_pretrained(path, max_shard_size=shard_size)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def write_bf16_checkpoint(config: transformers.PretrainedConfig, path: Path, device: torch.device | str) -> None:
    """A random-init bf16 checkpoint of ``config`` at ``path`` (seed 0), built whole on ``device``."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def checkpoint_bytes(config: transformers.PretrainedConfig, prequantized: bool) -> int:
    """What the checkpoint of ``config`` takes on disk, from its shape alone (the safetensors headers aside)."""
    if prequantized:
        sizes = model_sizes(config, torch.bfloat16, lora_rank=0)
        return sizes.host_bytes(block_size=1) + sizes.host_embedding_bytes + sizes.device_bytes
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(t.nbytes for t in model.state_dict().values())


def make_checkpoint(shape: str, path: Path, prequantized: bool) -> float:
    """The random-init checkpoint of ``shape`` at ``path``, written once; the seconds writing it took (0 if found).

    Raises:
        MisconfigurationException: If the checkpoint does not fit the free space of ``path``'s disk (checked
            before anything is built or written).
    """
    if (path / "config.json").exists():
        return 0.0
    config = SHAPES[shape]()
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    needed, free = checkpoint_bytes(config, prequantized), shutil.disk_usage(path.parent).free
    if needed > free:
        hint = "" if prequantized else " Pass `--prequantized` to write it in NF4 (about 0.3x the bytes), or"
        raise MisconfigurationException(
            f"concurrent_jobs: the {'NF4' if prequantized else 'bf16'} {shape} checkpoint needs"
            f" {needed / 1e9:.1f} GB but `{path.parent}` has {free / 1e9:.1f} GB free.{hint} pass a `--workdir` on a"
            " larger disk."
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    (write_nf4_checkpoint if prequantized else write_bf16_checkpoint)(config, partial, device)
    partial.rename(path)
    return time.perf_counter() - start


def run_arm(checkpoint: Path, workdir: Path, jobs: int, steps: int) -> dict[str, Any]:
    """``jobs`` job processes at once; their reports and the machine's ``Shmem`` growth."""
    folder = workdir / f"arm{jobs}"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.iterdir():
        stale.unlink()
    baseline = shmem_bytes()
    command = [sys.executable, "-m", "benchmarks.concurrent_jobs", "--job", str(folder)]
    command += ["--checkpoint", str(checkpoint)]
    processes = [
        subprocess.Popen([*command, "--index", str(index), "--jobs", str(jobs), "--steps", str(steps)])
        for index in range(jobs)
    ]
    peak_shmem = 0
    while any(process.poll() is None for process in processes):
        peak_shmem = max(peak_shmem, shmem_bytes() - baseline)
        time.sleep(0.2)
    if any(process.returncode != 0 for process in processes):
        raise RuntimeError(f"a job of the {jobs}-job arm failed: {[p.returncode for p in processes]}")
    reports = [json.loads((folder / f"job{index}.json").read_text()) for index in range(jobs)]
    return {
        "jobs": jobs,
        "aggregate_tokens_per_s": round(sum(r["tokens_per_s"] for r in reports), 1),
        "shmem_growth_gb": round(peak_shmem / 1e9, 2),
        "per_job": reports,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--prequantized", action="store_true", help="write the base as a pre-quantized NF4 checkpoint, not bf16"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/concurrent_jobs"))
    parser.add_argument("--out", type=Path, default=None)
    # One job (started by the parent).
    parser.add_argument("--job", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job is not None:
        run_job(args.checkpoint, args.job, args.index, args.jobs[0], args.steps)
        return
    base = "nf4" if args.prequantized else "bf16"
    checkpoint = args.workdir / f"{args.shape}-{base}"
    written = make_checkpoint(args.shape, checkpoint, args.prequantized)
    print(f"checkpoint {checkpoint} ready ({written:.0f} s writing it)", flush=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for jobs in args.jobs:
        arm = run_arm(checkpoint, args.workdir, jobs, args.steps)
        result = {"shape": args.shape, "checkpoint": base, "checkpoint_write_s": round(written, 1), "seq": SEQ}
        result |= {"device": device, **arm}
        line = json.dumps(result)
        print(line, flush=True)
        if args.out is not None:
            with args.out.open("a") as out:
                out.write(line + "\n")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
