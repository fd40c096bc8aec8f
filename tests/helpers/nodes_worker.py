"""One rank of the simulated multi-node tests (tests/distributed/test_nodes.py): several arms in one process.

Run as ``python -m tests.helpers.nodes_worker OUT --checkpoint CKPT --nodes N --devices D --arms ARM ...`` in each
process of a data-parallel launch (torchrun's, or the variables it sets). Each arm is a fresh module and Trainer
(``num_nodes=N, devices=D``) over the same process group, so one launch's imports serve them all (the processes
start once: CI has two cores). Each rank writes, per arm, ``ARM/rank<R>.pt`` (losses, gradients, weights, Adam
state) and ``ARM/rank<R>.json`` (its host, the host copy it read and the ranks its watchdog watched).

Arms: ``ddp`` (``strategy="ddp"``), ``blockwise`` (checkpoints after each epoch), ``local`` (blockwise, DDP reduces
nothing: the control), ``resumed`` and ``resumed_without_rank_rng`` (from ``blockwise``'s first checkpoint; the
second without each rank's RNG states, a control), ``ddp_resumed`` (``strategy="ddp"`` from that checkpoint, each
rank's RNG states and data order put back as the strategy puts them: the reference for ``resumed``), and, on a
smaller launch, ``resumed_here``, ``ddp_resumed_here``, ``ddp_plain_resumed_here`` (as Lightning alone resumes)
and ``local_resumed_here`` (the same checkpoint on another number of processes, with the global batch kept by
``--accumulate`` and no dropout: 4 ranks' random streams cannot become 2).
The arm ``sums`` trains nothing: it all-reduces a buffer in two layouts (``sums/rank<R>.json``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.processes import host_name
from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.residency.placement import host_copy_of
from lightning_blockwise.strategy import data_parallel
from lightning_blockwise.strategy.checkpointing import CHECKPOINT_KEY
from lightning_blockwise.strategy.rank_watchdog import RankWatchdog
from tests.helpers.ddp_worker import _NoReduce, _RankSeed
from tests.helpers.models import (
    CausalLMModule,
    build_model,
    collect,
    loader,
    padded_batches,
    trainer,
    trainer_optimizer,
)

#: Micro-batches (of 2 sequences) in the data set: 4 per rank and epoch on 4 ranks (2 optimizer steps of 2).
BATCHES = 16

#: Each watchdog made in this process: the ranks it watches (same host) and those it leaves (other hosts).
_WATCHED: list[dict[str, list[int]]] = []


class _RecordingWatchdog(RankWatchdog):
    """The strategy's watchdog, recording which ranks it watches and which it leaves to the group's timeout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _WATCHED.append({"watched": [p.rank for p in self.peers], "remote": [p.rank for p in self.remote]})


