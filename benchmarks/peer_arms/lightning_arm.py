"""This package's arms (``ours``, ``resident``) and transformers + PEFT (``peft``): one arm, its points, one process.

The model is built once (random-init NF4 of a Qwen2.5 shape, LoRA r=16 on the seven projections, as
benchmarks/step_benchmark.py builds it) and trained through ``Trainer.fit`` at each point, shortest first::

    python -m benchmarks.peer_arms.lightning_arm --arm ours+liger --shape 7b --points random:4096x1 rows:4096x2 \
        --out rows.jsonl [--cap-gib 22] [--steps N] [--budget-for random:4096x1=7540000000] [--profile]

``ours`` is ``BlockwiseStrategy`` with its defaults (plus the arm's options); ``resident`` is ``strategy="auto"``
without checkpointing (the compute floor); ``peft`` is ``strategy="auto"`` with Hugging Face's gradient
checkpointing (non-reentrant), as a transformers + PEFT QLoRA user runs it. Every arm takes the chunked loss
unless it says ``hfloss``.

``--profile`` trains one extra step after the timed ones at each point and profiles it (:class:`Timer`); that step
is not in the median, nor in the losses, so the row reads as without it, plus the fields of
``measure.step_profile``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.load_benchmark import qwen2_config
from benchmarks.peer_arms import measure
from benchmarks.peer_arms.gaps import gap_report
from benchmarks.peer_arms.spec import SYSTEM_NAMES, TILE_TOKENS, UNSLOTH_BUDGET, Arm, Point, parse_arm, parse_point
from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from lightning_blockwise.longcontext.tiling import tile_mlps
from lightning_blockwise.planning.step_budget import StepBudget
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.strategy import run as strategy_run

#: Shapes beside step_benchmark.SHAPES (not added there): ``tiny`` for the CPU tests (two Qwen2 layers, a vocabulary
#: above the byte tokenizer's 259 ids), ``0.5b`` for a GPU smoke run of every arm in minutes (the Qwen2.5-0.5B shape
#: load_benchmark.py writes for Unsloth, so both sides train the same shape).
EXTRA_SHAPES: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "tiny": lambda: transformers.Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, max_position_embeddings=8192,
    ),
    "0.5b": lambda: transformers.Qwen2Config(
        **{k: v for k, v in qwen2_config("0.5b").items() if k not in ("architectures", "model_type", "dtype")}
    ),
}  # fmt: skip
#: The shipped instruction data (packed into rows for the ``rows:`` points).
DATA = Path(__file__).resolve().parents[2] / "data" / "instructions.jsonl"


class PeerModule(pl.LightningModule):
    """Trains ``model`` with the chunked loss (``chunk`` rows of logits at a time) or, ``chunk=None``, HF's.

    It declares both, and the MLP tile (``tile``, applied to the model by the arm), to the planner.
    """

    def __init__(self, model: nn.Module, chunk: int | None, tile: int | None = None) -> None:
        super().__init__()
        self.model = model
        self.chunk = chunk
        # What the strategy's planner reads (NOTE [ Chunked loss ], NOTE [ Tiled MLP ]): undeclared, it plans for
        # Hugging Face's loss, N x V logits in fp32 several times over (35 GB at 16k tokens), and refuses or
        # streams what fits.
        self.loss_chunk_tokens = chunk
        self.mlp_tile_tokens = tile

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.chunk is None:
            return self.model(**batch).loss
        return chunked_causal_lm_loss(self.model, chunk_tokens=self.chunk, **batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-5)


class Timer(pl.Callback):
    """Each step's wall time after ``warmup`` steps (synchronized on a GPU), the peaks reset after the warm-up.

    With ``profile_step`` (the index of an extra step after the timed ones) that step runs under
    ``measure.profiler`` instead, from its batch's start to its end after a device synchronize (so the side streams'
    work is in), and :attr:`profile` holds ``measure.step_profile`` of it and its wall time (``profiled_step_s``,
    the profiler's overhead in); it is neither timed nor in the losses, and :attr:`peaks` are the peaks before it.
    """

    def __init__(self, warmup: int, device: torch.device, profile_step: int | None = None, gaps: bool = False) -> None:
        self.warmup, self.device, self.profile_step, self.gaps = warmup, device, profile_step, gaps
        self.times: list[float] = []
        self.losses: list[float] = []
        self.profile: dict[str, Any] | None = None
        self.peaks: dict[str, float | None] | None = None
        self._profiler: torch.profiler.profile | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx == self.warmup:
            measure.reset_peaks(self.device)
        if idx == self.profile_step:
            measure.now(self.device)  # the batch's copy (a side stream's) done first: the profile is the step's
            self.peaks = measure.peaks(self.device)
            self._profiler = measure.profiler(self.device, host=self.gaps)
            self._profiler.start()
        self._start = measure.now(self.device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        end = measure.now(self.device)
        if self._profiler is not None:
            self._profiler.stop()
            self.profile = {**measure.step_profile(self._profiler), "profiled_step_s": round(end - self._start, 4)}
            if self.gaps:
                with tempfile.TemporaryDirectory() as folder:
                    trace = Path(folder) / "step.json"
                    self._profiler.export_chrome_trace(str(trace))
                    self.profile["gaps"] = gap_report(json.loads(trace.read_text()))
            self._profiler = None
            return
        if args[-1] >= self.warmup:
            self.times.append(end - self._start)
        self.losses.append(float(outputs["loss"]))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # A step that failed while profiled leaves the profiler on, and the next point could not start its own.
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None


def build(arm: Arm, shape: str, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """The arm's model, once per process, and the settings it was built with."""
    torch.manual_seed(0)
    config = {**SHAPES, **EXTRA_SHAPES}[shape]()
    model = get_peft_model(random_nf4_model(config, device), LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))
    settings: dict[str, Any] = {"lora": "r16 alpha32 dropout0 q,k,v,o,gate,up,down", "base": "random-init NF4"}
    if "liger" in arm.options:
        try:
            from lightning_blockwise.kernels import use_liger_kernels  # type: ignore[attr-defined]
        except ImportError as error:
            raise RuntimeError(
                f"arm {arm.name}: lightning_blockwise.kernels.use_liger_kernels is not importable here ({error})"
            ) from error
        use_liger_kernels(model)
        settings["liger"] = "use_liger_kernels(model): its defaults (RMSNorm, RoPE, SwiGLU)"
    if "fused" in arm.options:
        from lightning_blockwise.kernels.fused_lora import use_fused_lora

        settings["fused_lora"] = f"use_fused_lora(model): {use_fused_lora(model)} LoRA linears"
    attention = model.config._attn_implementation
    kernels = "+".join(name for name in ("liger", "fused") if name in arm.options) or "transformers"
    settings["kernels"] = f"{kernels} ({attention} attention)"
    tile = arm.options.get("tiled")
    if tile is not None:
        settings["tiled_mlp_tokens"] = TILE_TOKENS if tile is True else int(tile)
        tile_mlps(model, settings["tiled_mlp_tokens"])
    if arm.system == "peft":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    settings["checkpointing"] = {
        "ours": "blockwise replay (BlockwiseStrategy)",
        "resident": "none",
        "peft": "HF gradient checkpointing, use_reentrant=False",
    }[arm.system]
    settings["loss"] = arm.loss
    settings["mode"] = "deterministic" if "det" in arm.options else "default"
    return model, settings


