"""The checking engine: one training step run blockwise and resident from the same state, and compared.

:class:`~lightning_blockwise.callbacks.parity.ParityCheck` runs :func:`check_step` at fit start;
what it finds is a :class:`~lightning_blockwise.verification.result.ParityResult`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy
from lightning_blockwise.verification.result import DETERMINISM_FIX, ParityResult, TensorMismatch


def check_step(
    strategy: BlockwiseStrategy, pl_module: pl.LightningModule, batch: Callable[[], Any], limit: int | None = None
) -> ParityResult:
    """Run one training step blockwise and resident from the same state and compare them with ``torch.equal``.

    The module's ``training_step`` and a backward run on the batch once rematerialized and
    streamed, and once with the leading blocks that fit ``limit`` resident (NOTE [ Prefix
    parity ]); on a mismatch the resident arm runs again to tell a nondeterministic stack from
    a broken replay. Afterwards the run is as if nothing had run (NOTE [ Parity check leaves
    no trace ]); the optimizer is never stepped.

    Args:
        strategy: The set-up strategy.
        pl_module: Its LightningModule (automatic optimization).
        batch: Returns the batch to check on, as the dataloader yields it (it is moved to the device
            here); called once, after the generators are saved, so what it draws from them is put back.
        limit: Extra device bytes the resident reference may use (``None``: no limit).

    Raises:
        MisconfigurationException: If ``training_step`` returns no loss tensor.

    Example::

        result = check_step(strategy, module, lambda: first_batch(trainer), strategy.reference_headroom())
        print(result.report())
    """
    assert strategy.plan is not None
    device = strategy.root_device
    cuda = device.type == "cuda"
    if cuda and not torch.are_deterministic_algorithms_enabled():
        rank_zero_warn(
            "ParityCheck: deterministic algorithms are off on CUDA. At realistic shapes some backward kernels"
            " are then nondeterministic and two resident runs already differ, so a mismatch would not say"
            f" anything about the strategy. {DETERMINISM_FIX}."
        )
    # NOTE [ Prefix parity ]
    # The resident reference needs device memory the run does not: the frozen weights of the
    # resident layers and a full autograd graph per layer. When that does not fit, the two
    # arms run the same model and differ only in how the first k blocks execute: resident arm
    # = blocks 0..k-1 resident, the rest rematerialized and streamed; blockwise arm = every
    # block rematerialized and streamed. The embedding, norm, head and loss run the same way
    # in both. Layers k.. compute the same function in both arms and the gradients of layers
    # 0..k-1 depend on everything downstream, so ``torch.equal`` of the loss and of every
    # adapter gradient still tests the replay of blocks 0..k-1 exactly (not the others).
    num_blocks = strategy.plan.num_blocks
    if limit is not None:
        while num_blocks > 0 and strategy.resident_prefix_bytes(num_blocks) > limit:
            num_blocks -= 1
    result = ParityResult(
        passed=None,
        checked_blocks=num_blocks,
        checked_layers=sum(len(strategy.plan.layers_of(b)) for b in range(num_blocks)),
        num_blocks=strategy.plan.num_blocks,
        num_layers=strategy.plan.num_layers,
        reference_bytes=strategy.resident_prefix_bytes(max(num_blocks, 1)),
        reference_limit=limit,
    )
    if num_blocks == 0:
        return result
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with no_trace(pl_module):
        start = GlobalRngState.capture()
        on_device = strategy.batch_to_device(batch())
        # Every block rematerialized, kept ones too: a kept layer already runs as the reference does.
        with strategy.all_rematerialized():
            blockwise = _step(strategy, pl_module, on_device, start)
        with strategy.resident_prefix(num_blocks):
            resident = _step(strategy, pl_module, on_device, start)
            result.mismatches = compare(resident, blockwise)
            if result.mismatches:
                result.nondeterministic = bool(compare(resident, _step(strategy, pl_module, on_device, start)))
    result.passed = not result.mismatches
    result.num_tensors = len(resident)
    if cuda:
        torch.cuda.synchronize(device)
        result.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
    return result


# NOTE [ Parity check leaves no trace ]
# The check runs a forward and backward twice (three times on a mismatch) before the first
# training step, and the run must then compute exactly what it would have without it. So:
# the optimizer is never stepped or touched; every parameter's ``.grad`` (``None``
# included) is saved and put back; the CPU, CUDA, Python and NumPy generators are forked
# around the check and each arm starts from the same saved state; the first batch comes
# from a fresh iterator of the training dataloader, never from the one the loop will use,
# and everything that iterator advances is put back: the generators of the loader and of
# its samplers (a shuffling loader with its own generator draws its order and base seed
# from it), and a stateful loader's position (``state_dict`` / ``load_state_dict``), so the
# loop's own iterator yields exactly the batches it would have, the checked one first;
# the modules' training flags are put back; the strategy's streamer
# is replaced by a fresh one of the same plan (NOTE [ Resident prefix ] in streamed_stack.py).
# The module's own ``training_step`` runs, so its side effects are handled as far as they
# can be: ``self.log``/``self.log_dict`` calls are dropped, and the list, dict and set
# attributes of the LightningModule (e.g. a list of recorded losses) get their contents
# back. Anything else ``training_step`` changes (files, counters kept elsewhere, metric
# objects updated in place, buffers such as BatchNorm statistics) is not restored.
@contextmanager
def no_trace(pl_module: pl.LightningModule) -> Iterator[None]:
    """Put back what steps run inside change (NOTE [ Parity check leaves no trace ]); drop their logging."""
    rng = GlobalRngState.capture()
    grads = {param: param.grad for param in pl_module.parameters()}
    modes = {module: module.training for module in pl_module.modules()}
    containers = {
        name: (value, copy.copy(value))
        for name, value in vars(pl_module).items()
        if type(value) in (list, dict, set) and not name.startswith("_")
    }

    def drop(*args: Any, **kwargs: Any) -> None:
        """Stands in for ``self.log``: Lightning refuses step logging outside the loop, and the check is no step."""

    pl_module.log = drop  # type: ignore[method-assign]
    pl_module.log_dict = drop  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
        for name, (container, contents) in containers.items():
            # In place: the module may hold other references to the same container.
            if isinstance(container, list):
                container[:] = contents
            else:
                container.clear()
                container.update(contents)
            setattr(pl_module, name, container)
        for module, training in modes.items():
            module.training = training
        for param, grad in grads.items():
            param.grad = grad
        rng.restore()


def first_batch(trainer: pl.Trainer) -> Any:
    """The first training batch, from a fresh iterator: the loop's own iterator is never touched.

    Raises:
        MisconfigurationException: If the Trainer has no training dataloader or it is empty.
    """
    iterables = trainer.train_dataloader
    if iterables is None:
        raise MisconfigurationException(
            "`ParityCheck` found no training dataloader to take a batch from. Pass one with `ParityCheck(batch=...)`."
        )
    loader = CombinedLoader(iterables, mode="max_size_cycle")
    # NOTE [ Parity check leaves no trace ]: what the throwaway iterator advances is put back.
    generators = {id(g): (g, g.get_state()) for g in _generators(loader.flattened)}
    positions = [(d, d.state_dict()) for d in loader.flattened if _is_stateful(d)]
    iterators = [(d, {k: vars(d)[k] for k in _ITERATOR_ATTRIBUTES if k in vars(d)}) for d in loader.flattened]
    try:
        batch, _, _ = next(iter(loader))
    except StopIteration:
        raise MisconfigurationException(
            "`ParityCheck`: the training dataloader is empty. Pass a batch with `ParityCheck(batch=...)`."
        ) from None
    finally:
        # Shut down this throwaway iterator's workers; the loop makes its own iterator afterwards.
        loader.reset()
        for generator, state in generators.values():
            generator.set_state(state)
        for dataloader, position in positions:
            dataloader.load_state_dict(position)
        # NOTE [ The loop's iterator stays the loader's ]
        for dataloader, attributes in iterators:
            vars(dataloader).update(attributes)
    return batch


# NOTE [ The loop's iterator stays the loader's ]
# A `StatefulDataLoader` reports its position through the iterator it made last (`_iterator`),
# which is the fit loop's when the check runs (Lightning makes it in `setup_data`). The throwaway
# iterator replaces it, and `load_state_dict` then forgets it (`_iterator = None`, the position
# kept as `next_iter_state`): every `state_dict()` of that epoch, i.e. every mid-epoch checkpoint,
# then made a fresh iterator from the saved position and recorded position 0 however far the loop
# had gone, so a resume re-trained the epoch's first batches and skipped the rest. So the loader's
# own attributes that name its iterator are put back as they were, the loop's iterator with them
# (tests/callbacks/test_parity.py, a step checkpoint of the demo's data module, with a control).
_ITERATOR_ATTRIBUTES = ("_iterator", "_initial_iter_for_state_dict", "next_iter_state")


def _generators(dataloaders: list[Any]) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a fresh iterator of these dataloaders may draw from."""
    found = []
    for dataloader in dataloaders:
        samplers = [
            getattr(dataloader, "sampler", None),
            getattr(getattr(dataloader, "batch_sampler", None), "sampler", None),
        ]
        for owner in [dataloader, *samplers]:
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator):
                found.append(generator)
    return found


