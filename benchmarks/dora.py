"""DoRA at high rank under BlockwiseStrategy: PEFT's dense row norm, the factored one, and LoRA (issue 32).

One process per shape. The random-init NF4 base is built once; for each rank and arm the adapters are added
(seed 0, on the seven projections, ``lora_alpha = 2 r``), trained ``--warmup`` + ``--steps`` steps of one
``--seq``-token sequence (bf16-mixed, AdamW, ``BlockwiseStrategy(vram_budget=..., budget_tokens=seq)``), and
unloaded again, so the base is never rebuilt. Arms: ``lora`` (plain LoRA at that rank), ``dora_dense``
(``LoraConfig(use_dora=True)``, PEFT's forward: the dense ``B A`` every call) and ``dora_factored`` (the same
adapters with ``factor_dora_norms``; docs/dora-norm.md). The allocator is capped at ``--cap-gib`` from the
process start (a 24 GB card: 22); a run out of memory is a result (``"status": "oom"``, its peak until then),
its memory freed before the next arm. One JSON line per point, on stdout and appended to ``--out``.

    python -m benchmarks.dora --shape 32b --ranks 64 256 384 --cap-gib 22 --out dora_32b.jsonl
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m benchmarks.dora --shape 72b --deterministic --out dora_72b.jsonl

Bases: ``arena`` (default) builds the base layer by layer into the host arena
(``lightning_blockwise.loading.random_base.random_blockwise``; a 72B NF4 base is ~40 GB, more than the cap);
``device`` builds it whole on the device (``random_nf4_model``) and the first blockwise run packs it: only
for a base that fits under the cap (the tiny shape on the CPU; 32B uncapped). ``--shape tiny`` is a few-layer
Qwen2 for a CPU run of the script (``--cap-gib 0``: the cap is the CUDA allocator's). Before it builds, the
script prints an estimate of its own wall time and of each point's adapter state, to size the GPU call.

The adapters' fp32 weights, gradients and AdamW moments stay on the device (16 bytes per element): on all seven
projections that is 8.6 GB at 32B and 13.5 GB at 72B for r 64, and already over 22 GiB from r 256 on for plain
LoRA too. ``--targets`` narrows the adapted projections and ``--skip-over-cap`` records such points as
``"skipped"`` without spending their setup time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
import transformers
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.dora import DoraLinearLayer
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.step_benchmark import SHAPES, TARGETS, BenchModule
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.adapters.dora_norm import factor_dora_norms
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.residency.placement import host_copy_of

ARMS = ("lora", "dora_dense", "dora_factored")
BASES = ("arena", "device")


def tiny() -> transformers.PretrainedConfig:
    """A two-layer Qwen2 (biased q/k/v, as the 32B and 72B shapes) for a run of the script on the CPU."""
    return transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip


CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {**SHAPES, "tiny": tiny}
#: fp32 weight, gradient and AdamW's two moments per trainable adapter element.
STATE_PER_ADAPTER_BYTE = 4
# The time estimate's rates. Guesses from benchmarks/RESULTS.md (72B blockwise at seq 512: 69.7 GB copied
# per step, 1.9x the host arena, at ~35 GB/s deterministic), not measurements of this script: the script
# prints what it measures beside them.
H2D_PER_ARENA = 1.9
H2D_BYTES_PER_S = 35e9
FLOPS_PER_S = 3e14  # bf16 over NF4 (dequantize + matmul), forward + recompute + backward: 8 N flops per token
BUILD_BYTES_PER_S = 1e9  # random init, quantize and pack into pinned host memory
ADAPTER_INIT_BYTES_PER_S = 2e9  # PEFT's kaiming init of fp32 adapters on the host, per arm
ARM_SETUP_S = 15.0  # Trainer, strategy setup, plan, moving the adapters


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", required=True, choices=sorted(CONFIGS))
    parser.add_argument("--ranks", nargs="+", type=int, default=[64, 256, 384])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--targets", nargs="+", default=TARGETS, help="adapted projections (all seven)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="measured steps, after --warmup (5)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cap-gib", type=float, default=22.0, help="allocator cap from the start; 0: none (22)")
    parser.add_argument("--vram-budget", default=None, help="BlockwiseStrategy(vram_budget=...) (none: stream all)")
    parser.add_argument("--base", default="arena", choices=BASES)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    parser.add_argument(
        "--skip-over-cap", action="store_true", help="record points whose adapter state alone exceeds the cap as"
        " 'skipped' instead of running them into OOM (saves their setup time)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if min(args.ranks) < 1 or args.steps < 1 or args.warmup < 0 or args.seq < 2:
        parser.error(f"--ranks {args.ranks} and --steps {args.steps} must be >= 1, --warmup >= 0, --seq >= 2")
    if not cuda and args.cap_gib:
        parser.error(f"--cap-gib {args.cap_gib} caps the CUDA allocator and this machine has none: pass --cap-gib 0")
    if cuda and args.deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        parser.error("--deterministic needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (cuBLAS reads it once)")
    return args


def adapter_state(config: transformers.PretrainedConfig, arm: str, rank: int, targets: Sequence[str]) -> int:
    """Device bytes of ``arm``'s adapters at ``rank``: fp32 weights, gradients and AdamW's two moments."""
    dora = arm != "lora"
    return model_sizes(config, lora_rank=rank, targets=targets, dora=dora).trainable_bytes * STATE_PER_ADAPTER_BYTE


def estimate(config: transformers.PretrainedConfig, args: argparse.Namespace, cap: int | None) -> float:
    """Print each point's adapter state against the cap and the run's estimated wall time; return the seconds."""
    host = model_sizes(config, lora_rank=0).host_bytes(block_size=1)
    params = 2 * host  # NF4: ~0.5 bytes per parameter
    step_s = max(H2D_PER_ARENA * host / H2D_BYTES_PER_S, 8 * params * args.seq / FLOPS_PER_S)
    total = host / BUILD_BYTES_PER_S
    for rank in args.ranks:
        for arm in args.arms:
            state = adapter_state(config, arm, rank, args.targets)
            over = cap is not None and state > cap
            note = " (over the cap on adapter state alone: expect OOM)" if over else ""
            print(f"[estimate] r {rank} {arm}: adapter weights, grads and AdamW state {state / 1e9:.2f} GB{note}")
            total += ARM_SETUP_S + state / STATE_PER_ADAPTER_BYTE / ADAPTER_INIT_BYTES_PER_S
            total += 0 if over else (args.warmup + args.steps) * step_s
    print(
        f"[estimate] host arena {host / 1e9:.1f} GB, ~{step_s:.1f} s/step, whole run ~{total:.0f} s (rough: a device"
        " call is at most 600 s including the build; split --ranks over calls if it is more)",
        flush=True,
    )
    return total


def build_base(config: transformers.PretrainedConfig, base: str, device: torch.device) -> nn.Module:
    """The frozen base, seed 0: in the host arena (``arena``) or whole on ``device`` (``device``)."""
    if base == "device":
        torch.manual_seed(0)
        return random_nf4_model(config, device)
    try:
        from lightning_blockwise.loading.random_base import random_blockwise
    except ImportError as error:
        raise SystemExit(
            f"--base arena needs lightning_blockwise.loading.random_base.random_blockwise ({error}): a random-init"
            " base built layer by layer into the host arena, not in this tree yet. A base that fits under the cap"
            " can be built on the device instead: --base device."
        ) from error
    return random_blockwise(config, seed=0, device=device, share=False, progress=False)


@contextmanager
def magnitudes_on(device: torch.device) -> Iterator[None]:
    """PEFT's DoRA magnitude init (``||W + s B A||_row``) computed on ``device``, the result put back.

    PEFT computes it where the base weight lives: for a base in the host arena, a dequantization and a
    ``d_out x r x d_in`` product on the CPU for every linear, minutes at 72B and rank 384. The values are
    PEFT's, from a copy of the base layer on ``device`` (PEFT copies a 4-bit layer there anyway).
    """
    original = DoraLinearLayer.update_layer

    def update_layer(self: DoraLinearLayer, *, base_layer: nn.Module, lora_A: torch.Tensor, lora_B: torch.Tensor,
                     scaling: float, place_on_cpu: bool = False) -> None:  # fmt: skip
        home = lora_A.device
        layer = copy.deepcopy(base_layer).to(device)
        original(self, base_layer=layer, lora_A=lora_A.to(device), lora_B=lora_B.to(device), scaling=scaling)
        self.weight = nn.Parameter(self.weight.detach().to("cpu" if place_on_cpu else home), requires_grad=True)

    with mock.patch.object(DoraLinearLayer, "update_layer", update_layer):
        yield


def add_adapters(
    base: nn.Module, arm: str, rank: int, device: torch.device, targets: Sequence[str] = TARGETS
) -> tuple[nn.Module, int]:
    """``base`` with ``arm``'s adapters at ``rank`` (seed 0), and how many DoRA linears use the factored norm."""
    torch.manual_seed(0)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), use_dora=arm != "lora")
    with magnitudes_on(device):
        model = get_peft_model(base, lora)
    return model, factor_dora_norms(model) if arm == "dora_factored" else 0


