"""One rank of a data-parallel test run (tests/distributed): fit, then save what the run computed.

Run as ``python -m tests.helpers.ddp_worker OUT --strategy blockwise --devices N ...``, either once with no
``LOCAL_RANK`` in the environment (Lightning's launcher starts the other ranks, re-running this command) or once per
rank with ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK`` set, as torchrun does.

``python -m tests.helpers.ddp_worker --arms ARMS.json`` (launched once per rank) runs several arms in turn in one
process over one process group: ARMS.json maps each arm's name to its arguments as above, in the order to run them.
Each arm is a fresh module, strategy and Trainer; between arms every rank lets go of its host copy and waits for the
others, so the next arm starts as a fresh launch would. One launch's imports (about 10 s a process on a loaded CI
machine) then serve every arm of a test file.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy, load_blockwise
from lightning_blockwise.callbacks import BlockwiseProfiler, ParityCheck
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.planning import step_budget
from lightning_blockwise.replay import block_major
from lightning_blockwise.residency.placement import host_copy_of
from lightning_blockwise.strategy import data_parallel
from lightning_blockwise.strategy.checkpointing import CHECKPOINT_KEY
from lightning_blockwise.strategy.rank_watchdog import RankWatchdog
from tests.helpers.models import (
    DEFAULT_TARGETS,
    TARGETS,
    CausalLMModule,
    RunResult,
    build_model,
    collect,
    fit,
    loader,
    padded_batches,
    trainer,
    trainer_optimizer,
)


def main() -> None:
    torch.set_num_threads(1)
    block_major.differentiate_window = _recorded_window  # type: ignore[assignment]
    if sys.argv[1:2] != ["--arms"]:
        run_arm(_parser().parse_args())
        return
    arms: dict[str, list[str]] = json.loads(Path(sys.argv[2]).read_text())
    for argv in arms.values():
        run_arm(_parser().parse_args(argv))
        # The arm's module is gone: its host copy goes with it, and with it its claim (the next arm's owner is local
        # rank 0 again); no rank starts the next arm while another still holds this one's copy.
        gc.collect()
        torch.distributed.barrier()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a tiny Llama checkpoint, loaded as NF4")
    parser.add_argument("--strategy", choices=["blockwise", "ddp"], required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--ddp-kwargs", type=json.loads, default={}, help="JSON keyword arguments of DDP")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=None, help="train this many epochs of 2 steps (not max-steps)")
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint to resume from")
    parser.add_argument("--drop-rank-rng", action="store_true", help="control: resume without the ranks' own RNG")
    parser.add_argument("--load-blockwise", action="store_true", help="load the base with load_blockwise (shared)")
    parser.add_argument("--callbacks", action="store_true", help="ParityCheck and BlockwiseProfiler on every rank")
    parser.add_argument("--no-reduce", action="store_true", help="control: DDP reduces nothing (local gradients)")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lora-dropout", type=float, default=0.1, help="the adapters' dropout")
    parser.add_argument(
        "--block-major", action="store_true", help="blockwise with block_major_accumulation=True (needs dropout 0)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="one GPU per rank: NF4 with bf16 compute, bf16-mixed, deterministic, seq 512"
    )
    parser.add_argument("--die-at-batch", type=int, default=None, help="rank 1 SIGKILLs itself before this backward")
    parser.add_argument(
        "--kept-attention-budget", type=int, default=None,
        help="blockwise under this vram_budget, with no FLOPs floor on kept attention (tiny layers)",
    )  # fmt: skip
    parser.add_argument("--no-watchdog", action="store_true", help="control: no rank watchdog (a collective waits)")
    return parser


def run_arm(args: argparse.Namespace) -> None:
    """Fit one arm on this rank; save its run to ``OUT/rank<R>.pt`` and its host copy and windows to ``.json``."""
    data_parallel.RankWatchdog = _NoWatchdog if args.no_watchdog else RankWatchdog  # type: ignore[misc]
    if args.resume is not None and args.resume.is_dir():
        # A directory: the one first-epoch checkpoint an earlier arm of this launch wrote there.
        [args.resume] = sorted(args.resume.glob("epoch=0*.ckpt"))

    if args.gpu:
        device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        build = lambda: _gpu_build(args.checkpoint, args.load_blockwise, device, args.lora_dropout)  # noqa: E731
    else:
        build = (
            (lambda: _load(args.checkpoint, args.lora_dropout))
            if args.load_blockwise
            else (lambda: build_model("llama", args.checkpoint, quantized=True, lora_dropout=args.lora_dropout))
        )
    module = CausalLMModule(build)
    if args.strategy == "blockwise":
        # NOTE [ Kept attention ]: the tiny layers' attention is far under the floor a real card needs (this arm only).
        step_budget.KEPT_ATTENTION_MIN_FLOPS = 0 if args.kept_attention_budget is not None else _FLOPS_FLOOR
        strategy = BlockwiseStrategy(
            vram_budget=args.kept_attention_budget, ddp_kwargs=args.ddp_kwargs,
            block_major_accumulation=args.block_major,
        )  # fmt: skip
    else:
        strategy = DDPStrategy(**args.ddp_kwargs)
    args.out.mkdir(parents=True, exist_ok=True)
    before = _arena_hash(module)
    _WINDOWS.clear()
    if args.epochs is None:
        # Every rank draws its micro-batches of each optimizer step from its shard (Lightning's DistributedSampler).
        count = args.devices * args.accumulate * args.max_steps
        batches = (
            padded_batches(count, batch_size=1, seq=512, vocab=32000, seed=7)
            if args.gpu
            else padded_batches(count, seed=7)
        )
        callbacks: list[Callback] = [ParityCheck(), BlockwiseProfiler(dirpath=args.out)] if args.callbacks else []
        callbacks += [_NoReduce()] if args.no_reduce else []
        callbacks += _die(args)
        result = fit(module, strategy, batches, devices=args.devices, max_steps=args.max_steps,
                     accumulate_grad_batches=args.accumulate, callbacks=callbacks, **_device_kwargs(args))  # fmt: skip
        if args.callbacks:
            check = callbacks[0].result
            record = {"passed": check is not None and check.passed, "profiled": bool(callbacks[1].summary)}
            (args.out / f"callbacks{module.trainer.global_rank}.json").write_text(json.dumps(record))
    else:
        result = _fit_epochs(module, strategy, args)
    torch.save(result, args.out / f"rank{module.trainer.global_rank}.pt")
    copy = host_copy_of(module.model.get_base_model())
    shared = {"read_only": bool(copy and copy.arena.read_only), "serving": bool(copy and copy.serving)}
    shared["unchanged"] = before is not None and _arena_hash(module) == before
    plan = getattr(strategy, "step_plan", None)
    shared["attention"] = [] if plan is None else list(plan.residency.attention)
    (args.out / f"rank{module.trainer.global_rank}.json").write_text(json.dumps({**shared, "windows": _WINDOWS}))


_FLOPS_FLOOR = step_budget.KEPT_ATTENTION_MIN_FLOPS

#: Each block-major window backward of the arm, in order: whether it fired the adapters' hooks once (DDP's).
_WINDOWS: list[bool] = []
_differentiate_window = block_major.differentiate_window


def _recorded_window(*args: Any, hooks_once: bool = False, **kwargs: Any) -> None:
    _WINDOWS.append(hooks_once)
    _differentiate_window(*args, hooks_once=hooks_once, **kwargs)


def _arena_hash(module: CausalLMModule) -> str | None:
    """A hash of the host arena's bytes, when the module's base came with one (`load_blockwise`)."""
    copy = host_copy_of(module.model.get_base_model())
    return None if copy is None else hashlib.sha256(copy.arena.storage.numpy().tobytes()).hexdigest()


def _device_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer's device settings: the CPU defaults, or a GPU per rank in deterministic bf16-mixed."""
    return dict(accelerator="gpu", precision="bf16-mixed", deterministic=True) if args.gpu else {}


