"""One rank of a data-parallel test run (tests/distributed): fit, then save what the run computed.

Run as ``python -m tests.helpers.ddp_worker OUT --strategy blockwise --devices N ...``, either once with no
``LOCAL_RANK`` in the environment (Lightning's launcher starts the other ranks, re-running this command) or once per
rank with ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK`` set, as torchrun does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from peft import LoraConfig, get_peft_model

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy, load_blockwise
from lightning_blockwise.callbacks import BlockwiseProfiler, ParityCheck
from lightning_blockwise.checkpointing import CHECKPOINT_KEY
from lightning_blockwise.residency.placement import host_copy_of
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
    args = parser.parse_args()
    torch.set_num_threads(1)

    build = (
        (lambda: _load(args.checkpoint))
        if args.load_blockwise
        else (lambda: build_model("llama", args.checkpoint, quantized=True, lora_dropout=0.1))
    )
    module = CausalLMModule(build)
    if args.strategy == "blockwise":
        strategy = BlockwiseStrategy(ddp_kwargs=args.ddp_kwargs)
    else:
        strategy = DDPStrategy(**args.ddp_kwargs)
    args.out.mkdir(parents=True, exist_ok=True)
    before = _arena_hash(module)
    if args.epochs is None:
        # Every rank draws 2 micro-batches per optimizer step from its shard (Lightning's DistributedSampler).
        batches = padded_batches(args.devices * 2 * args.max_steps, seed=7)
        callbacks: list[Callback] = [ParityCheck(), BlockwiseProfiler(dirpath=args.out)] if args.callbacks else []
        callbacks += [_NoReduce()] if args.no_reduce else []
        result = fit(module, strategy, batches, devices=args.devices, max_steps=args.max_steps,
                     accumulate_grad_batches=2, callbacks=callbacks)  # fmt: skip
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
    (args.out / f"rank{module.trainer.global_rank}.json").write_text(json.dumps(shared))


def _arena_hash(module: CausalLMModule) -> str | None:
    """A hash of the host arena's bytes, when the module's base came with one (`load_blockwise`)."""
    copy = host_copy_of(module.model.get_base_model())
    return None if copy is None else hashlib.sha256(copy.arena.storage.numpy().tobytes()).hexdigest()


def _load(checkpoint: Path) -> torch.nn.Module:
    """What `build_model(..., quantized=True)` builds, its base loaded by `load_blockwise` (shared by the ranks)."""
    torch.manual_seed(0)
    model = load_blockwise(checkpoint, compute_dtype=torch.float32, device="cpu", progress=False)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        target_modules=TARGETS.get("llama", DEFAULT_TARGETS),
        init_lora_weights=False,
    )
    return get_peft_model(model, lora)


class _NoReduce(Callback):
    """A DDP communication hook that leaves every rank's bucket as it is: each rank steps on its own gradients."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Unannotated: DDP compares the hook's annotations with its classes, and here they are strings.
        def local(state, bucket):
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        trainer.strategy.model.register_comm_hook(None, local)


class _RankSeed(Callback):
    """Each rank its own random numbers (dropout), so that a resume must give each its own states back."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


def _fit_epochs(module: CausalLMModule, strategy: Any, args: argparse.Namespace) -> RunResult:
    """Train ``args.epochs`` epochs of 2 optimizer steps per rank, a checkpoint after each; or resume one."""
    pl.seed_everything(0, verbose=False)
    save = ModelCheckpoint(dirpath=args.out / "checkpoints", save_top_k=-1, every_n_epochs=1, save_last=False)
    fitter = trainer(strategy, devices=args.devices, max_steps=-1, max_epochs=args.epochs, accumulate_grad_batches=2,
                     enable_checkpointing=True, callbacks=[_RankSeed(), save])  # fmt: skip
    ckpt_path = args.resume
    if ckpt_path is not None and args.drop_rank_rng:
        checkpoint = torch.load(ckpt_path, weights_only=False)
        del checkpoint[CHECKPOINT_KEY]["rng_per_rank"]
        # Each rank its own copy (they read it at once).
        ckpt_path = args.out / f"without_rank_rng_{os.environ.get('RANK', '0')}.ckpt"
        torch.save(checkpoint, ckpt_path)
    fitter.fit(module, loader(padded_batches(args.devices * 4, seed=7)), ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


if __name__ == "__main__":
    main()
