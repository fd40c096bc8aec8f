"""One rank of a ``CausalLMFineTune`` test run with no ``adapter_dir`` (tests/recipes/test_rank_zero_export.py).

Run as ``python -m tests.helpers.finetune_worker OUT --checkpoint DIR --devices N [...]``, once per rank with the
variables torchrun sets (:func:`tests.helpers.ranks.run_ranks`), or call :func:`fit_finetune` in one process.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from safetensors.torch import load_file
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from tests.helpers.models import loader, padded_batches

#: Micro-batches of one optimizer step over all ranks: one per rank on 2 ranks, accumulated in one process.
GLOBAL_BATCHES = 2


def fit_finetune(
    out: Path,
    checkpoint: Path,
    devices: int,
    resume: Path | None = None,
    share_host_copy: bool | None = None,
    save_frozen_base: bool = False,
    seed: int = 0,
    rank_zero_data: bool = False,
) -> CausalLMFineTune:
    """Fit ``CausalLMFineTune`` for 4 optimizer steps of the same 8 batches, the adapter going to ``<log_dir>/adapter``.

    Each optimizer step sees 2 batches: one per rank on 2 ranks (Lightning's shuffling sampler deals them out), both
    accumulated in one process. ``rank_zero_data`` (control): one process, one batch a step, rank 0's share only.
    The last checkpoint is ``OUT/checkpoints/last.ckpt``.
    """
    pl.seed_everything(seed, verbose=False)
    torch.set_num_threads(1)
    module = CausalLMFineTune(str(checkpoint), lora_r=4, lora_dropout=0.0, compute_dtype="float32", warmup_steps=1)
    batches = padded_batches(8, seed=7)
    if devices == 1:
        batches = _dealt(batches, rank_zero_data)
    strategy = BlockwiseStrategy(vram_budget=None, share_host_copy=share_host_copy, save_frozen_base=save_frozen_base)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=4,
        accumulate_grad_batches=1 if rank_zero_data else GLOBAL_BATCHES // devices,
        logger=CSVLogger(out, name="logs"),
        callbacks=[ModelCheckpoint(dirpath=out / "checkpoints", save_last=True)],
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module, loader(batches), ckpt_path=resume)
    return module


def _dealt(batches: list[dict[str, Tensor]], rank_zero_only: bool) -> list[dict[str, Tensor]]:
    """``batches`` in the order one process sees them to train on the global batches of a 2-rank run.

    Lightning gives every rank of a fit a `DistributedSampler` that shuffles (seed 0); each optimizer step of the
    2 ranks reduces rank 0's next batch and rank 1's, which one process accumulates in that order. With
    ``rank_zero_only``: rank 0's shard alone.
    """
    shards = [list(DistributedSampler(batches, num_replicas=2, rank=rank, shuffle=True, seed=0)) for rank in (0, 1)]
    order = shards[0] if rank_zero_only else [index for pair in zip(*shards, strict=True) for index in pair]
    return [batches[index] for index in order]


def written_adapter(out: Path) -> dict[str, Tensor]:
    """The tensors of the one adapter a run in ``out`` exported (its ``<log_dir>/adapter``)."""
    found = sorted(out.glob("logs/version_*/adapter/adapter_model.safetensors"))
    assert len(found) == 1, f"expected one adapter under {out}/logs, found {found}"
    return load_file(found[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a tiny checkpoint without dropout")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint to resume from")
    parser.add_argument("--share-host-copy", choices=["none", "true", "false"], default="none")
    parser.add_argument("--save-frozen-base", action="store_true", help="checkpoints carry the frozen base")
    parser.add_argument(
        "--then-resume", type=Path, default=None, help="then, in this process, resume OUT's last checkpoint into this"
    )
    args = parser.parse_args()
    share = {"none": None, "true": True, "false": False}[args.share_host_copy]
    fit_finetune(args.out, args.checkpoint, args.devices, args.resume, share, args.save_frozen_base)
    if args.then_resume is not None:
        # A second launch would pay the imports again (~10 s a process on CI's two cores). The first run's module
        # and its host copy go first, on every rank, so that the resume starts as a fresh launch would.
        gc.collect()
        torch.distributed.barrier()
        last = args.out / "checkpoints" / "last.ckpt"
        fit_finetune(args.then_resume, args.checkpoint, args.devices, last, share, args.save_frozen_base)


if __name__ == "__main__":
    main()