class _Batches(Callback):
    """Each micro-batch this rank trains on, as a hash of its token ids (what the sampler handed it)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.seen.append(hashlib.sha256(batch["input_ids"].numpy().tobytes()).hexdigest()[:16])


class _ResumeAsTheStrategy(Callback):
    """``strategy="ddp"`` resumed as the blockwise strategy resumes: its RNG states and the next epoch's data order.

    Lightning puts back no RNG state (NOTE [ Exact resume ] in lightning_blockwise/replay/rng.py), and a run it
    resumes at an epoch's end drew the finished epoch's shuffled order again (seen on the 4 -> 2 resume: its iterator
    is made before the sampler's epoch is set; NOTE [ Loader state restored late ]). The strategy does both; without
    them DDP's resume would train on other masks or sequences, and the comparison would say nothing of training. The
    states are those the blockwise run recorded in the checkpoint both resume from: each rank its own, or rank 0's
    on another number of processes, as the strategy picks them.
    """

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        recorded = checkpoint[CHECKPOINT_KEY]
        per_rank = recorded["rng_per_rank"]
        self.state = per_rank[trainer.global_rank] if len(per_rank) == trainer.world_size else recorded["rng"]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.state is not None, "the checkpoint was not read"
        GlobalRngState.from_state_dict(self.state).restore()
        # The epoch's iterator draws its seed from the global generator and its order from the sampler's epoch: made
        # again after both, as the uninterrupted run made it (NOTE [ Loader state restored late ]).
        loop = trainer.fit_loop
        for dataloader in loop._combined_loader.flattened:
            _set_sampler_epoch(dataloader, loop.epoch_progress.current.processed)
        iter(loop._data_fetcher)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a tiny Llama checkpoint, loaded as NF4")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--arms", nargs="+", required=True)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--resume-from", type=Path, default=None, help="the run whose first checkpoint to resume")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data_parallel.RankWatchdog = _RecordingWatchdog  # type: ignore[misc]
    for arm in args.arms:
        if arm == "sums":
            _sum_orders(args.out)
            continue
        _run_arm(arm, args)
        gc.collect()  # the arm's host copy goes, and with it its claim: the next arm's owner is local rank 0 again


def _run_arm(arm: str, args: argparse.Namespace) -> None:
    out = args.out / arm
    out.mkdir(parents=True, exist_ok=True)
    here = arm.endswith("_here")
    module = CausalLMModule(lambda: _build(args.checkpoint, without_dropout=here))
    resume = _resume_path(arm, args)
    if resume is not None:
        module.strict_loading = False  # a lean checkpoint: the base comes from the checkpoint's files
    strategy: Any = DDPStrategy() if arm.startswith("ddp") else BlockwiseStrategy(vram_budget=None)
    pl.seed_everything(0, verbose=False)
    seen = _Batches()
    callbacks: list[Callback] = [_RankSeed(), seen]
    if arm == "blockwise":
        callbacks.append(ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=-1, every_n_epochs=1))
    if arm.startswith("local"):
        callbacks.append(_NoReduce())
    if arm.startswith("ddp_resumed"):
        callbacks.append(_ResumeAsTheStrategy())
    fitter = trainer(strategy, num_nodes=args.nodes, devices=args.devices, max_steps=-1,
                     max_epochs=1 if arm == "local" else 2, accumulate_grad_batches=args.accumulate,
                     enable_checkpointing=arm == "blockwise", callbacks=callbacks)  # fmt: skip
    fitter.fit(module, loader(padded_batches(BATCHES, seed=7)), ckpt_path=resume)
    rank = fitter.global_rank
    torch.save(collect(module, trainer_optimizer(module)), out / f"rank{rank}.pt")
    copy = host_copy_of(module.model.get_base_model())
    record = {
        "host": host_name(),
        "local_rank": fitter.local_rank,
        "node_rank": fitter.node_rank,
        "serving": bool(copy and copy.serving),
        "read_only": bool(copy and copy.arena.read_only),
        "arena_inode": None if copy is None else _mapped_inode(copy.arena.storage.data_ptr()),
        "watchdog": _WATCHED[-1] if arm.startswith(("blockwise", "resumed")) else None,
        "batches": seen.seen,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _sum_orders(out: Path) -> None:
    """One buffer per rank all-reduced twice, as it is and reversed: how many sums differ, over all ranks and 0 and 1.

    The all-reduce is the one DDP's buckets go through; where an element sits in the buffer decides the order in
    which the ranks' values are added (NOTE [ A resume on three ranks or more ] in strategy/data_parallel.py). The
    arm ``sums`` runs after a Trainer has set up the process group.
    """
    rank = torch.distributed.get_rank()
    values = torch.randn(8192, generator=torch.Generator().manual_seed(rank))
    pair = torch.distributed.new_group([0, 1])  # every rank takes part in making it
    record: dict[str, int] = {}
    for name, group in (("all", None), ("pair", pair)):
        if name == "pair" and rank > 1:
            continue
        here, there = values.clone(), values.flip(0)
        torch.distributed.all_reduce(here, group=group)
        torch.distributed.all_reduce(there, group=group)
        record[name] = int((here != there.flip(0)).sum())
    (out / "sums").mkdir(exist_ok=True)
    (out / "sums" / f"rank{rank}.json").write_text(json.dumps(record))


def _build(checkpoint: Path, without_dropout: bool) -> torch.nn.Module:
    model = build_model("llama", checkpoint, quantized=True, lora_dropout=0.0 if without_dropout else 0.1)
    if without_dropout:
        for sub in model.modules():
            if hasattr(sub, "attention_dropout"):
                sub.attention_dropout = 0.0
    return model


def _resume_path(arm: str, args: argparse.Namespace) -> Path | None:
    """``blockwise``'s first checkpoint for the arms that resume (a copy without the ranks' RNG for the control)."""
    if not arm.startswith(("resumed", "local_resumed", "ddp_resumed", "ddp_plain_resumed")):
        return None
    source = args.resume_from or args.out
    [first] = sorted((source / "blockwise" / "checkpoints").glob("epoch=0*.ckpt"))
    if arm != "resumed_without_rank_rng":
        return first
    checkpoint = torch.load(first, weights_only=False)
    del checkpoint[CHECKPOINT_KEY]["rng_per_rank"]
    path = args.out / arm / f"without_rank_rng_{os.environ['RANK']}.ckpt"  # each rank its own (they read at once)
    torch.save(checkpoint, path)
    return path


def _mapped_inode(address: int) -> int | None:
    """The inode of the file mapped at ``address`` in this process: a host copy's memfd (one per copy)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(bound, 16) for bound in fields[0].split("-"))
        if start <= address < end:
            return int(fields[4])
    return None


if __name__ == "__main__":
    main()
