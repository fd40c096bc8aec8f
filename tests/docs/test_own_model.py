"""The README's "Your own model, your own data", run as a script on a made-up model and made-up data.

The block's lines run in this process, as written, in a working directory like a clone's: its `MODEL` and `DATA`
lines take a tiny random-init checkpoint and a JSONL file written here instead of `/models/...`, and its `fit`
lines get CPU settings and two steps appended (the config it copies is a GPU run of 1000 steps).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from transformers import AutoModelForCausalLM

from lightning_blockwise.cli import build_cli, main
from lightning_blockwise.recipes.encoding import byte_tokenizer
from tests.helpers.models import CONFIGS
from tests.helpers.readme import ROOT, readme_commands

#: What the test adds to each `fit` line: a CPU, fp32, a short run, a checkpoint at every step.
CPU_AND_SHORT = [
    "--trainer.accelerator=cpu",
    "--trainer.precision=32-true",
    "--model.init_args.compute_dtype=float32",
    "--trainer.max_steps=2",
    "--trainer.accumulate_grad_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--data.init_args.max_length=128",
    "--data.init_args.num_workers=0",
]


def _made_up_model(path: Path) -> Path:
    """A random-init Qwen2 (the copied config's architecture) with the byte-level tokenizer, saved as a checkpoint."""
    config = CONFIGS["qwen2"]()
    config.vocab_size = 259  # the byte-level tokenizer's
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _made_up_data(path: Path) -> Path:
    words = ["moon", "river", "garden", "stone", "cloud", "apple", "tiger", "paper", "light", "music"]
    rows = [{"instruction": "Reverse the letters of the word.", "input": w, "output": w[::-1]} for w in words * 2]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run(argv: list[str]) -> LightningCLI | None:
    """One line of the block, in this process: `cp`, or what `lightning-blockwise` does with it."""
    if argv[0] == "cp":
        shutil.copy(argv[1], argv[2])
        return None
    assert argv[0] == "lightning-blockwise", f"the block runs cp and lightning-blockwise only, not {argv}"
    if argv[1] in LightningCLI.subcommands():
        return build_cli(argv[1:])  # what `main` calls for these, kept for its trainer
    main(argv[1:])
    return None


def test_the_own_model_block_runs_plan_fit_generate_export_and_the_resume_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "clone"
    work.mkdir()
    for name in ("configs", "data"):
        (work / name).symlink_to(ROOT / name)
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])
    variables = {"MODEL": str(_made_up_model(tmp_path / "model")), "DATA": str(_made_up_data(tmp_path / "data.jsonl"))}
    first, resume = readme_commands.blocks((ROOT / "README.md").read_text(), readme_commands.SECTIONS["own-model"])
    steps = readme_commands.script(first, variables)
    (resume_line,) = readme_commands.script(resume, variables)
    assert [argv[1] if argv[0] == "lightning-blockwise" else argv[0] for argv in steps] == [
        "cp", "plan", "fit", "generate", "export"
    ]  # fmt: skip
    run_dir = Path(variables["RUN"])

    for argv in steps:
        capsys.readouterr()
        cli = _run([*argv, *CPU_AND_SHORT] if argv[1:2] == ["fit"] else argv)
        out = capsys.readouterr().out
        if argv[1:2] == ["plan"]:
            assert "vram_budget" in out, out
        elif argv[1:2] == ["fit"]:
            assert cli.trainer.global_step == 2 and Path(cli.trainer.log_dir).resolve() == run_dir.resolve()
            assert cli.model.hparams.checkpoint == variables["MODEL"]
            assert cli.datamodule.hparams.path == variables["DATA"]
            assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
            assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "config.yaml").is_file()
        elif argv[1:2] == ["generate"]:
            assert f">>> {argv[argv.index('--prompt') + 1]}\n" in out, out
        elif argv[1:2] == ["export"]:
            merged = AutoModelForCausalLM.from_pretrained(argv[4], local_files_only=True)
            assert merged.config.vocab_size == 259

    # After a stop: the resume line continues from last.ckpt (step 2) into the next version, to a third step.
    cli = _run([*resume_line, "--trainer.max_steps=3"])
    assert cli.trainer.global_step == 3
    assert Path(cli.trainer.log_dir).name == "version_1"
    assert cli.trainer.ckpt_path is not None and Path(cli.trainer.ckpt_path).name == "last.ckpt"
