"""``ParityCheck``: at fit start, one training step's loss and adapter gradients, resident vs blockwise.

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
# is replaced by a fresh one of the same plan (NOTE [ Resident prefix ] in strategy.py).
# The module's own ``training_step`` runs, so its side effects are handled as far as they
# can be: ``self.log``/``self.log_dict`` calls are dropped, and the list, dict and set
# attributes of the LightningModule (e.g. a list of recorded losses) get their contents
# back. Anything else ``training_step`` changes (files, counters kept elsewhere, metric
# objects updated in place, buffers such as BatchNorm statistics) is not restored.
#
# NOTE [ Prefix parity ]
# The resident reference needs device memory the run does not: the frozen weights of the
# resident layers and a full autograd graph per layer. When that does not fit, the two
# arms run the same model and differ only in how the first k blocks execute: resident arm
# = blocks 0..k-1 resident, the rest rematerialized and streamed; blockwise arm = every
# block rematerialized and streamed. The embedding, norm, head and loss run the same way
# in both. Layers k.. compute the same function in both arms and the gradients of layers
# 0..k-1 depend on everything downstream, so ``torch.equal`` of the loss and of every
# adapter gradient still tests the replay of blocks 0..k-1 exactly (not the others).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities import CombinedLoader
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from typing_extensions import override

from lightning_blockwise.plan import parse_bytes
from lightning_blockwise.rng import GlobalRngState
from lightning_blockwise.strategy import BlockwiseStrategy

_DETERMINISM_FIX = (
    "Train with `Trainer(deterministic=True)` and set the environment variable `CUBLAS_WORKSPACE_CONFIG=:4096:8`"
)


class ParityError(RuntimeError):
    """The blockwise step differs from the resident one (raised by :class:`ParityCheck`)."""


@dataclass(frozen=True)
class TensorMismatch:
    """One tensor that differs between the arms.

    Attributes:
        name: ``"loss"`` or the adapter parameter's name (its gradient).
        max_abs_diff: Largest elementwise absolute difference (``inf`` when only one arm has a gradient).
        num_different: Elements that are not equal.
        numel: Elements in the tensor.
    """

    name: str
    max_abs_diff: float
    num_different: int
    numel: int


@dataclass
class ParityResult:
    """What a :class:`ParityCheck` compared and found.

    Attributes:
        passed: Whether the loss and every adapter gradient were ``torch.equal`` (``None``: nothing was checked).
        checked_blocks: Leading blocks that ran resident in the reference arm.
        checked_layers: Their decoder layers.
        num_blocks: Blocks in the plan.
        num_layers: Decoder layers in the model.
        num_tensors: Tensors compared (the loss and each adapter gradient).
        mismatches: The tensors that differ.
        nondeterministic: Whether the resident arm, run twice, disagreed with itself (checked on a mismatch).
        reference_bytes: Estimated device bytes the resident prefix needed beyond the run's plan.
        reference_limit: The bytes it was allowed (``None``: no limit).
        peak_vram_bytes: Peak allocated device memory during the check (``None`` off CUDA).
    """

    passed: bool | None
    checked_blocks: int
    checked_layers: int
    num_blocks: int
    num_layers: int
    num_tensors: int = 0
    mismatches: list[TensorMismatch] = field(default_factory=list)
    nondeterministic: bool = False
    reference_bytes: int = 0
    reference_limit: int | None = None
    peak_vram_bytes: int | None = None

    @property
    def full(self) -> bool:
        """Whether the whole decoder stack ran resident in the reference arm."""
        return self.checked_layers == self.num_layers

    def scope(self) -> str:
        """One sentence saying exactly what was compared."""
        if self.checked_layers == 0:
            return (
                f"Nothing was checked: not even the first block fits the reference's memory limit"
                f" ({_gb(self.reference_limit)} GB available, {_gb(self.reference_bytes)} GB needed)."
            )
        if self.full:
            return (
                f"Compared resident training of all {self.num_layers} decoder layers with blockwise training"
                f" ({self.num_tensors} tensors: the loss and every adapter gradient)."
            )
        return (
            f"Compared decoder layers 0..{self.checked_layers - 1} ({self.checked_blocks} of {self.num_blocks}"
            f" blocks) resident against blockwise; layers {self.checked_layers}..{self.num_layers - 1} ran blockwise"
            f" in both arms because the full reference does not fit ({_gb(self.reference_limit)} GB available)."
            f" {self.num_tensors} tensors compared: the loss and every adapter gradient."
        )

    def report(self) -> str:
        """The scope, the verdict and one line per differing tensor."""
        lines = [f"ParityCheck: {self.scope()}"]
        if self.passed:
            lines.append("Every tensor is bit-identical.")
        elif self.passed is False:
            lines.append(f"{len(self.mismatches)} of {self.num_tensors} tensors differ:")
            lines += [
                f"  {m.name}: max |diff| {m.max_abs_diff:.3e}, {m.num_different} of {m.numel} elements differ"
                for m in self.mismatches
            ]
            if self.nondeterministic:
                lines.append(
                    "The resident step, run twice from the same state, disagrees with itself: the hardware/software"
                    " stack is nondeterministic, so blockwise == resident is undefined here (not a replay bug)."
                    f" {_DETERMINISM_FIX}."
                )
            else:
                lines.append(
                    "The resident step reproduces itself, so the blockwise replay is broken. Please report this"
                    " with the model type, the strategy's options and this report."
                )
        if self.peak_vram_bytes is not None:
            lines.append(f"Peak allocated VRAM during the check: {_gb(self.peak_vram_bytes)} GB.")
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """The logged metrics (see :class:`ParityCheck`)."""
        metrics = {
            "parity/passed": float(bool(self.passed)),
            "parity/checked_layers": float(self.checked_layers),
            "parity/num_layers": float(self.num_layers),
            "parity/mismatches": float(len(self.mismatches)),
            "parity/nondeterministic": float(self.nondeterministic),
        }
        if self.peak_vram_bytes is not None:
            metrics["parity/peak_vram_bytes"] = float(self.peak_vram_bytes)
        return metrics

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ParityResult:
        """The inverse of :func:`dataclasses.asdict`."""
        state = dict(state)
        state["mismatches"] = [TensorMismatch(**m) for m in state.get("mismatches", [])]
        return cls(**state)


class ParityCheck(Callback):
    """Check at fit start that one blockwise training step is bit-identical to the resident one.

    Before the first training step the callback runs the module's ``training_step`` on the
    first training batch and a backward twice from the same state: once with the decoder
    layers resident (their own forward, plain autograd, weights on the device) and once
    rematerialized and streamed by :class:`~lightning_blockwise.BlockwiseStrategy`. It
    compares the loss and every adapter gradient with ``torch.equal``. On a mismatch it
    reruns the resident arm to tell a nondeterministic stack from a broken replay. The run
    afterwards is as if the check had never run (NOTE [ Parity check leaves no trace ]).
    When the resident reference does not fit, only the leading blocks that do are checked
    (NOTE [ Prefix parity ]); :meth:`ParityResult.scope` says what was checked.

    The result is logged once to every logger of the Trainer (at ``trainer.global_step``)
    and kept in the callback's state, so a resumed run does not check again unless
    ``always=True``. Logged keys:

    - ``parity/passed``: 1.0 when every tensor was equal, else 0.0 (also 0.0 when nothing fit).
    - ``parity/checked_layers`` / ``parity/num_layers``: decoder layers checked, of all.
    - ``parity/mismatches``: tensors that differ.
    - ``parity/nondeterministic``: 1.0 when the resident arm disagreed with itself.
    - ``parity/peak_vram_bytes``: peak allocated device memory during the check (CUDA only).

    Args:
        batch: The batch to check on, as the dataloader yields it (moved to the device here);
            by default the first batch of the training dataloader.
        on_mismatch: ``"raise"`` a :class:`ParityError` before any training step, or ``"warn"`` and train.
        max_reference_bytes: Cap on the extra device bytes the resident reference may use (bytes or
            ``"2GiB"``); also bounded by the free device memory and the headroom under the strategy's
            ``vram_budget``.
        always: Check even when the loaded state says a previous run already did.

    Raises:
        MisconfigurationException: If ``on_mismatch`` is unknown, the Trainer's strategy is not a
            ``BlockwiseStrategy``, or the module uses manual optimization.

    Example::

        from lightning_blockwise.callbacks.parity import ParityCheck

        trainer = Trainer(strategy="blockwise", deterministic=True, callbacks=[ParityCheck()])
        trainer.fit(module)  # raises ParityError before the first step if blockwise != resident
    """

    def __init__(
        self,
        batch: Any = None,
        on_mismatch: Literal["raise", "warn"] = "raise",
        max_reference_bytes: int | str | None = None,
        always: bool = False,
    ) -> None:
        if on_mismatch not in ("raise", "warn"):
            raise MisconfigurationException(
                f"`ParityCheck(on_mismatch={on_mismatch!r})` is not supported. Use 'raise' or 'warn'."
            )
        self.batch = batch
        self.on_mismatch = on_mismatch
        self.max_reference_bytes = None if max_reference_bytes is None else parse_bytes(max_reference_bytes)
        self.always = always
        self.result: ParityResult | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not isinstance(trainer.strategy, BlockwiseStrategy):
            raise MisconfigurationException(
                f"`ParityCheck` compares blockwise with resident training and needs `BlockwiseStrategy`, but the"
                f" Trainer uses `{type(trainer.strategy).__name__}`. Use `Trainer(strategy='blockwise')` or drop"
                " the callback."
            )
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "`ParityCheck` runs `training_step` without stepping the optimizer, which manual optimization"
                " does inside `training_step`. Drop the callback or use automatic optimization."
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.result is not None and not self.always:
            rank_zero_info(f"ParityCheck: already checked in this run's history, skipping. {self.result.scope()}")
            return
        strategy = trainer.strategy
        assert isinstance(strategy, BlockwiseStrategy)
        self.result = self._check(trainer, pl_module, strategy)
        for logger in trainer.loggers:
            logger.log_metrics(self.result.metrics(), step=trainer.global_step)
        report = self.result.report()
        if self.result.passed is False:
            if self.on_mismatch == "raise":
                raise ParityError(report)
            rank_zero_warn(report)
        elif self.result.passed is None:
            rank_zero_warn(report)
        else:
            rank_zero_info(report)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"result": None if self.result is None else asdict(self.result)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        result = state_dict.get("result")
        self.result = None if result is None else ParityResult.from_dict(result)

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule, strategy: BlockwiseStrategy) -> ParityResult:
        assert strategy.plan is not None
        device = strategy.root_device
        cuda = device.type == "cuda"
        if cuda and not torch.are_deterministic_algorithms_enabled():
            rank_zero_warn(
                "ParityCheck: deterministic algorithms are off on CUDA. At realistic shapes some backward kernels"
                " are then nondeterministic and two resident runs already differ, so a mismatch would not say"
                f" anything about the strategy. {_DETERMINISM_FIX}."
            )
        limit = self._reference_limit(strategy)
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
        with _no_trace(pl_module, device):
            start = GlobalRngState.capture()
            batch = strategy.batch_to_device(self.batch if self.batch is not None else _first_batch(trainer))
            blockwise = _step(strategy, pl_module, batch, start)
            with strategy.resident_prefix(num_blocks):
                resident = _step(strategy, pl_module, batch, start)
                result.mismatches = _compare(resident, blockwise)
                if result.mismatches:
                    result.nondeterministic = bool(_compare(resident, _step(strategy, pl_module, batch, start)))
        result.passed = not result.mismatches
        result.num_tensors = len(resident)
        if cuda:
            torch.cuda.synchronize(device)
            result.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
        return result

    def _reference_limit(self, strategy: BlockwiseStrategy) -> int | None:
        """Extra device bytes the resident reference may take, or ``None`` for no limit."""
        assert strategy.residency_plan is not None
        limits = []
        if self.max_reference_bytes is not None:
            limits.append(self.max_reference_bytes)
        if strategy.vram_budget is not None:
            limits.append(strategy.vram_budget - strategy.residency_plan.predicted_peak)
        device = strategy.root_device
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            allocated = torch.cuda.memory_allocated(device)
            cached = torch.cuda.memory_reserved(device) - allocated
            # The blockwise step itself still has to grow from what is allocated now to its planned peak.
            still_needed = max(0, strategy.residency_plan.predicted_peak - allocated)
            limits.append(max(0, free + cached - still_needed))
            # A per-process cap (`torch.cuda.set_per_process_memory_fraction`) binds the allocator before the
            # card runs out: it may hold at most `fraction * total` bytes, whatever is free on the card.
            cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
            limits.append(max(0, cap - allocated - still_needed))
        return min(limits) if limits else None


def _gb(nbytes: int | None) -> str:
    return "unlimited" if nbytes is None else f"{nbytes / 1e9:.3f}"


@contextmanager
def _no_trace(pl_module: pl.LightningModule, device: torch.device) -> Iterator[None]:
    """Put back what a check's steps change (NOTE [ Parity check leaves no trace ])."""
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


def _first_batch(trainer: pl.Trainer) -> Any:
    """The first training batch, from a fresh iterator: the loop's own iterator is never touched."""
    iterables = trainer.train_dataloader
    if iterables is None:
        raise MisconfigurationException(
            "`ParityCheck` found no training dataloader to take a batch from. Pass one with `ParityCheck(batch=...)`."
        )
    loader = CombinedLoader(iterables, mode="max_size_cycle")
    # NOTE [ Parity check leaves no trace ]: what the throwaway iterator advances is put back.
    generators = {id(g): (g, g.get_state()) for g in _generators(loader.flattened)}
    positions = [(d, d.state_dict()) for d in loader.flattened if _is_stateful(d)]
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
    return batch


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


def _compare(a: dict[str, Tensor | None], b: dict[str, Tensor | None]) -> list[TensorMismatch]:
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


__all__ = ["ParityCheck", "ParityError", "ParityResult", "TensorMismatch"]