class StepTimer(pl.Callback):
    """Synchronized wall time of each step after ``warmup``; the peak statistics reset when the measured steps start."""

    def __init__(self, warmup: int, device: torch.device) -> None:
        self.warmup, self.device = warmup, device
        self.times: list[float] = []

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._sync()
        if idx == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if args[-1] >= self.warmup:
            self._sync()
            self.times.append(time.perf_counter() - self._start)


def run_arm(base: nn.Module, arm: str, rank: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Train one arm on ``base`` and unload its adapters again; out of memory is a result, not an error."""
    cuda = device.type == "cuda"
    start = time.perf_counter()
    model, factored = add_adapters(base, arm, rank, device, args.targets)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gen = torch.Generator().manual_seed(0)
    vocab, count = base.config.vocab_size, args.warmup + args.steps
    ids = [torch.randint(0, vocab, (1, args.seq), generator=gen) for _ in range(count)]
    timer = StepTimer(args.warmup, device)
    strategy = BlockwiseStrategy(vram_budget=args.vram_budget, budget_tokens=args.seq)
    trainer = pl.Trainer(
        accelerator=device.type, devices=1, strategy=strategy, precision=args.precision,
        max_steps=args.warmup + args.steps, deterministic=args.deterministic, callbacks=[timer], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    row: dict[str, Any] = {"status": "ok", "error": None, "trainable_params": trainable, "factored_modules": factored}
    try:
        trainer.fit(BenchModule(model), DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=None))
    except torch.OutOfMemoryError as error:
        # Lightning tore the run down (module and optimizer state to the host) before re-raising.
        row.update(status="oom", error=str(error).splitlines()[0][:300])
    plan = strategy.residency_plan
    row.update(
        s_per_step=statistics.median(timer.times) if row["status"] == "ok" else None,
        peak_allocated_gb=torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
        peak_reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None,
        peak_scope="measured steps" if row["status"] == "ok" else "until out of memory",
        predicted_peak_gb=plan.predicted_peak / 1e9 if plan is not None else None,
        resident_blocks=len(plan.resident) if plan is not None else None,
    )  # fmt: skip
    row["tokens_per_s"] = args.seq / row["s_per_step"] if row["s_per_step"] else None
    unloaded = model.unload()
    if unloaded is not base:
        raise RuntimeError("PeftModel.unload() returned another module than the base; the next arm needs the base")
    del model, trainer, strategy, timer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        # What the arm left allocated: it should be the base's device part, the same after every arm.
        row["allocated_after_gb"] = torch.cuda.memory_allocated(device) / 1e9
    copy_ = host_copy_of(base)
    if copy_ is not None and not copy_.is_bound():
        raise RuntimeError(f"after {arm} r {rank} the base no longer reads from its host arena: the next run repacks")
    row["arm_s"] = time.perf_counter() - start
    return row


def versions() -> dict[str, str]:
    names = ("torch", "transformers", "peft", "bitsandbytes", "lightning")
    return {name: importlib.metadata.version(name) for name in names}


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cap = None
    if args.cap_gib:
        cap = int(args.cap_gib * 2**30)
        # Before anything is allocated: a 24 GB card from the process start, the base build included.
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(device).total_memory, device)
    config = CONFIGS[args.shape]()
    estimate(config, args, cap)
    start = time.perf_counter()
    base = build_base(config, args.base, device)
    build_s = time.perf_counter() - start
    print(f"[dora] {args.shape} base ({args.base}) built in {build_s:.1f} s", flush=True)
    common = {
        "shape": args.shape, "seq": args.seq, "base": args.base, "cap_gib": args.cap_gib or None,
        "vram_budget": args.vram_budget, "mode": "deterministic" if args.deterministic else "default",
        "precision": args.precision, "targets": args.targets, "steps": args.steps, "warmup": args.warmup,
        "build_s": build_s,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "versions": versions(),
    }  # fmt: skip
    rows = []
    for rank in args.ranks:
        for arm in args.arms:
            state = adapter_state(config, arm, rank, args.targets)
            if args.skip_over_cap and cap is not None and state > cap:
                result: dict[str, Any] = {"status": "skipped", "error": f"adapter state {state / 1e9:.2f} GB > cap"}
            else:
                result = run_arm(base, arm, rank, args, device)
            rows.append({**common, "arm": arm, "rank": rank, "adapter_state_gb": state / 1e9, **result})
            line = json.dumps(rows[-1])
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    print(f"\n{common['device']}, {common['mode']} mode, cap {args.cap_gib or 'none'} GiB, seq {args.seq}")
    print("| shape | rank | arm | status | s/step | tokens/s | peak allocated GB | peak reserved GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [_cell(r.get(k)) for k in ("s_per_step", "tokens_per_s", "peak_allocated_gb", "peak_reserved_gb")]
        print(f"| {r['shape']} | {r['rank']} | {r['arm']} | {r['status']} | {' | '.join(cells)} |")
    return rows


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()
