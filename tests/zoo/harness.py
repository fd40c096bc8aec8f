"""Run a zoo client under one strategy and keep everything the exactness contract compares (issue 42, item 7).

A client is a LightningModule written as public fine-tuning scripts write theirs, with nothing in it for the tests:
what a run did is recorded from outside, by a callback of the client's own Lightning namespace (a Trainer of one
namespace refuses the other's callbacks). Both arms of a comparison get the same seed, data and Trainer settings;
only the strategy differs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning.pytorch as lightning_pl
import pytorch_lightning
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from tests.helpers.models import loader, padded_batches


class _Records:
    """The recording half of :class:`Recorder` / :class:`PlRecorder`: one body, one base class per namespace."""

    def __init__(self) -> None:
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []
        self.logged: list[dict[str, Tensor]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(loss.detach().clone())
        self._log(trainer)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        # Before clipping, as `on_before_optimizer_step` sees them: what the backward produced.
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._log(trainer)

    def _log(self, trainer: Any) -> None:
        self.logged.append({k: v.detach().clone().cpu() for k, v in sorted(trainer.callback_metrics.items())})


class Recorder(_Records, lightning_pl.Callback):
    """Records losses, gradients and logged metrics of a ``lightning.pytorch`` run."""


class PlRecorder(_Records, pytorch_lightning.Callback):
    """Records losses, gradients and logged metrics of a ``pytorch_lightning`` run."""


@dataclass
class ZooRun:
    """What one run of a client leaves behind, for elementwise comparison."""

    losses: list[Tensor]
    grads: list[dict[str, Tensor]]
    weights: dict[str, Tensor]
    optimizers: list[dict[str, dict[str, Tensor]]]
    logged: list[dict[str, Tensor]]
    files: list[str]
    extra: dict[str, Any] = field(default_factory=dict)


def namespace_of(module: Any) -> Any:
    """``pytorch_lightning`` for a module written against it, else ``lightning.pytorch``."""
    return pytorch_lightning if isinstance(module, pytorch_lightning.LightningModule) else lightning_pl


def zoo_trainer(module: Any, strategy: Any, root: Path, callbacks: Sequence[Any] = (), **kwargs: Any) -> Any:
    """A Trainer of ``module``'s namespace on the CPU, writing under ``root``, recording through its first callback."""
    namespace = namespace_of(module)
    recorder = PlRecorder() if namespace is pytorch_lightning else Recorder()
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )
    settings.update(kwargs)
    return namespace.Trainer(strategy=strategy, callbacks=[recorder, *callbacks], **settings)


def zoo_fit(
    make: Callable[[], Any],
    strategy: Any,
    root: Path,
    callbacks: Sequence[Any] = (),
    batches: list[dict[str, Tensor]] | None = None,
    ckpt_path: str | None = None,
    seed: int = 0,
    **trainer_kwargs: Any,
) -> ZooRun:
    """Seed, build the client with ``make`` and fit it on 6 padded micro-batches (or ``batches``); collect the run.

    Seeded before ``make``, as a script seeds before it builds its module: PEFT draws the adapters' initial values
    from the global generator.
    """
    lightning_pl.seed_everything(seed, verbose=False)
    module = make()
    trainer = zoo_trainer(module, strategy, root, callbacks, **trainer_kwargs)
    data = zoo_data(batches)
    trainer.fit(module, data, data if trainer.limit_val_batches else None, ckpt_path=ckpt_path)
    return collect(trainer, root)


def zoo_data(batches: list[dict[str, Tensor]] | None = None) -> DataLoader:
    """The zoo's data: 6 right-padded micro-batches with -100 labels (or ``batches``), in order."""
    return loader(padded_batches(6) if batches is None else batches)


def collect(trainer: Any, root: Path, into: ZooRun | None = None) -> ZooRun:
    """The run of ``trainer`` (whose first callback recorded it), appended to ``into`` when given (a resumed run)."""
    recorder, module = trainer.callbacks[0], trainer.lightning_module
    names = {id(p): n for n, p in module.named_parameters()}
    optimizers = [
        {names[id(p)]: {k: v.clone() for k, v in opt.state[p].items()} for g in opt.param_groups for p in g["params"]}
        for opt in trainer.optimizers
    ]
    run = ZooRun(
        losses=list(recorder.losses),
        grads=list(recorder.grads),
        weights={n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad},
        optimizers=optimizers,
        logged=list(recorder.logged),
        files=sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()),
    )
    if into is None:
        return run
    return replace(run, losses=into.losses + run.losses, grads=into.grads + run.grads, logged=into.logged + run.logged)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def differences(a: ZooRun, b: ZooRun) -> list[str]:
    """The fields in which ``a`` and ``b`` differ (``torch.equal`` on every tensor; names and order too)."""
    fields = ("losses", "grads", "weights", "optimizers", "logged", "files", "extra")
    return [name for name in fields if not _equal(getattr(a, name), getattr(b, name))]


def assert_same(a: ZooRun, b: ZooRun) -> None:
    """``a`` and ``b`` are equal in every field, and no field that must hold something is empty."""
    assert a.losses and a.grads and a.weights and any(a.optimizers) and a.files, "nothing to compare"
    assert all(a.grads), "a step with no gradient"
    assert not (diff := differences(a, b)), f"the runs differ in {diff}"


def assert_sees_each_field(run: ZooRun) -> None:
    """Control of the comparison itself: one value changed in any compared field is seen as a difference."""
    for name in ("losses", "grads", "weights", "optimizers", "logged", "files"):
        changed = copy.deepcopy(run)
        if not _perturb(getattr(changed, name)):
            # Only a client that logs nothing has nothing logged to change.
            assert name == "logged", f"{name} holds nothing to compare"
            continue
        assert differences(run, changed) == [name], f"a change in {name} went unseen"


def _perturb(value: Any) -> bool:
    """Change the first tensor (or string) found in ``value``, in place; whether one was found."""
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
    for key, item in items:
        if isinstance(item, Tensor):
            value[key] = item + 1 if item.is_floating_point() else item ^ 1
            return True
        if isinstance(item, str):
            value[key] = item + "~"
            return True
        if isinstance(item, (dict, list)) and _perturb(item):
            return True
    return False
