"""`BlockwiseProfiler` on the CPU: logged keys, byte counts against the streamer and the plan, JSON, PNG, parity."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseProfiler, BlockwiseStrategy, ParityCheck
from lightning_blockwise.residency.layout import BlockLayout
from lightning_blockwise.residency.stream_observer import StreamObserver
from tests.helpers.models import CausalLMModule, assert_equal_runs, build_model, fit, nf4_lora_builder, padded_batches

CPU_KEYS = {"step_time_s", "tokens_per_s", "h2d_bytes_per_step", "h2d_s_per_step", "h2d_gb_per_s"}
CUDA_KEYS = {"wait_s_per_step", "wait_fraction", "peak_allocated_bytes", "peak_reserved_bytes"}


def _nf4(checkpoints: dict[str, Path]) -> Any:
    return lambda: build_model("llama", checkpoint=checkpoints["llama"], quantized=True)


class _BytesPerBatch(Callback):
    """Bytes the streamer's own counters show per training batch (the profiler's independent reference)."""

    def __init__(self) -> None:
        self.bytes: list[int] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self._before = trainer.strategy.streamer.stats.bytes

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.bytes.append(trainer.strategy.streamer.stats.bytes - self._before)


def predicted_bytes_per_batch(layouts: list[BlockLayout], resident: set[int], prefetch_depth: int) -> tuple[int, int]:
    """Bytes of the first and of every later batch, from NOTE [ Prefetch order ] in residency/streamer.py.

    The forward loads the streamed blocks in order and the backward in reverse, except the
    ``prefetch_depth + 1`` blocks still in the slots at each turn: those that end the forward
    (when the backward starts) and those that end the backward (when the next forward starts).
    The first forward finds the slots empty.
    """
    streamed = [layout.nbytes for block, layout in enumerate(layouts) if block not in resident]
    slots = min(prefetch_depth + 1, len(streamed))
    backward = sum(streamed[: len(streamed) - slots])
    later_forward = sum(streamed[slots:])
    return sum(streamed) + backward, later_forward + backward


def _read_csv(logger: CSVLogger) -> list[dict[str, str]]:
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row.get("blockwise/step_time_s")]


def test_logs_keys_and_bytes_match_the_streamer_and_the_plan(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    reference = _BytesPerBatch()
    logger = CSVLogger(tmp_path, name="run")
    strategy = BlockwiseStrategy(block_size=1, prefetch_depth=2)
    fit(
        CausalLMModule(_nf4(checkpoints)),
        strategy,
        callbacks=[reference, BlockwiseProfiler()],
        logger=logger,
        log_every_n_steps=1,
        accumulate_grad_batches=1,
        max_steps=4,
    )
    rows = _read_csv(logger)
    assert len(rows) == 4
    assert {k.removeprefix("blockwise/") for k in rows[0] if k.startswith("blockwise/") and rows[0][k]} == CPU_KEYS
    logged = [float(row["blockwise/h2d_bytes_per_step"]) for row in rows]
    assert logged == reference.bytes and all(b > 0 for b in logged)
    assert strategy.host_copy is not None
    first, later = predicted_bytes_per_batch(strategy.host_copy.layouts, set(), prefetch_depth=2)
    assert logged == [first, later, later, later]
    for row in rows:
        assert 0 < float(row["blockwise/step_time_s"]) < 60
        assert float(row["blockwise/h2d_s_per_step"]) > 0 and float(row["blockwise/h2d_gb_per_s"]) > 0
        # `padded_batches(batch_size=2, seq=12)`: input_ids.numel() == 24 tokens per batch.
        assert math.isclose(float(row["blockwise/tokens_per_s"]) * float(row["blockwise/step_time_s"]), 24)


def test_logs_once_per_interval_of_optimizer_steps(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Two micro-batches per step, a log every 2 steps: one row per 4 batches, their mean bytes."""
    reference = _BytesPerBatch()
    logger = CSVLogger(tmp_path, name="run")
    fit(
        CausalLMModule(_nf4(checkpoints)),
        BlockwiseStrategy(),
        callbacks=[reference, BlockwiseProfiler()],
        logger=logger,
        log_every_n_steps=2,
        max_steps=4,
    )
    rows = _read_csv(logger)
    assert len(reference.bytes) == 8 and len(rows) == 2
    means = [sum(reference.bytes[i : i + 4]) / 4 for i in (0, 4)]
    assert [float(row["blockwise/h2d_bytes_per_step"]) for row in rows] == means


