"""``CausalLMFineTune`` follows the base its adapter or checkpoint records (recipes/base_record.py).

NOTE [ The training record of an adapter ] in export/training_record.py. Each test has its control: the adapter
loaded as its record says computes the trained logits (`torch.equal`), another dtype or format does not; another
base is refused, the same base at another path is not; a lean blockwise checkpoint resumed under `strategy="auto"`
over another base is refused, over its own base it resumes.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli.generate_command import _generate_parser, _module_arguments
from lightning_blockwise.export.training_record import CHECKPOINT_RECORD_KEY
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.generation import GeneratingFineTune
from tests.helpers.models import VOCAB, save_checkpoint, trainer

_INPUT = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _data() -> SyntheticTokensDataModule:
    return SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=4, batch_size=2)


def _logits(module: CausalLMFineTune) -> torch.Tensor:
    module.model.eval()
    with torch.no_grad():
        return module.model(input_ids=_INPUT).logits


@pytest.fixture(scope="module")
def dense_adapter(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """A ``quantize=False``, ``compute_dtype="float32"`` run's adapter, and its trained module's logits."""
    run = tmp_path_factory.mktemp("dense_adapter")
    torch.manual_seed(0)
    module = CausalLMFineTune(
        str(checkpoints["llama"]), lora_r=4, compute_dtype="float32", quantize=False, learning_rate=5e-2,
        warmup_steps=1, adapter_dir=str(run / "adapter"), kernels=None,
    )  # fmt: skip
    trainer(max_steps=2, accumulate_grad_batches=1, default_root_dir=run).fit(module, datamodule=_data())
    return run / "adapter", _logits(module)


def _from_adapter(base: Path, adapter: Path, **kwargs: object) -> CausalLMFineTune:
    module = CausalLMFineTune(str(base), adapter_path=str(adapter), kernels=None, **kwargs)
    module.configure_model()
    return module


def test_an_adapter_path_loads_the_base_as_its_record_says(
    checkpoints: dict[str, Path], dense_adapter: tuple[Path, torch.Tensor]
) -> None:
    adapter, trained = dense_adapter
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        module = _from_adapter(checkpoints["llama"], adapter)
    assert (module.hparams.compute_dtype, module.hparams.quantize) == ("float32", False)
    assert torch.equal(_logits(module), trained)
    # `generate --adapter` builds the same module: the record decides there too.
    options = _generate_parser().parse_args([str(checkpoints["llama"]), "--adapter", str(adapter)])
    generating = GeneratingFineTune(**_module_arguments(options))
    assert (generating.hparams.compute_dtype, generating.hparams.quantize) == ("float32", False)

    # Controls: what the module did before (bfloat16, NF4) is asked for explicitly, is warned about, and differs.
    with pytest.warns(UserWarning, match=r"compute_dtype='bfloat16'.*trained with compute dtype 'float32'"):
        other_dtype = _from_adapter(checkpoints["llama"], adapter, compute_dtype="bfloat16")
    assert not torch.equal(_logits(other_dtype).float(), trained)
    with pytest.warns(UserWarning, match=r"quantize=True.*trained over the dense base"):
        nf4 = _from_adapter(checkpoints["llama"], adapter, quantize=True)
    assert not torch.equal(_logits(nf4), trained)


def test_an_adapter_over_another_base_is_refused_unless_allowed(
    checkpoints: dict[str, Path], dense_adapter: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    adapter = dense_adapter[0]
    other = save_checkpoint("llama", tmp_path / "other", seed=1)
    with pytest.raises(MisconfigurationException, match=r"the adapter .* was trained over `.*llama` .* differs in its"
                       r" weights: .* Give `checkpoint='.*llama'` .* or `allow_other_base=True`"):  # fmt: skip
        _from_adapter(other, adapter)
    with pytest.warns(UserWarning, match="differs in its weights; going on over this base"):
        _from_adapter(other, adapter, allow_other_base=True)
    # Control: the same base at another path is the same base.
    moved = shutil.copytree(checkpoints["llama"], tmp_path / "moved")
    assert torch.equal(_logits(_from_adapter(moved, adapter)), dense_adapter[1])


def test_a_lean_blockwise_checkpoint_resumed_under_auto_over_another_base_is_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    base, other = checkpoints["llama"], save_checkpoint("llama", tmp_path / "other", seed=1)

    def module(checkpoint: Path, name: str, **kwargs: object) -> CausalLMFineTune:
        return CausalLMFineTune(
            str(checkpoint), lora_r=4, warmup_steps=1, kernels=None, adapter_dir=str(tmp_path / name), **kwargs
        )

    torch.manual_seed(0)
    first = trainer(BlockwiseStrategy(), max_steps=2, accumulate_grad_batches=1, default_root_dir=tmp_path)
    first.fit(module(base, "first"), datamodule=_data())
    first.save_checkpoint(tmp_path / "lean.ckpt")  # lean: the frozen base is left out
    resume = dict(max_steps=3, accumulate_grad_batches=1, default_root_dir=tmp_path)
    refused = r"the checkpoint was trained over `.*llama` .* this base `.*other` .* weights: .* `allow_other_base=True`"
    with pytest.raises(MisconfigurationException, match=refused):
        trainer("auto", **resume).fit(module(other, "refused"), datamodule=_data(), ckpt_path=tmp_path / "lean.ckpt")
    with pytest.warns(UserWarning, match="differs in its weights; going on over this base"):
        allowed = trainer("auto", **resume)
        allowed.fit(
            module(other, "allowed", allow_other_base=True), datamodule=_data(), ckpt_path=tmp_path / "lean.ckpt"
        )
    # Control: without the module's record (as before it was written) the same resume goes on silently.
    unrecorded = torch.load(tmp_path / "lean.ckpt", weights_only=False)
    del unrecorded[CHECKPOINT_RECORD_KEY]
    torch.save(unrecorded, tmp_path / "unrecorded.ckpt")
    silent = trainer("auto", **resume)
    silent.fit(module(other, "silent"), datamodule=_data(), ckpt_path=tmp_path / "unrecorded.ckpt")
    assert silent.global_step == 3
    # Control: over its own base the same checkpoint resumes under `auto`.
    resumed = trainer("auto", **resume)
    resumed.fit(module(base, "resumed"), datamodule=_data(), ckpt_path=tmp_path / "lean.ckpt")
    assert resumed.global_step == 3
