"""The README's "After the demo": `generate`, `export` and `validate` run as written on the base the demo keeps."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lightning_blockwise.cli import build_cli, main
from lightning_blockwise.demos.base_files import keep_base
from lightning_blockwise.demos.tiny import build_base_model
from lightning_blockwise.export.training_record import read_training_record
from lightning_blockwise.loading.base_identity import base_identity
from tests.helpers.readme import ROOT, readme_commands

#: The demo's fit, shortened: four steps, validated at the fourth, so that `validate` has a loss to reproduce.
SHORT_DEMO = [
    "fit",
    "--config",
    "configs/demo.yaml",
    "--trainer.max_steps=4",
    "--trainer.val_check_interval=4",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.enable_progress_bar=false",
]
ADAPTER = Path("outputs/demo/lightning_logs/version_0/adapter")


def run(argv: list[str]) -> LightningCLI | None:
    """One README line, in this process: what `lightning-blockwise` does with it (the CLI of a Trainer command)."""
    assert argv[0] == "lightning-blockwise", f"the block runs only lightning-blockwise commands, not {argv}"
    if argv[1] in LightningCLI.subcommands():
        return build_cli(argv[1:])  # what `main` calls for these, kept for its metrics
    main(argv[1:])
    return None


@pytest.fixture
def demo_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory like a clone's (configs/, data/) in which the demo has run, shortened."""
    for name in ("configs", "data"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])
    run(["lightning-blockwise", *SHORT_DEMO])
    return tmp_path


def test_the_after_demo_commands_run_on_the_base_the_demo_keeps(
    demo_directory: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = Path("outputs/demo/base")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {path.name for path in base.iterdir()}
    record = read_training_record(ADAPTER)
    assert record is not None and record.compute_dtype == torch.float32 and record.quantize is True
    assert record.base is not None and not record.base.differences(base_identity(base))
    with open(ADAPTER.parent / "metrics.csv") as f:
        (fit_val_loss,) = [float(row["val_loss"]) for row in csv.DictReader(f) if row.get("val_loss")]

    generate, export, validate = readme_commands.script(
        readme_commands.commands((ROOT / "README.md").read_text(), readme_commands.SECTIONS["after-demo"]), {}
    )
    assert [argv[1] for argv in (generate, export, validate)] == ["generate", "export", "validate"]

    capsys.readouterr()
    run(generate)
    prompt = generate[generate.index("--prompt") + 1]
    assert f">>> {prompt}\n" in capsys.readouterr().out

    run(export)
    merged_dir = Path(export[4])
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True)
    assert json.loads((merged_dir / "config.json").read_text())["dtype"] == "float32"
    # The merged model computes what the adapter over the NF4 base computes (an fp32 sum, not bit for bit); the
    # control: the base without the adapter is much farther from it.
    trained = PeftModel.from_pretrained(build_base_model(vocab_size=259, base_dir=base), ADAPTER)
    bare = build_base_model(vocab_size=259, base_dir=base)
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got, untrained = (model(input_ids=ids).logits for model in (trained, merged.eval(), bare))
    assert (got - expected).abs().max() < 1e-3
    assert (untrained - expected).abs().max() > 100 * (got - expected).abs().max()

    cli = run(validate)
    assert math.isclose(cli.trainer.callback_metrics["val_loss"].item(), fit_val_loss, rel_tol=1e-5)
    # Control: without the adapter, the same validation gives another loss.
    cli = run([arg for arg in validate if not arg.startswith("--model.init_args.adapter_path")])
    assert not math.isclose(cli.trainer.callback_metrics["val_loss"].item(), fit_val_loss, rel_tol=1e-3)

    # The record names the kept base: another seed's base of the same shapes is refused before it loads (control:
    # the kept base passed the same check in `generate` above).
    other = Path("outputs/other-base")
    keep_base(build_base_model(vocab_size=259, seed=1, quantize=False), other)
    with pytest.raises(SystemExit, match="differs in its weights"):
        run(["lightning-blockwise", "generate", str(other), *generate[3:]])


def test_a_kept_base_is_reused_and_another_is_refused(tmp_path: Path) -> None:
    """The next demo reuses `outputs/demo/base`; one with other base arguments is refused, not overwritten."""
    base = tmp_path / "base"
    first = build_base_model(vocab_size=259, base_dir=base)
    written = (base / "model.safetensors").stat().st_mtime_ns
    again = build_base_model(vocab_size=259, base_dir=base)
    assert (base / "model.safetensors").stat().st_mtime_ns == written
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values(), strict=True))
    with pytest.raises(MisconfigurationException, match="holds another base"):
        build_base_model(vocab_size=259, hidden_size=32, base_dir=base)
    assert (base / "model.safetensors").stat().st_mtime_ns == written
    assert not list(tmp_path.glob(".base.*"))  # no staging directory left behind
