"""A merge follows the adapter's training record: NF4 or dense, the compute dtype, and the base it was trained over.

NOTE [ The training record of an adapter ] in export/training_record.py. A dense-trained adapter
(`CausalLMFineTune(quantize=False)`) merges into the checkpoint's weights, and the merged model computes the
trained module's logits (up to float32 rounding: `LOGIT_TOLERANCE`); the control, the NF4 merge the export made
before, is far off. Another base than the recorded one is refused; the control is the same base at another path.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import AutoModelForCausalLM

from lightning_blockwise.export.merge import export
from lightning_blockwise.export.training_record import TRAINING_RECORD, TrainingRecord, read_training_record
from lightning_blockwise.loading.base_identity import base_identity
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from tests.helpers.models import VOCAB, save_checkpoint, trainer

#: How far the merged float32 model's logits may be from the trained module's: `x (W + s B A)^T` against
#: `x W^T + s (x A^T) B^T` rounds differently in float32 (measured here: 1.5e-7 on logits up to 0.36, a few float32
#: ulps); the NF4 merge is 4.6e-3 off.
LOGIT_TOLERANCE = 1e-5
_INPUT = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def dense_run(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A ``CausalLMFineTune(quantize=False, compute_dtype="float32")`` run: its directory and its trained logits."""
    run = tmp_path_factory.mktemp("dense_run")
    torch.manual_seed(0)
    module = CausalLMFineTune(
        str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", quantize=False, learning_rate=5e-2,
        warmup_steps=1, adapter_dir=str(run / "adapter"), kernels=None,
    )  # fmt: skip
    fitter = trainer(max_steps=3, accumulate_grad_batches=1, default_root_dir=run)
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=6, batch_size=2))
    fitter.save_checkpoint(run / "run.ckpt")
    module.model.eval()
    with torch.no_grad():
        logits = module.model(input_ids=_INPUT).logits
    return run, logits


def _logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=_INPUT).logits


def test_the_record_says_dense_and_names_the_base(
    checkpoints: dict[str, Path], dense_run: tuple[Path, torch.Tensor]
) -> None:
    record = read_training_record(dense_run[0] / "adapter")
    assert record == TrainingRecord(torch.float32, quantize=False, base=base_identity(checkpoints["llama"]))


def test_a_dense_trained_adapter_merges_into_the_dense_base(
    checkpoints: dict[str, Path], dense_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    run, trained = dense_run
    base = checkpoints["llama"]
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the record says everything: nothing to warn about
        export(run / "adapter", base, tmp_path / "merged", merge="fp32", progress=False, report=said.append)
    assert said == [
        "lightning-blockwise export: merging with dense base (recorded with the adapter), compute dtype float32"
        " (recorded with the adapter)."
    ]
    merged = _logits(tmp_path / "merged")
    assert (merged - trained).abs().max().item() <= LOGIT_TOLERANCE
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "Not the model that was trained" not in card and "the dense base the adapter was trained over" in card

    # The run's `.ckpt` records `quantize=False` as well: the same merge, bit for bit.
    export(run / "run.ckpt", base, tmp_path / "from_ckpt", merge="fp32", progress=False)
    assert torch.equal(_logits(tmp_path / "from_ckpt"), merged)

    # Control: the NF4 merge (what the export did before the record said dense) is another model, far off.
    with pytest.warns(UserWarning, match="trained over the dense base, and --nf4-base merges it into the NF4 one"):
        export(run / "adapter", base, tmp_path / "nf4", merge="fp32", quantize=True, progress=False)
    assert (_logits(tmp_path / "nf4") - trained).abs().max().item() > 100 * LOGIT_TOLERANCE
    assert "**Not the model that was trained.**" in (tmp_path / "nf4" / "README.md").read_text()


def test_an_older_record_keeps_the_nf4_merge(
    checkpoints: dict[str, Path], dense_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    older = tmp_path / "older"
    shutil.copytree(dense_run[0] / "adapter", older)
    (older / TRAINING_RECORD).write_text('{"compute_dtype": "float32"}')  # as the record was before it said more
    export(older, checkpoints["llama"], tmp_path / "nf4", merge="fp32", progress=False)
    export(older, checkpoints["llama"], tmp_path / "dense", merge="fp32", quantize=False, progress=False)
    assert (_logits(tmp_path / "nf4") - dense_run[1]).abs().max().item() > 100 * LOGIT_TOLERANCE
    assert (_logits(tmp_path / "dense") - dense_run[1]).abs().max().item() <= LOGIT_TOLERANCE


def test_another_base_is_refused_unless_allowed(
    checkpoints: dict[str, Path], dense_run: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    adapter, other = dense_run[0] / "adapter", save_checkpoint("llama", tmp_path / "other", seed=1)
    refused = r"trained over `.*` \(config .*\), and BASE `.*other` .* differs in its weights: .* or --allow-other-base"
    with pytest.raises(MisconfigurationException, match=refused):
        export(adapter, other, tmp_path / "refused", merge="fp32", progress=False)
    assert not (tmp_path / "refused").exists()
    with pytest.warns(UserWarning, match="differs in its weights; merging into it as --allow-other-base asks"):
        export(adapter, other, tmp_path / "allowed", merge="fp32", allow_other_base=True, progress=False)
    # Control: the same base at another path is the same base: merged without a word.
    moved = shutil.copytree(checkpoints["llama"], tmp_path / "moved")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        export(adapter, moved, tmp_path / "moved_merged", merge="fp32", progress=False)
