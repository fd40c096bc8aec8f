"""`lightning-blockwise export` (cli/export_command.py): arguments reach the merge, errors come back on one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_blockwise.cli import main
from lightning_blockwise.export.model_card import CONFIG_KEY
from lightning_blockwise.export.training_record import write_training_record


@pytest.fixture(scope="module")
def adapter(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter with non-zero B over the tiny Llama."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False))
    directory = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(directory)
    return directory


def test_export_merges_with_the_options_given(
    checkpoints: dict[str, Path], adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "merged"
    main(["export", str(adapter), str(checkpoints["llama"]), str(out), "--merge", "bf16", "--compute-dtype",
          "float32", "--max-shard-size", "20KB", "--merge-into-original", "--quiet"])  # fmt: skip
    assert f"wrote {out}" in capsys.readouterr().out
    recorded = json.loads((out / "config.json").read_text())[CONFIG_KEY]
    assert (recorded["merge"], recorded["merged_into"], recorded["compute_dtype"]) == ("bf16", "original", "float32")
    assert len(list(out.glob("*.safetensors"))) > 1  # the cap was applied
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    # Control: without the flags, the defaults (the adapter alone) are written.
    main(["export", str(adapter), str(checkpoints["llama"]), str(tmp_path / "plain"), "--quiet"])
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_a_merge_says_which_compute_dtype_it_used(
    checkpoints: dict[str, Path], adapter: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """NOTE [ The training record of an adapter ]: the recorded dtype is used and said; control: none recorded."""
    recorded = tmp_path / "recorded"
    shutil.copytree(adapter, recorded)
    write_training_record(recorded, "float32")
    main(["export", str(recorded), str(checkpoints["llama"]), str(tmp_path / "a"), "--merge", "bf16", "--quiet"])
    said = capsys.readouterr().err
    assert "merging with compute dtype float32 (recorded with the adapter)" in said
    with pytest.warns(UserWarning, match="give it as --compute-dtype"):
        main(["export", str(adapter), str(checkpoints["llama"]), str(tmp_path / "b"), "--merge", "bf16", "--quiet"])
    assert "merging with compute dtype bfloat16 (the default: the adapter records none)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--merge", "int8"], "argument --merge: invalid choice: 'int8'"),
        (["--max-shard-size", "big"], "--max-shard-size: Cannot read 'big' as a memory size"),
        (["--device", "tpu"], "--device 'tpu' is not a device"),
        (["--device", "meta"], "only cpu and cuda are supported"),
        (["--merge-into-original"], "needs a merge"),
    ],
)
def test_errors_are_one_line_and_come_before_any_work(
    checkpoints: dict[str, Path], adapter: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["export", str(adapter), str(checkpoints["llama"]), str(tmp_path / "out"), *args])
    text = str(refused.value.code)
    assert text.startswith("lightning-blockwise export: ") and message in text and "\n" not in text
    assert not (tmp_path / "out").exists()


def test_a_missing_adapter_names_what_to_give(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=re.escape("Give a PEFT adapter directory or a `.ckpt`")):
        main(["export", str(tmp_path / "nope"), str(checkpoints["llama"]), str(tmp_path / "out")])


def test_export_help_describes_the_modes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith("usage: lightning-blockwise export [-h]")
    for phrase in (
        "{none,bf16,fp32,nf4}",
        "--merge-into-original",
        "NOT the model that was trained",
        "--max-shard-size",
    ):
        assert phrase in text


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_overwrite_never_deletes_an_input_or_what_is_not_an_export(
    checkpoints: dict[str, Path], adapter: Path, tmp_path: Path
) -> None:
    """`--overwrite` on the base, a directory holding the inputs, one inside the base, or unrelated files: refused.

    Control: `--overwrite` on a previous export (a merged model, then an adapter) replaces it.
    """
    # A run directory that holds the adapter, the base and a file of the user's.
    run = tmp_path / "run"
    base = run / "base"
    base.mkdir(parents=True)
    for file in checkpoints["llama"].iterdir():
        (base / file.name).write_bytes(file.read_bytes())
    (run / "adapter").mkdir()
    for file in adapter.iterdir():
        (run / "adapter" / file.name).write_bytes(file.read_bytes())
    (run / "notes.txt").write_text("mine")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine too")
    before = {"run": _tree(run), "other": _tree(other)}
    cases = {
        base: "is the input",
        run: "contains the input",
        base / "merged": "lies inside the input",
        other: r"holds files that are not a previous export \(notes.txt\)",
    }
    for out, message in cases.items():
        with pytest.raises(SystemExit, match=message):
            main(["export", str(run / "adapter"), str(base), str(out), "--merge", "bf16", "--overwrite", "--quiet"])
    assert {"run": _tree(run), "other": _tree(other)} == before  # nothing deleted, nothing written

    out = tmp_path / "merged"
    for merge in ("bf16", "fp32"):
        main(["export", str(run / "adapter"), str(base), str(out), "--merge", merge, "--overwrite", "--quiet"])
        assert json.loads((out / "config.json").read_text())[CONFIG_KEY]["merge"] == merge
    main(["export", str(run / "adapter"), str(base), str(out), "--overwrite", "--quiet"])  # a model, then an adapter
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
