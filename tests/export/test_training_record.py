"""The compute dtype an adapter records (export/training_record.py) and what ``export --merge`` does with it.

NOTE [ The training record of an adapter ]: a merge from an adapter directory quantizes the base in the
dtype training used, read from the record, or warns. Each equality has a control: the bfloat16 merge,
which the tiny Llama's fp32 training does not match.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import PeftModel
from safetensors import safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.export.adapter import export_adapter, previous_export
from lightning_blockwise.export.merge import export
from lightning_blockwise.export.training_record import TRAINING_RECORD, read_training_record, write_training_record
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from tests.helpers.models import VOCAB, build_model, trainer


@pytest.fixture(scope="module")
def fp32_run(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ``CausalLMFineTune(compute_dtype="float32")`` run: its exported ``adapter/`` and its ``run.ckpt``."""
    run = tmp_path_factory.mktemp("fp32_run")
    torch.manual_seed(0)
    module = CausalLMFineTune(
        str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", learning_rate=1e-2, warmup_steps=1,
        adapter_dir=str(run / "adapter"),
    )  # fmt: skip
    fitter = trainer(BlockwiseStrategy(), max_steps=2, accumulate_grad_batches=1, default_root_dir=run)
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=4, batch_size=2))
    fitter.save_checkpoint(run / "run.ckpt")
    return run


def _written(directory: Path) -> dict[str, Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def _differing(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return sorted(key for key in a if a[key].dtype != b[key].dtype or not torch.equal(a[key], b[key]))


def _dtype_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "compute dtype" in str(w.message) or "--compute-dtype" in str(w.message)]


def test_the_record_is_written_beside_the_adapter_and_peft_ignores_it(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    model = build_model("llama", seed=0)
    adapter = export_adapter(model, tmp_path / "adapter", compute_dtype="float32")
    assert read_training_record(adapter).compute_dtype == torch.float32
    assert previous_export(adapter) == "adapter"  # the record is one of an adapter export's files
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoints["llama"]), adapter)
    assert not [w for w in caught if "Unexpected keyword" in str(w.message)]
    # Control: without the argument there is no record, as for an adapter PEFT saved alone.
    assert read_training_record(export_adapter(model, tmp_path / "plain")) is None
    assert not (tmp_path / "plain" / TRAINING_RECORD).exists()


def test_a_record_that_is_not_ours_is_refused_and_a_bad_dtype_is_not_written(tmp_path: Path) -> None:
    (tmp_path / TRAINING_RECORD).write_text('{"compute_dtype": "int8"}')
    with pytest.raises(MisconfigurationException, match=r"does not record a compute dtype.*give --compute-dtype"):
        read_training_record(tmp_path)
    (tmp_path / TRAINING_RECORD).write_text("not json")
    with pytest.raises(MisconfigurationException, match="Fix or delete the file"):
        read_training_record(tmp_path)
    with pytest.raises(ValueError, match="'int8' is not one of"):
        write_training_record(tmp_path, "int8")
    write_training_record(tmp_path, torch.bfloat16)  # control: a dtype is written by its name
    assert read_training_record(tmp_path).compute_dtype == torch.bfloat16


def test_a_merge_from_an_fp32_adapter_uses_its_record(
    checkpoints: dict[str, Path], fp32_run: Path, tmp_path: Path
) -> None:
    base, adapter = checkpoints["llama"], fp32_run / "adapter"
    assert read_training_record(adapter).compute_dtype == torch.float32  # `CausalLMFineTune` recorded its compute dtype
    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export(adapter, base, tmp_path / "recorded", merge="fp32", progress=False, report=said.append)
        export(adapter, base, tmp_path / "flag", merge="fp32", compute_dtype="float32", progress=False)
    assert _dtype_warnings(caught) == []
    assert said == ["lightning-blockwise export: merging with compute dtype float32 (recorded with the adapter)."]
    recorded, flag = _written(tmp_path / "recorded"), _written(tmp_path / "flag")
    assert _differing(recorded, flag) == []

    # Control: a bfloat16 merge of the same adapter is another model, and the flag that asks for it warns.
    with pytest.warns(UserWarning, match="--compute-dtype bfloat16 differs from the float32 that .* was trained with"):
        export(adapter, base, tmp_path / "bf16", merge="fp32", compute_dtype="bfloat16", progress=False)
    assert _differing(recorded, _written(tmp_path / "bf16")) != []
    assert "**Not the model that was trained.**" in (tmp_path / "bf16" / "README.md").read_text()
    card = (tmp_path / "recorded" / "README.md").read_text()
    assert "**Not the model that was trained.**" not in card and "exactly as training loaded it" in card


def test_an_adapter_without_a_record_warns_and_names_the_flag(
    checkpoints: dict[str, Path], fp32_run: Path, tmp_path: Path
) -> None:
    base, older = checkpoints["llama"], tmp_path / "older"
    shutil.copytree(fp32_run / "adapter", older)
    (older / TRAINING_RECORD).unlink()  # as an older export, or PEFT alone, wrote it
    with pytest.warns(UserWarning, match=r"does not record the compute dtype .* give it as --compute-dtype"):
        export(older, base, tmp_path / "merged", merge="fp32", progress=False)
    with pytest.warns(UserWarning, match="differs from the float32"):
        export(fp32_run / "adapter", base, tmp_path / "bf16", merge="fp32", compute_dtype="bfloat16", progress=False)
    assert _differing(_written(tmp_path / "merged"), _written(tmp_path / "bf16")) == []  # bfloat16, as it warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export(older, base, tmp_path / "flag", merge="fp32", compute_dtype="float32", progress=False)
        export(older, base, tmp_path / "adapter_only", progress=False)  # no merge, no dtype: nothing to say
    assert _dtype_warnings(caught) == []  # control: with the flag given there is nothing to warn about


def test_an_adapter_exported_from_a_checkpoint_keeps_its_record(
    checkpoints: dict[str, Path], fp32_run: Path, tmp_path: Path
) -> None:
    base = checkpoints["llama"]
    export(fp32_run / "run.ckpt", base, tmp_path / "adapter", progress=False)
    assert read_training_record(tmp_path / "adapter").compute_dtype == torch.float32
    export(tmp_path / "adapter", base, tmp_path / "merged", merge="fp32", progress=False)
    export(fp32_run / "run.ckpt", base, tmp_path / "from_ckpt", merge="fp32", progress=False)
    assert _differing(_written(tmp_path / "merged"), _written(tmp_path / "from_ckpt")) == []
