"""Data-parallel training through Lightning's launchers and PyTorch DDP; plain one-device training with one process."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import _distributed_is_initialized
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_blockwise.compat.lightning_namespaces import FollowsTrainer, follow
from lightning_blockwise.strategy.namespace_check import checking_launcher
from lightning_blockwise.strategy.rank_watchdog import RankWatchdog

log = logging.getLogger(__name__)
T = TypeVar("T")

# NOTE [ Data parallel, and one device as before ]
# With N processes (Trainer `devices`/`num_nodes`, torchrun, SLURM) each rank trains on its own device and PyTorch's
# DDP reducer sums the adapters' gradients, as under `strategy="ddp"`. The strategy is not a `DDPStrategy` subclass
# on purpose: the Trainer takes every `DDPStrategy` for distributed (`_AcceleratorConnector.is_distributed` is an
# isinstance check), and so, even with one device, hands its loaders a `DistributedSampler`: a shuffling loader
# would then draw another order than under `strategy="auto"`, and training on one device would no longer be
# bit-identical to resident training. Its launcher would also, with one process, write `LOCAL_RANK` and the like into
# `os.environ`, after which a second Trainer in the same process takes itself for externally launched. So this is a
# `ParallelStrategy` that is distributed only with more than one process (:attr:`is_distributed`), and for that case
# takes `DDPStrategy`'s own launcher choice, process-group setup and collectives (the methods below that are
# `DDPStrategy`'s, not copies). Processes start as scripts (Lightning's subprocess launcher, torchrun, SLURM):
# `spawn`/`fork` start methods (`ddp_spawn`, `ddp_notebook`) are not offered, since spawning pickles the module, its
# host copy of the base included, into every process, and forking needs CUDA untouched in the parent.
#
# NOTE [ Local rank 0 owns its host's copy ]
# A shared host copy is owned by the first process of its host that claims its key (NOTE [ One host copy per
# machine ] in residency/shared_arena.py). Which one that is decides who packs the base, who serves it and who may
# write it; left to timing it would differ from run to run. So the strategy packs the copy on each node's local rank
# 0 first, then, after a barrier, on the node's other ranks, which find it published and map it. Every node does
# this at once: the key is per host (NOTE [ Simulated hosts ] in compat/processes.py), so each node holds one copy,
# owned by its local rank 0, whatever the global ranks. A base loaded with `load_blockwise` is claimed as it loads,
# before any strategy runs: there the first process of the host to get there owns it.
#
# NOTE [ A resume on three ranks or more ]
# A run of 3 ranks or more resumed from a checkpoint is DDP's resumed run, not the uninterrupted run, to the last bit.
# tests/distributed/test_nodes.py resumes a 4-rank run after its first epoch under `strategy="ddp"` (each rank's
# RNG states put back) and under this strategy: the two are `torch.equal` on every rank; both train the first step
# on the uninterrupted run's losses, and both reduce other sums (measured: every adapter gradient, 3201 of 8192
# elements, by at most 3.7e-9, 1.4e-7 of the largest gradient). The cause is DDP's: the first iteration after a
# wrapper is built reduces every gradient in one bucket in parameter order (torch's
# `_BucketCapacityConfig.compute_bucket_size_limits`), later ones in buckets rebuilt in the order the gradients
# became ready, and a resume builds a new wrapper. The per-rank gradients the buckets hold are equal (recorded);
# where an element sits in the buffer decides in which order the all-reduce adds the ranks' values (gloo's ring; the
# test's `sums` arm), and over 3 ranks or more float addition is not associative. No DDP bucket setting avoids it (a
# tiny `bucket_cap_mb` still makes one first bucket); with 2 ranks `a + b == b + a`, and a 2-rank resume is exact
# (test_data_parallel.py).
#
# DDP gets only the trainable parameters: every frozen parameter and every buffer is in its
# `_ddp_params_and_buffers_to_ignore`. Otherwise it would refuse parameters on two device types (the frozen decoder
# tensors are views of the host arena), broadcast each one from rank 0 at construction (writing into the arena, and
# NCCL cannot broadcast host tensors), and broadcast buffers before every forward.


class DataParallelStrategy(FollowsTrainer, ParallelStrategy):
    """One process trains on one device; with several processes, PyTorch DDP reduces the trainable gradients.

    See NOTE [ Data parallel, and one device as before ].

    Args:
        accelerator: The accelerator (set by the Trainer when omitted).
        parallel_devices: The devices of this node's processes, one each (set by the Trainer from ``devices``).
        cluster_environment: Where the ranks come from (set by the Trainer: Lightning, torchrun, SLURM, ...).
        checkpoint_io: Passed to :class:`~lightning.pytorch.strategies.ParallelStrategy`.
        precision_plugin: Passed to :class:`~lightning.pytorch.strategies.ParallelStrategy`.
        process_group_backend: ``"nccl"``/``"gloo"``; default: NCCL on CUDA devices, gloo on CPUs.
        timeout: How long collectives wait for the other ranks.
        ddp_kwargs: Keyword arguments of :class:`~torch.nn.parallel.DistributedDataParallel` (e.g. ``bucket_cap_mb``).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Manual optimization under DDP: its reducer waits for `manual_backward` (as in DDPStrategy).
        self._forward_redirection = _DDPForwardRedirection()
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._watchdog: RankWatchdog | None = None
        #: A gloo group over the same ranks for host-side agreements (:func:`host_group`); ``None`` with one process.
        self.host_group: Any = None

    # DDPStrategy's own: node count, processes per node, the sampler's ranks, backend choice, world ranks, the process
    # group, and the collectives (each a no-op until a process group exists, as with one process).
    num_nodes = DDPStrategy.num_nodes
    num_processes = DDPStrategy.num_processes
    distributed_sampler_kwargs = DDPStrategy.distributed_sampler_kwargs
    process_group_backend = DDPStrategy.process_group_backend
    _get_process_group_backend = DDPStrategy._get_process_group_backend
    set_world_ranks = DDPStrategy.set_world_ranks
    setup_distributed = DDPStrategy.setup_distributed
    determine_ddp_device_ids = DDPStrategy.determine_ddp_device_ids
    barrier = DDPStrategy.barrier
    broadcast = DDPStrategy.broadcast
    reduce = DDPStrategy.reduce
    pre_backward = DDPStrategy.pre_backward

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's device: its local rank's entry of ``parallel_devices`` (the CPU until they are known)."""
        if not self.parallel_devices:
            return torch.device("cpu")
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def accelerator(self) -> Accelerator | None:
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        # The connector's first write, before any other use: a Trainer of the other Lightning namespace turns an
        # instance built from this one into its twin here (NOTE [ Two Lightning namespaces ]).
        follow(self, accelerator)
        self._accelerator = accelerator

    @property
    def is_distributed(self) -> bool:
        """Whether the run has more than one process (the Trainer asks before giving loaders a DistributedSampler)."""
        return self.num_nodes * self.num_processes > 1

    @override
    def _configure_launcher(self) -> None:
        # The Trainer calls this once the devices are known: the last moment before any process or model work.
        assert self.cluster_environment is not None
        if self.is_distributed and self._process_group_backend == "nccl" and self.root_device.type != "cuda":
            raise MisconfigurationException(
                f"`{type(self).__name__}(process_group_backend='nccl')` with {self.root_device.type} devices: NCCL"
                " reduces CUDA tensors only. Train on GPUs (`accelerator='gpu'`), or leave `process_group_backend`"
                " unset (gloo on CPUs)."
            )
        self._launcher = (
            _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            if self.is_distributed
            else None
        )
        # Every Trainer function goes through the launcher first: what it runs with is checked there for objects of
        # the other Lightning namespace (NOTE [ Two Lightning namespaces ]).
        self._launcher = checking_launcher(self, self._launcher)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if self.is_distributed:
            self.setup_distributed()
            self.host_group = host_group()
            # NOTE [ A dead rank ends the run ] in rank_watchdog.py.
            self._watchdog = RankWatchdog(self._timeout)

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting and self.is_distributed:
            self.model = self._wrap_in_ddp(self.model)
        elif self.is_distributed:
            # Every rank loaded the same weights; only what training changes could differ.
            _broadcast_trainable(self.model)
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def local_rank_zero_first(self, work: Callable[[], T], ordered: bool = True) -> T:
        """``work()`` on every rank, done by each host's local rank 0 before the host's other ranks start it.

        NOTE [ Local rank 0 owns its host's copy ]: the first process of a host to claim a shared host copy owns it
        (packs and serves it); ordering the claims makes that one each node's local rank 0, whatever the timing.

        Args:
            work: What every rank does, once.
            ordered: ``False``: all ranks at once (nothing shared, so nothing to order).
        """
        if not self.is_distributed or not ordered:
            return work()
        done = work() if self.local_rank == 0 else None
        self.barrier("local rank 0 first")
        return work() if self.local_rank != 0 else done  # type: ignore[return-value]

    def _wrap_in_ddp(self, module: nn.Module) -> DistributedDataParallel:
        """``module`` in :class:`~torch.nn.parallel.DistributedDataParallel`, which sees its trainable parameters."""
        ignored = [name for name, param in module.named_parameters() if not param.requires_grad]
        ignored += [name for name, _ in module.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
        device_ids = self.determine_ddp_device_ids()
        # As DDPStrategy does: DDP's constructor runs collectives, kept off the default stream
        # (https://pytorch.org/docs/stable/notes/cuda.html#id5).
        context = torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext()
        with context:
            return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    @override
    def on_exception(self, exception: BaseException) -> None:
        # NOTE [ Per host, and global ] in rank_watchdog.py: a failed collective with every rank of this host alive
        # means a rank of another host stopped, which no watchdog here could see; say so before the error.
        # A rank of this host that died is named in the watchdog's words (gloo's own error often comes first).
        watchdog = self._watchdog
        message = None if watchdog is None else watchdog.local_failure(exception) or watchdog.remote_failure(exception)
        if message is not None:
            log.error(message)
            print(message, file=sys.stderr, flush=True)

    @override
    def teardown(self) -> None:
        if self._watchdog is not None:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
            self._watchdog.finish(succeeded=trainer is not None and not trainer.interrupted)
            self._watchdog = None
        module = self.lightning_module
        if isinstance(self.model, DistributedDataParallel):
            self.model = module
        if module is not None and module._trainer is not None and self._layer_sync:
            if module._trainer.state.fn == TrainerFn.FITTING:
                self.model = self._layer_sync.revert(self.model)
        if self.host_group is not None:
            torch.distributed.destroy_process_group(self.host_group)
            self.host_group = None
        super().teardown()
        if self.root_device.type == "cuda":
            torch.cuda.empty_cache()


def host_group() -> Any:
    """A gloo process group over every rank, for small agreements on host values; ``None`` if the default is gloo.

    The step planner agrees on each step's tokens and on the host memory free (NOTE [ Where layer inputs wait ] in
    planning/input_choice.py): through NCCL that would be a CUDA tensor read back before every step, a wait for the
    GPU's queue. A CPU tensor through gloo leaves the queue running. Every rank creates it at the same point (setup).
    """
    if torch.distributed.get_backend() == "gloo":
        return None
    return torch.distributed.new_group(backend="gloo")


def _broadcast_trainable(module: nn.Module) -> None:
    """Rank 0's trainable parameters into every rank's (outside fitting, where no DDP wrapper syncs them)."""
    if not _distributed_is_initialized():
        return
    for param in module.parameters():
        if param.requires_grad:
            torch.distributed.broadcast(param.data, src=0)


__all__ = ["DataParallelStrategy", "host_group"]
