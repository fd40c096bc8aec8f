"""Zoo: callbacks and hooks that observe the model: ``ModelSummary``, ``DeviceStatsMonitor``, forward hooks, and
accelerate's ``add_hook_to_module`` (issue 42, item 5).

The observing client is fitted under ``strategy="auto"`` and ``strategy="blockwise"`` from one seed and compared in
every loss, gradient, trained tensor, optimizer state, logged metric and file name (tests/zoo/harness.py), and in
what each observer produced. accelerate's hooks replace a module's ``forward``, which a rematerialized layer runs
twice per step (NOTE [ accelerate's hooks replace forward ] in compat/accelerate.py): refused, with the fix.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from lightning.pytorch.callbacks import DeviceStatsMonitor, ModelSummary
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.zoo.harness import assert_same, assert_sees_each_field, zoo_data, zoo_fit, zoo_trainer
from tests.zoo.test_training_loops import PlainLoRA


def _observed(module: PlainLoRA) -> tuple[nn.Module, nn.Module]:
    """The modules the observers watch: decoder layer 1, and the MLP inside decoder layer 2."""
    layers = module.model.base_model.model.model.layers
    return layers[1], layers[2].mlp


def _first(output: Any) -> Tensor:
    return (output[0] if isinstance(output, tuple) else output).detach().clone()


class _Summaries(logging.Handler):
    """Keeps what ``ModelSummary`` prints (through Lightning's logger, which does not propagate to pytest's)."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())


def test_model_summary_device_stats_and_forward_hooks(zoo_base: Path, tmp_path: Path) -> None:
    runs, seen, summaries = [], [], []
    logger = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    for strategy in ("auto", "blockwise"):
        outputs: dict[str, list[Tensor]] = {"layer": [], "mlp": []}
        seen.append(outputs)

        def make(outputs: dict[str, list[Tensor]] = outputs) -> PlainLoRA:
            module = PlainLoRA(str(zoo_base))
            for kept, watched in zip(outputs.values(), _observed(module), strict=True):
                watched.register_forward_hook(lambda m, args, out, kept=kept: kept.append(_first(out)))
            return module

        handler = _Summaries()
        logger.addHandler(handler)
        try:
            root = tmp_path / strategy
            callbacks = [ModelSummary(max_depth=3), DeviceStatsMonitor(cpu_stats=True)]
            runs.append(zoo_fit(make, strategy, root, callbacks, logger=CSVLogger(root), log_every_n_steps=1))
        finally:
            logger.removeHandler(handler)
        summaries.append(handler.texts)
    assert_same(*runs)
    # ModelSummary printed the same table to depth 3 under both strategies.
    assert summaries[0] == summaries[1] and "model.base_model.model" in summaries[0][0]
    # DeviceStatsMonitor logged the CPU's stats at every step through the logger (values are the machine's own).
    for strategy in ("auto", "blockwise"):
        rows = list(csv.DictReader((tmp_path / strategy / "lightning_logs/version_0/metrics.csv").open()))
        stats = [row for row in rows if row.get("DeviceStatsMonitor.on_train_batch_start/cpu_percent")]
        assert len(stats) == 3, strategy
    # The forward hooks fired once per step and saw the same tensors.
    for key in ("layer", "mlp"):
        assert len(seen[0][key]) == len(seen[1][key]) == 3
        assert all(torch.equal(a, b) for a, b in zip(seen[0][key], seen[1][key], strict=True))
    assert_sees_each_field(runs[0])


class _Observe(ModelHook):
    """An accelerate hook that observes: it keeps each output and returns what it was given."""

    def __init__(self, outputs: list[Tensor]) -> None:
        self.outputs = outputs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        self.outputs.append(_first(output))
        return output


def test_accelerate_hooks_are_refused_before_any_step(zoo_base: Path, tmp_path: Path) -> None:
    """accelerate's hooks would fire twice per step, on the layer and inside it: refused, the fix
    named; control: under `strategy="auto"` the same hooks fire once per step."""

    def make(outputs: list[list[Tensor]]) -> PlainLoRA:
        module = PlainLoRA(str(zoo_base))
        for watched in _observed(module):
            outputs.append([])
            add_hook_to_module(watched, _Observe(outputs[-1]))
        return module

    module = make(refused_outputs := [])
    trainer = zoo_trainer(module, "blockwise", tmp_path / "blockwise")
    with pytest.raises(MisconfigurationException) as refused:
        trainer.fit(module, zoo_data())
    message = str(refused.value)
    assert "2 modules in the decoder layers carry an accelerate hook (e.g. `_Observe` on `layers.1`" in message
    assert "`module.register_forward_hook(...)`" in message and "remove_hook_from_module" in message
    assert trainer.global_step == 0 and not any(refused_outputs)  # refused before the first forward
    auto_outputs: list[list[Tensor]] = []
    zoo_fit(lambda: make(auto_outputs), "auto", tmp_path / "auto")
    assert [len(outputs) for outputs in auto_outputs] == [3, 3]


def test_control_without_the_refusal_accelerate_hooks_fire_twice_a_step(
    zoo_base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why the refusal: let through, each hook (on the layer, and on the MLP inside it) fires in the forward and again
    in the recompute, 6 times in 3 steps where resident training fires 3."""
    monkeypatch.setattr("lightning_blockwise.strategy.run.refuse_accelerate_hooks", lambda layers: None)
    outputs: list[list[Tensor]] = []

    def make() -> PlainLoRA:
        module = PlainLoRA(str(zoo_base))
        for watched in _observed(module):
            outputs.append([])
            add_hook_to_module(watched, _Observe(outputs[-1]))
        return module

    zoo_fit(make, "blockwise", tmp_path / "blockwise")
    assert [len(seen) for seen in outputs] == [6, 6]