def test_summary_json_and_timeline_png(checkpoints: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    profiler = BlockwiseProfiler(timeline=True, dirpath=tmp_path / "profile")
    strategy = BlockwiseStrategy(block_size=1, prefetch_depth=1)
    fit(CausalLMModule(_nf4(checkpoints)), strategy, callbacks=[profiler], max_steps=2)
    summary = json.loads((tmp_path / "profile" / "blockwise_profile.json").read_text())
    assert summary == profiler.summary
    assert summary["device"] == "cpu" and summary["batches"] == 3 and summary["first_batch_excluded"]
    assert CPU_KEYS <= summary.keys() and not CUDA_KEYS & summary.keys()
    assert summary["h2d_bytes_per_step"] > 0 and summary["first_batch"]["h2d_bytes_per_step"] > 0
    assert summary["streamer"] == {
        "blocks": 4, "block_size": 1, "streamed_blocks": 4, "resident_blocks": 0, "slots": 2, "prefetch_depth": 1
    }  # fmt: skip
    png = tmp_path / "profile" / "blockwise_timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "BlockwiseProfiler" in capsys.readouterr().out


def test_timeline_of_a_chosen_batch_and_log_dir_default(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, name="run")
    profiler = BlockwiseProfiler(timeline=1)
    fit(CausalLMModule(_nf4(checkpoints)), BlockwiseStrategy(), callbacks=[profiler], logger=logger, max_steps=1)
    assert (Path(logger.log_dir) / "blockwise_profile.json").is_file()
    assert (Path(logger.log_dir) / "blockwise_timeline.png").is_file()
    assert profiler._drawn is not None and profiler._drawn.index == 1 and profiler._drawn.copies


def test_timeline_index_past_the_fit_warns(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    profiler = BlockwiseProfiler(timeline=99, dirpath=tmp_path)
    with pytest.warns(UserWarning, match="no such batch"):
        fit(CausalLMModule(_nf4(checkpoints)), BlockwiseStrategy(), callbacks=[profiler], max_steps=1)
    assert not (tmp_path / "blockwise_timeline.png").exists()


def test_results_are_equal_with_and_without_the_profiler(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    plain = fit(CausalLMModule(_nf4(checkpoints)), BlockwiseStrategy())
    strategy = BlockwiseStrategy()
    profiled = fit(
        CausalLMModule(_nf4(checkpoints)),
        strategy,
        callbacks=[BlockwiseProfiler(timeline=True, dirpath=tmp_path)],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    assert_equal_runs(plain, profiled)
    assert strategy.streamer is None  # torn down; the profiler put the plain observer back before that


def test_without_blockwise_reports_time_and_tokens(tmp_path: Path) -> None:
    profiler = BlockwiseProfiler(dirpath=tmp_path)
    with pytest.warns(UserWarning, match="does not stream weights"):
        fit(CausalLMModule(lambda: build_model("llama")), "auto", callbacks=[profiler], max_steps=1)
    assert set(profiler.summary) >= {"step_time_s", "tokens_per_s"} and "h2d_bytes_per_step" not in profiler.summary


def test_observer_is_restored_after_fit(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    observers: list[StreamObserver] = []

    class _Peek(Callback):
        def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
            observers.append(trainer.strategy.streamer.observer)

    fit(
        CausalLMModule(_nf4(checkpoints)),
        BlockwiseStrategy(),
        callbacks=[BlockwiseProfiler(dirpath=tmp_path), _Peek()],
        max_steps=1,
    )
    assert type(observers[0]) is StreamObserver


def test_observer_set_once_follows_the_streamers_a_parity_check_builds(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The parity check replaces the streamer after the profiler set its observer; the bytes still add up."""
    reference = _BytesPerBatch()
    logger = CSVLogger(tmp_path, name="run")
    strategy = BlockwiseStrategy()
    fit(
        CausalLMModule(_nf4(checkpoints)),
        strategy,
        callbacks=[BlockwiseProfiler(dirpath=tmp_path), ParityCheck(), reference],
        logger=logger,
        log_every_n_steps=1,
        accumulate_grad_batches=1,
        max_steps=2,
    )
    logged = [float(row["blockwise/h2d_bytes_per_step"]) for row in _read_csv(logger)]
    assert logged == reference.bytes and all(b > 0 for b in logged)
    assert type(strategy.observer) is StreamObserver


def test_negative_timeline_index_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match="index of a training batch"):
        BlockwiseProfiler(timeline=-1)


@pytest.fixture(scope="module")
def gpu_checkpoint(small_llama_checkpoint: Path) -> Path:
    return small_llama_checkpoint


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 2])
def test_gpu_bytes_per_step_match_the_plan_and_png(gpu_checkpoint: Path, tmp_path: Path, block_size: int) -> None:
    logger = CSVLogger(tmp_path, name="run")
    # Every block streamed: the card's default budget (NOTE [ The card as the default budget ]) keeps it resident.
    strategy = BlockwiseStrategy(block_size=block_size, prefetch_depth=2, vram_budget=None)
    profiler = BlockwiseProfiler(timeline=True, dirpath=tmp_path / "profile")
    batches = padded_batches(6, batch_size=2, seq=128, vocab=1024)
    module = CausalLMModule(nf4_lora_builder(gpu_checkpoint, ["q_proj", "v_proj", "down_proj"], r=8))
    fit(
        module, strategy, batches, callbacks=[profiler], logger=logger,
        accelerator="gpu", precision="bf16-mixed", log_every_n_steps=1, accumulate_grad_batches=1, max_steps=6,
    )  # fmt: skip
    assert strategy.host_copy is not None and strategy.residency_plan is not None
    first, later = predicted_bytes_per_batch(
        strategy.host_copy.layouts, set(strategy.residency_plan.resident), prefetch_depth=2
    )
    rows = _read_csv(logger)
    assert [float(row["blockwise/h2d_bytes_per_step"]) for row in rows] == [first] + [later] * 5
    assert {k.removeprefix("blockwise/") for k in rows[0] if k.startswith("blockwise/")} == CPU_KEYS | CUDA_KEYS
    for row in rows[1:]:
        value = {k.removeprefix("blockwise/"): float(v) for k, v in row.items() if k.startswith("blockwise/")}
        assert 0 < value["peak_allocated_bytes"] <= value["peak_reserved_bytes"]
        assert 0 < value["h2d_s_per_step"] < value["step_time_s"] and 0 < value["h2d_gb_per_s"] < 1000
        assert 0 <= value["wait_s_per_step"] < value["step_time_s"]
    summary = profiler.summary
    print(f"[profiler] block_size={block_size}: {json.dumps(summary)}")
    assert (tmp_path / "profile" / "blockwise_timeline.png").read_bytes()[:4] == b"\x89PNG"
    assert profiler._drawn is not None and len(profiler._drawn.layers) == 2 * 8