def batches(point: Point, count: int, vocab: int) -> list[dict[str, Any]]:
    """``count`` batches of ``point``: random ids (labels = ids), or the shipped data packed into rows, cycled."""
    if point.data == "random":
        gen = torch.Generator().manual_seed(point.tokens)
        ids = torch.randint(0, vocab, (count, point.batch, point.tokens), generator=gen)
        return [{"input_ids": row, "labels": row} for row in ids]
    from lightning_blockwise.recipes.data import InstructionDataModule

    data = InstructionDataModule(str(DATA), max_length=point.tokens, batch_size=point.batch, val_fraction=0,
                                 packing=True)  # fmt: skip
    data.setup("fit")
    if data.vocab_size > vocab:
        raise ValueError(f"the byte tokenizer's {data.vocab_size} ids do not fit the model's vocabulary of {vocab}.")
    return list(itertools.islice(itertools.cycle(data.train_dataloader()), count))


def strategy_for(arm: Arm, point: Point, budgets: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """The arm's strategy at ``point`` and the options it was given (the budget resolved for --equal-memory)."""
    if arm.system != "ours":
        return "auto", {"strategy": "auto"}
    options: dict[str, Any] = {}
    if "offload" in arm.options:
        options["offload_activations"] = True
    budget = arm.budget
    if budget == UNSLOTH_BUDGET:
        budget = budgets[point.key]  # the driver gives one for every point it runs this arm at
    if budget is not None:
        options["vram_budget"] = int(budget) if budget.isdigit() else budget
    if "noattn" in arm.options:
        _keep_no_attention()
    return BlockwiseStrategy(**options), {"strategy": "blockwise", "strategy_options": options}


def _keep_no_attention() -> None:
    """Plans in this process keep no attention outputs: the arm that measures NOTE [ Kept attention ]'s gain."""
    if getattr(strategy_run.module_budget, "keeps_no_attention", False):
        return
    build = strategy_run.module_budget

    def without(*args: Any, **kwargs: Any) -> StepBudget:
        return dataclasses.replace(build(*args, **kwargs), keep_attention=False)

    without.keeps_no_attention = True  # type: ignore[attr-defined]
    strategy_run.module_budget = without


def run_point(model: nn.Module, arm: Arm, point: Point, args: argparse.Namespace, device: torch.device) -> dict:
    """Time ``arm`` at ``point``: the row's measured fields (an OOM is a result, not a crash)."""
    steps, warmup = point.steps(args.steps)
    extra = int(args.profile)  # the profiled step, after the timed ones
    chunk = None if arm.loss == "hf" else int(arm.loss.split(":")[1])
    timer = Timer(warmup, device, profile_step=warmup + steps if args.profile else None, gaps=args.profile_gaps)
    row: dict[str, Any] = {"steps": steps, "warmup": warmup}
    strategy: Any = None
    model.to(device)  # a blockwise run leaves the base in host memory
    measure.reset_peaks(device)
    try:  # the strategy's and the data's refusals are this point's result too
        strategy, row["strategy"] = strategy_for(arm, point, args.budgets)
        data = batches(point, steps + warmup + extra, model.config.vocab_size)
        measured = data[: steps + warmup]  # a rows: point's extra batch may pad otherwise: the mean is as without it
        row["step_tokens_mean"] = sum(int(b["input_ids"].numel()) for b in measured) / len(measured)
        trainer = pl.Trainer(
            accelerator=device.type if device.type == "cpu" else "gpu", devices=1, strategy=strategy,
            precision="bf16-mixed", max_steps=steps + warmup + extra, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
            deterministic="det" in arm.options,
        )  # fmt: skip
        tile = arm.options.get("tiled")
        tile = None if tile is None else TILE_TOKENS if tile is True else int(tile)
        trainer.fit(PeerModule(model, chunk, tile), DataLoader(data, batch_size=None))
    except Exception as error:  # an OOM is a measurement; anything else is recorded and the next point runs
        if not (args.profile and len(timer.times) == steps):
            row.update(measure.failure(error), steps_done=len(timer.losses))
        else:  # only the profiled step failed: the timed ones stand
            row["profile_error"] = measure.failure(error)["error"]
    if "status" not in row:
        row["status"] = "ok"
        row.update(measure.timing(timer.times, row["step_tokens_mean"]), loss_first=timer.losses[0],
                   loss_last=timer.losses[-1])  # fmt: skip
    if timer.profile is not None:
        row.update(timer.profile, profiled_step=warmup + steps)
    row.update(measure.peaks(device))
    row.update(timer.peaks or {})  # the timed steps' peaks: the profiled one's, profiler on, left out
    plan = getattr(strategy, "step_plan", None)
    if plan is not None:
        row.update(predicted_peak_gb=plan.residency.predicted_peak / measure.GB, offload=plan.offload,
                   resident_blocks=len(plan.residency.resident), kept_blocks=len(plan.residency.kept),
                   attention_blocks=len(plan.residency.attention),
                   input_checkpoint_every=plan.shape.checkpoint_every)  # fmt: skip
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", type=parse_arm, required=True)
    parser.add_argument("--shape", choices=sorted({*SHAPES, *EXTRA_SHAPES}), required=True)
    parser.add_argument("--points", nargs="+", type=parse_point, required=True)
    parser.add_argument("--out", type=Path, required=True, help="append one JSON line per point here")
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps at every point (default: by length)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--budget-for", nargs="*", default=[], help="POINT=BYTES: budget=unsloth's budget per point")
    parser.add_argument("--profile", action="store_true", help="profile one extra step per point (not timed)")
    parser.add_argument(
        "--profile-gaps", action="store_true",
        help="with --profile: CPU activity on too, and the step's GPU idle gaps by cause (peer_arms/gaps.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.arm.system == "unsloth":
        parser.error("--arm unsloth runs in benchmarks.peer_arms.unsloth_arm, not here.")
    args.budgets = dict(item.split("=", 1) for item in args.budget_for)
    if "det" in args.arm.options:  # before the first cuBLAS handle: deterministic GEMMs need a fixed workspace
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    head: dict[str, Any] = {"system": SYSTEM_NAMES[args.arm.system], "arm": args.arm.name, "shape": args.shape}
    head["settings"] = measure.cap_allocator(device, args.cap_gib)
    head.update(device=measure.device_name(device), versions=measure.versions())
    points = sorted(args.points)
    try:
        model, settings = build(args.arm, args.shape, device)
    except Exception as error:  # each point says why it has no measurement (an OOM while building is one)
        for p in points:
            measure.emit({**head, **measure.where(p), **measure.failure(error), "phase": "build"}, args.out)
        return
    head["settings"].update(settings, precision="bf16-mixed", optimizer="AdamW lr 1e-5", loop="Trainer.fit")
    measure.run_points(points, head, args.out, lambda p: run_point(model, args.arm, p, args, device))


if __name__ == "__main__":
    main()
