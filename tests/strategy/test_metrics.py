"""torchmetrics metrics on the module under `strategy="blockwise"`: placed, updated, reset and checkpointed as under
`strategy="auto"`, their logged values `torch.equal` (issue 42, item 2; NOTE [ Placement through public calls ] in
residency/placement.py). Two ranks: tests/distributed/test_metrics.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.metered import MeteredModule, RecordLogged, metric_states, records_differ
from tests.helpers.models import (
    RunResult,
    assert_equal_runs,
    build_model,
    fit,
    loader,
    padded_batches,
    runs_differ,
    trainer,
)


@dataclass
class _Arm:
    result: RunResult
    records: list[dict[str, Tensor]]
    states: dict[str, Tensor]
    saved: dict[str, Tensor]
    resumed: list[dict[str, Tensor]]


def _without_dropout() -> MeteredModule:
    """The module with every dropout off (its modules' and attention's, not the config's, which the checkpoint's
    base fingerprint covers): `strategy="auto"` restores no random state on a resume, so only a run that draws
    nothing resumes alike under both strategies."""
    module = MeteredModule(lambda: build_model("llama"))
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
        if hasattr(sub, "attention_dropout"):
            sub.attention_dropout = 0.0
    return module


def _arm(strategy: str, root: Path) -> _Arm:
    """Three epochs of 8 micro-batches, a checkpoint at each epoch's end; the third again, resumed without dropout."""
    module, recorder = MeteredModule(lambda: build_model("llama")), RecordLogged()
    save = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, filename="{epoch}")
    callbacks = [recorder, save]
    result = fit(module, strategy, max_steps=-1, max_epochs=3, callbacks=callbacks, enable_checkpointing=True)
    for name in ("perplexity", "mean_loss", "accuracy"):
        assert getattr(module, name).device == module.device
    state = torch.load(root / "epoch=1.ckpt", weights_only=True)["state_dict"]
    saved = {k: v for k, v in state.items() if k.startswith(("mean_loss.", "perplexity.", "accuracy."))}
    again = RecordLogged()
    pl.seed_everything(0, verbose=False)
    trainer(strategy, max_steps=-1, max_epochs=3, callbacks=[again]).fit(
        _without_dropout(), loader(padded_batches(8)), ckpt_path=root / "epoch=1.ckpt"
    )
    return _Arm(result, recorder.records, metric_states(module), saved, again.records)


@pytest.fixture(scope="module")
def resident(tmp_path_factory: pytest.TempPathFactory) -> _Arm:
    return _arm("auto", tmp_path_factory.mktemp("auto"))


def test_three_metrics_log_as_under_auto(resident: _Arm, tmp_path: Path) -> None:
    """Perplexity, MeanMetric and MulticlassAccuracy: every logged value, state, checkpoint entry and resumed epoch."""
    blockwise = _arm("blockwise", tmp_path)
    assert_equal_runs(resident.result, blockwise.result)
    # 24 micro-batches and 3 epoch ends, each with the step and epoch keys of the three metrics.
    assert len(resident.records) == 27 and len(resident.records[-1]) == 9
    assert resident.records[-1]["accuracy_epoch"] > 0
    assert not records_differ(resident.records, blockwise.records)
    assert resident.states.keys() == blockwise.states.keys()
    assert all(torch.equal(resident.states[k], blockwise.states[k]) for k in resident.states)
    # The persistent metric's state is in the checkpoint, and nothing else of the metrics.
    assert sorted(resident.saved) == sorted(blockwise.saved) == ["mean_loss.mean_value", "mean_loss.weight"]
    assert all(torch.equal(resident.saved[k], blockwise.saved[k]) for k in resident.saved)
    # The third epoch resumed from each arm's checkpoint of the second, the persistent state loaded from it.
    assert len(resident.resumed) == 9 and not records_differ(resident.resumed, blockwise.resumed)


def test_control_logged_metrics_differ_without_the_rng_replay(
    resident: _Arm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison of logged values can fail: with the recompute's dropout masks not replayed, they differ."""
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    module, recorder = MeteredModule(lambda: build_model("llama")), RecordLogged()
    result = fit(module, "blockwise", max_steps=-1, max_epochs=3, callbacks=[recorder])
    assert runs_differ(resident.result, result)
    assert records_differ(resident.records, recorder.records)
