"""The demo: its data, its model's construction and schedule, and a short fit through the CLI."""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch
from bitsandbytes.nn import Linear4bit
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, PeftModel, get_peft_model
from transformers.distributed import mixin

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.callbacks.progress_bar import EpochProgressBar, planned_epochs
from lightning_blockwise.cli import build_cli
from lightning_blockwise.compat.processes import host_name
from lightning_blockwise.demos.progressions import DemoDataModule
from lightning_blockwise.demos.tiny import DemoCausalLM, build_base_model
from lightning_blockwise.recipes.schedules import warmup_cosine

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


def _splits(**kwargs: int) -> DemoDataModule:
    data = DemoDataModule(**kwargs)
    data.setup("fit")
    return data


def test_data_is_deterministic_from_the_seed() -> None:
    a, b, c = _splits(seed=0), _splits(seed=0), _splits(seed=1)
    assert torch.equal(a.train_set.input_ids, b.train_set.input_ids)
    assert not torch.equal(a.train_set.input_ids, c.train_set.input_ids)
    assert not torch.equal(a.train_set.input_ids[: len(a.val_set)], a.val_set.input_ids)
    order_a = torch.cat([batch["input_ids"] for batch in a.train_dataloader()])
    order_b = torch.cat([batch["input_ids"] for batch in b.train_dataloader()])
    assert torch.equal(order_a, order_b)


def test_data_are_right_padded_progressions() -> None:
    data = _splits(vocab_size=32, min_length=4, max_length=10, max_step=3)
    ids, mask, labels = data.train_set.input_ids, data.train_set.attention_mask, data.train_set.labels
    lengths = mask.sum(dim=1)
    assert lengths.min() >= 4 and lengths.max() == 10 and lengths.min() < 10
    # Right padding: the mask is a prefix of ones.
    assert torch.equal(mask, (torch.arange(10) < lengths[:, None]).long())
    assert torch.equal(ids == 0, mask == 0)
    assert torch.equal(labels == -100, mask == 0)
    assert torch.equal(labels[mask == 1], ids[mask == 1])
    assert ids.max() <= 31
    # Each sequence steps by one constant modulo vocab_size - 1.
    steps = (ids[:, 1:] - ids[:, :-1]) % 31
    assert torch.all((steps == steps[:, :1]) | (mask[:, 1:] == 0))
    assert set(steps[:, 0].tolist()) == {1, 2, 3}


def test_base_model_depends_on_the_seed_alone() -> None:
    a = build_base_model(quantize=False, seed=0).state_dict()
    torch.manual_seed(123)
    expected_draw = torch.rand(1)
    torch.manual_seed(123)
    b = build_base_model(quantize=False, seed=0).state_dict()
    # The global RNG is where the build found it.
    assert torch.equal(torch.rand(1), expected_draw)
    c = build_base_model(quantize=False, seed=1).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_validation_leaves_the_cpu_4bit_training_path_alone() -> None:
    # See NOTE [ bitsandbytes CPU inference kernel ] in lightning_blockwise/compat/bitsandbytes/cpu_kernel.py:
    # without the fix, an eval-mode no-grad forward on an AVX512-BF16 CPU repacks the weights and the next
    # training forward raises (or loses the base's gradients).
    model = get_peft_model(build_base_model(num_hidden_layers=1), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    batch = next(iter(_splits().train_dataloader()))

    def adapter_grads() -> dict[str, torch.Tensor]:
        model.train()
        model.zero_grad()
        model(**batch).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    before = adapter_grads()
    model.eval()
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    after = adapter_grads()
    assert before and before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in _4bit_linears(model))


def _4bit_linears(model: torch.nn.Module) -> list[Linear4bit]:
    found = [m for m in model.modules() if isinstance(m, Linear4bit)]
    assert found, "expected an NF4 base"
    return found


