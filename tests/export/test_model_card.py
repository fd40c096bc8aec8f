"""The merged model's ``README.md`` (export/model_card.py): it names the export's directory, not its staging one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_blockwise.export import adapter as adapter_module
from lightning_blockwise.export.merge import export


@pytest.fixture(scope="module")
def adapter(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"])
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    directory = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(directory)
    return directory


def test_the_card_names_the_final_directory_never_the_staging_one(
    checkpoints: dict[str, Path], adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    staged: list[Path] = []
    real = adapter_module.scratch_directory

    def recorded(*args: object) -> Path:
        staged.append(real(*args))
        return staged[-1]

    monkeypatch.setattr(adapter_module, "scratch_directory", recorded)
    out = tmp_path / "merged_fp32"
    with pytest.warns(UserWarning, match="does not record the compute dtype"):
        export(adapter, checkpoints["llama"], out, merge="fp32", progress=False)
    card = (out / "README.md").read_text()
    assert f"\n# {out.name}\n" in card
    assert f'AutoModelForCausalLM.from_pretrained("{out.resolve()}")' in card
    assert "does not record the compute dtype it was trained with; bfloat16 was assumed" in card  # a PEFT-only adapter
    # Control: the staging directory existed, named otherwise, and no file written names it.
    [staging] = staged
    assert staging.name != out.name and not staging.exists()
    for file in out.iterdir():
        assert staging.name not in file.read_bytes().decode("utf-8", errors="replace"), file.name