def _load(checkpoint: Path, dropout: float) -> torch.nn.Module:
    """What `build_model(..., quantized=True)` builds, its base loaded by `load_blockwise` (shared by the ranks)."""
    torch.manual_seed(0)
    model = load_blockwise(checkpoint, compute_dtype=torch.float32, device="cpu", progress=False)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules=TARGETS.get("llama", DEFAULT_TARGETS),
        init_lora_weights=False,
    )
    return get_peft_model(model, lora)


def _gpu_build(checkpoint: Path, shared: bool, device: str, dropout: float) -> torch.nn.Module:
    """A GPU rank's model: the checkpoint as NF4 with bf16 compute, LoRA r=16 on every projection, ``dropout``.

    ``shared``: the base loaded by `load_blockwise` (one host copy for the ranks), else by `from_pretrained` on
    ``device`` (what `strategy="ddp"` trains). The adapters are drawn from a CPU generator either way, so both
    builds start from the same numbers wherever PEFT creates the adapters' tensors.
    """
    if shared:
        model = load_blockwise(checkpoint, compute_dtype=torch.bfloat16, device=device, progress=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=nf4_config(torch.bfloat16), device_map=device
        ).train()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=DEFAULT_TARGETS)
    model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, param in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return model


class _NoReduce(Callback):
    """A DDP communication hook that leaves every rank's bucket as it is: each rank steps on its own gradients."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Unannotated: DDP compares the hook's annotations with its classes, and here they are strings.
        def local(state, bucket):
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        trainer.strategy.model.register_comm_hook(None, local)


class _DieAt(Callback):
    """Rank 1 kills itself (SIGKILL) just before the backward of its ``batch``-th micro-batch of the run."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.seen = 0

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.seen += 1
        if trainer.global_rank == 1 and self.seen == self.batch:
            os.kill(os.getpid(), signal.SIGKILL)