def _is_stateful(dataloader: Any) -> bool:
    return callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))


def _step(
    strategy: BlockwiseStrategy, pl_module: pl.LightningModule, batch: Any, rng: GlobalRngState
) -> dict[str, Tensor | None]:
    """One forward and backward from ``rng``: the loss and each trainable parameter's gradient."""
    rng.restore()
    params = [(name, p) for name, p in pl_module.named_parameters() if p.requires_grad]
    for _, param in pl_module.named_parameters():
        param.grad = None
    output = strategy.training_step(batch, 0)
    loss = output["loss"] if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise MisconfigurationException(
            "`ParityCheck` needs `training_step` to return the loss (a tensor or a dict with 'loss') on the first"
            f" batch, got {type(output).__name__}."
        )
    loss.backward()
    tensors: dict[str, Tensor | None] = {"loss": loss.detach().clone()}
    for name, param in params:
        tensors[name] = None if param.grad is None else param.grad.detach().clone()
        param.grad = None
    return tensors


def compare(a: Mapping[str, Tensor | None], b: Mapping[str, Tensor | None]) -> list[TensorMismatch]:
    """The tensors of ``a`` that are not ``torch.equal`` to the same-named ones of ``b`` (``None`` for no gradient)."""
    mismatches = []
    for name, x in a.items():
        y = b[name]
        if x is None and y is None:
            continue
        if x is None or y is None:
            present = x if x is not None else y
            assert present is not None
            mismatches.append(TensorMismatch(name, float("inf"), present.numel(), present.numel()))
            continue
        if torch.equal(x, y):
            continue
        diff = (x.double() - y.double()).abs()
        different = x != y
        mismatches.append(TensorMismatch(name, diff.max().item(), int(different.sum().item()), x.numel()))
    return mismatches