@pytest.mark.parametrize("warmup_steps", [0, 4])
def test_warmup_then_cosine_schedule(warmup_steps: int) -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    scheduler = warmup_cosine(optimizer, warmup_steps=warmup_steps, total_steps=20, min_lr_ratio=0.1)
    rates = []
    for _ in range(21):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    warmup, decay = rates[: warmup_steps + 1], rates[warmup_steps:]
    assert warmup[0] == pytest.approx(0.01 / (warmup_steps + 1))
    assert all(x < y for x, y in itertools.pairwise(warmup))
    assert max(rates) == pytest.approx(0.01) == rates[warmup_steps]
    assert all(x > y for x, y in itertools.pairwise(decay))
    assert rates[20] == pytest.approx(0.001)


def test_vocab_mismatch_is_refused_before_building(tmp_path: Path) -> None:
    module = DemoCausalLM(vocab_size=64)
    trainer = Trainer(strategy="blockwise", max_steps=1, default_root_dir=tmp_path, logger=False)
    with pytest.raises(MisconfigurationException, match="vocab_size"):
        trainer.fit(module, datamodule=DemoDataModule(vocab_size=128))
    assert module.model is None


def test_demo_config_counts_the_epochs_its_steps_take(tmp_path: Path) -> None:
    """The progress bar shows `Epoch <n>/3`: the epochs max_steps takes (Lightning's own bars: `Epoch 2/-2`)."""
    into = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = build_cli(["--config", str(DEMO_CONFIG), *into], run=False)
    assert isinstance(cli.trainer.progress_bar_callback, EpochProgressBar) and cli.trainer.max_epochs is None
    cli.datamodule.setup("fit")
    batches = len(cli.datamodule.train_dataloader())
    steps_per_epoch = math.ceil(batches / cli.trainer.accumulate_grad_batches)
    # What `num_training_batches` is once fit has set the loaders up.
    with mock.patch.object(type(cli.trainer), "num_training_batches", batches):
        assert planned_epochs(cli.trainer) == math.ceil(cli.trainer.max_steps / steps_per_epoch) == 3


def _metric(rows: list[dict[str, str]], key: str) -> list[float]:
    return [float(row[key]) for row in rows if row.get(key)]