def _die(args: argparse.Namespace) -> list[Callback]:
    return [_DieAt(args.die_at_batch)] if args.die_at_batch is not None else []


class _NoWatchdog:
    """Control: a watchdog that watches nothing, so a dead rank leaves the others in the collective."""

    def __init__(self, timeout: object) -> None:
        pass

    def finish(self, succeeded: bool) -> None:
        pass


class _RankSeed(Callback):
    """Each rank its own random numbers (dropout), so that a resume must give each its own states back."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


def _fit_epochs(module: CausalLMModule, strategy: Any, args: argparse.Namespace) -> RunResult:
    """Train ``args.epochs`` epochs of 2 optimizer steps per rank, a checkpoint after each; or resume one."""
    pl.seed_everything(0, verbose=False)
    save = ModelCheckpoint(dirpath=args.out / "checkpoints", save_top_k=-1, every_n_epochs=1, save_last=False)
    fitter = trainer(strategy, devices=args.devices, max_steps=-1, max_epochs=args.epochs, accumulate_grad_batches=2,
                     enable_checkpointing=True, callbacks=[_RankSeed(), save, *_die(args)],
                     **_device_kwargs(args))  # fmt: skip
    ckpt_path = args.resume
    if ckpt_path is not None and args.drop_rank_rng:
        checkpoint = torch.load(ckpt_path, weights_only=False)
        del checkpoint[CHECKPOINT_KEY]["rng_per_rank"]
        # Each rank its own copy (they read it at once).
        ckpt_path = args.out / f"without_rank_rng_{os.environ.get('RANK', '0')}.ckpt"
        torch.save(checkpoint, ckpt_path)
    count = args.devices * 4
    batches = (
        padded_batches(count, batch_size=1, seq=512, vocab=32000, seed=7) if args.gpu else padded_batches(count, seed=7)
    )
    fitter.fit(module, loader(batches), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


if __name__ == "__main__":
    main()