def test_demo_fit_lowers_the_loss_and_saves_a_loadable_adapter(tmp_path: Path) -> None:
    into = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    cli = build_cli(
        ["fit", "--config", str(DEMO_CONFIG), *into, "--trainer.max_steps=48", "--trainer.enable_progress_bar=false"]
    )
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir.is_relative_to(tmp_path)
    assert cli.trainer.global_step == 48
    assert isinstance(cli.trainer.strategy, BlockwiseStrategy)

    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    train, val = _metric(rows, "train_loss"), _metric(rows, "val_loss")
    # Logged every 5 steps; validated at the end of both epochs (steps 24 and 48).
    assert len(train) == 9 and len(val) == 2
    # Single-batch losses are noisy: compare the first two logged with the last two.
    assert sum(train[-2:]) / 2 < sum(train[:2]) / 2 - 0.8, train
    assert val[-1] < val[0], val
    # LearningRateMonitor logs the warmup-cosine rate with the losses: up for 5 steps to the peak, then down.
    rates = _metric(rows, "lr-AdamW")
    hp = cli.model.hparams
    assert len(rates) == 9 and rates[0] < rates[1] == pytest.approx(hp.learning_rate, rel=0.05), rates
    assert all(x > y for x, y in itertools.pairwise(rates[1:])), rates
    assert (log_dir / "config.yaml").is_file()
    # The demo's callbacks ran: the parity check passed on every layer, and the profiler wrote its summary.
    assert _metric(rows, "parity/passed") == [1.0]
    assert _metric(rows, "parity/checked_layers") == [float(cli.model.hparams.num_hidden_layers)]
    summary = json.loads((log_dir / "blockwise_profile.json").read_text())
    assert summary["h2d_bytes_per_step"] > 0 and summary["step_time_s"] > 0
    # MetricsPlot drew the losses (`--trainer.enable_progress_bar=false` left only the config's bar out).
    assert (log_dir / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert cli.trainer.progress_bar_callback is None

    # The adapter loads back onto a freshly built base with every weight equal.
    adapter_dir = log_dir / "adapter"
    trained = {n: p.detach().cpu() for n, p in cli.model.model.named_parameters() if "lora_" in n}
    hp = cli.model.hparams
    base = build_base_model(
        hidden_size=hp.hidden_size, num_hidden_layers=hp.num_hidden_layers, vocab_size=hp.vocab_size, seed=hp.seed
    )
    loaded = {n: p.detach().cpu() for n, p in PeftModel.from_pretrained(base, adapter_dir).named_parameters()}
    loaded = {n: p for n, p in loaded.items() if "lora_" in n}
    assert trained and trained.keys() == loaded.keys()
    for name, weight in trained.items():
        assert torch.equal(weight, loaded[name]), name
    # lora_B starts at zero: non-zero ones show the saved adapter is the trained one, not a fresh one.
    assert any(w.abs().sum() > 0 for n, w in trained.items() if "lora_B" in n)

    # `validate` from the saved adapter reproduces the last validation of the fit.
    cli = build_cli(["validate", "--config", str(DEMO_CONFIG), *into, f"--model.init_args.adapter_path={adapter_dir}"])
    assert math.isclose(cli.trainer.callback_metrics["val_loss"].item(), val[-1], rel_tol=1e-5)


def test_a_killed_demos_temporary_model_is_cleaned_at_the_next_start() -> None:
    """NOTE [ Cleaning what is ours ]: a dead process's temporary checkpoint goes; a running one's stays (control)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = host_name()
    stale = Path(tempfile.gettempdir()) / f"lightning-blockwise-demo.{host}-{dead.pid}.test00.model"
    live = Path(tempfile.mkdtemp(prefix=f"lightning-blockwise-demo.{host}-{os.getpid()}.", suffix=".model"))
    stale.mkdir()
    try:
        build_base_model()
        assert not stale.exists() and live.exists()
    finally:
        shutil.rmtree(stale, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_the_base_is_built_on_every_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`build_base_model` on a rank other than 0 of a process group builds the same base as on rank 0.

    Control: under the same conditions `save_pretrained`, which the demo used to write its base with, writes no
    weights (transformers saves on global rank 0 only), which left rank 1 with "Unrecognized model".
    """
    rank_zero = build_base_model(seed=3)
    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    rank_one = build_base_model(seed=3)
    state, other = rank_zero.state_dict(), rank_one.state_dict()
    assert state.keys() == other.keys() and state
    assert all(torch.equal(value, other[name]) for name, value in state.items() if isinstance(value, torch.Tensor))
    build_base_model(seed=3, quantize=False).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))


def test_the_demo_config_trains_on_two_ranks_and_writes_its_adapter(tmp_path: Path) -> None:
    """`lightning-blockwise fit --config configs/demo.yaml --trainer.devices=2`: Lightning starts rank 1 itself,
    both ranks finish, and the adapter, the profile and the loss plot are in the log directory.

    Every file written at the end reads `trainer.log_dir`, a collective: one rank skipping it failed the run
    (NOTE [ One export, every rank in step ]). The control is `test_the_base_is_built_on_every_rank`'s.
    """
    into = [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    command = [sys.executable, "-m", "lightning_blockwise", "fit", "--config", str(DEMO_CONFIG), *into]
    command += ["--trainer.devices=2", "--trainer.accelerator=cpu", "--trainer.max_steps=2"]
    command += ["--trainer.enable_progress_bar=false", "--trainer.num_sanity_val_steps=0"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert "GLOBAL_RANK: 1" in run.stdout + run.stderr  # rank 1 ran
    assert (log_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert (log_dir / "loss.png").read_bytes().startswith(b"\x89PNG")
    assert (log_dir / "blockwise_profile.json").is_file()
    assert not list(tmp_path.glob("lightning_logs/version_0/.adapter*"))  # nothing staged was left behind
