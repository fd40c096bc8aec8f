"""Registration, device selection, YAML forms, lifecycle invariants and user errors of `BlockwiseStrategy`."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import lightning.fabric.accelerators.cuda as fabric_cuda
import lightning.pytorch.accelerators.cuda as pl_cuda
import pytest
import torch
import transformers
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

import lightning_blockwise
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay import remat
from tests.helpers.models import (
    CausalLMModule,
    assert_equal_runs,
    build_model,
    fit,
    loader,
    padded_batches,
    trainer,
)


def test_import_registers_blockwise_once() -> None:
    assert "blockwise" in StrategyRegistry
    importlib.reload(lightning_blockwise)  # a second registration must not raise
    assert StrategyRegistry["blockwise"]["strategy"].__name__ == "BlockwiseStrategy"
    assert isinstance(trainer("blockwise").strategy, BlockwiseStrategy)


def test_string_strategy_lands_on_cpu() -> None:
    assert trainer("blockwise").strategy.root_device == torch.device("cpu")


def test_string_strategy_lands_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Trainer(strategy="blockwise", accelerator="gpu")` must not leave the strategy on the CPU."""
    monkeypatch.setattr(fabric_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(pl_cuda, "num_cuda_devices", lambda: 2)
    monkeypatch.setattr(pl_cuda.CUDAAccelerator, "is_available", staticmethod(lambda: True))
    assert trainer("blockwise", accelerator="gpu").strategy.root_device == torch.device("cuda", 0)
    assert trainer("blockwise", accelerator="gpu", devices=[1]).strategy.root_device == torch.device("cuda", 1)
    # Two devices: two processes, data-parallel (tests/distributed); one: no DistributedSampler, and a launcher that
    # only checks the Lightning namespaces of what it runs (strategy/namespace_check.py) in this process.
    two = trainer("blockwise", accelerator="gpu", devices=2)
    assert two.strategy.root_device == torch.device("cuda", 0) and two.strategy.launcher is not None
    assert two._accelerator_connector.is_distributed and two.strategy.distributed_sampler_kwargs["num_replicas"] == 2
    one = trainer("blockwise", accelerator="gpu", devices=1)
    assert (
        type(one.strategy.launcher).__name__ == "_InProcessLauncher" and not one._accelerator_connector.is_distributed
    )


def test_instance_keeps_its_options() -> None:
    strategy = trainer(BlockwiseStrategy(block_size=3, prefetch_depth=4)).strategy
    assert (strategy.options.block_size, strategy.options.prefetch_depth, strategy.root_device.type) == (3, 4, "cpu")


@pytest.mark.parametrize(
    "strategy_yaml",
    [
        "blockwise",
        {"class_path": "lightning_blockwise.BlockwiseStrategy", "init_args": {"block_size": 2, "prefetch_depth": 3}},
    ],
)
def test_lightning_cli_yaml_forms(tmp_path: Path, strategy_yaml: Any) -> None:
    import yaml

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"trainer": {"strategy": strategy_yaml, "accelerator": "cpu", "logger": False}}))
    cli = LightningCLI(LightningModule, run=False, args=["--config", str(config)])
    assert isinstance(cli.trainer.strategy, BlockwiseStrategy)
    if isinstance(strategy_yaml, dict):
        assert (cli.trainer.strategy.options.block_size, cli.trainer.strategy.options.prefetch_depth) == (2, 3)


def test_module_is_restored_and_reusable_after_fit() -> None:
    module = CausalLMModule(lambda: build_model("mistral"))
    layers = module.model.get_decoder().layers
    classes_before = {type(layer): type(layer).forward for layer in layers}
    names_before = [n for n, _ in module.named_parameters()]
    keys_before = list(module.state_dict())

    fit(module, "blockwise")
    assert all(remat.installed(layer) is None for layer in layers)
    assert all("gradient_checkpointing" not in vars(layer) for layer in layers)
    assert {type(layer): type(layer).forward for layer in layers} == classes_before
    assert [n for n, _ in module.named_parameters()] == names_before
    assert list(module.state_dict()) == keys_before

    val = loader(padded_batches(2))
    trainer("blockwise", limit_val_batches=None).validate(module, val)
    trainer("blockwise", limit_test_batches=None).test(module, val)
    predictions = trainer("blockwise").predict(module, val)
    assert len(module.val_losses) == 4 and len(predictions) == 2
    steps_before = len(module.losses)
    fit(module, "blockwise", max_steps=2)
    assert len(module.losses) == steps_before + 4


def test_names_and_state_dict_keys_unchanged_while_installed() -> None:
    module = CausalLMModule(lambda: build_model("qwen2"))
    names = [n for n, _ in module.named_parameters()]
    keys = list(module.state_dict())
    layers = module.model.get_decoder().layers
    remat.install(list(layers), [[] for _ in layers], lightning_blockwise.residency.AlwaysResident())
    try:
        assert all(remat.installed(layer) is not None for layer in layers)
        assert [n for n, _ in module.named_parameters()] == names
        assert list(module.state_dict()) == keys
    finally:
        remat.uninstall(list(layers))


def test_resident_run_after_blockwise_run_is_unaffected() -> None:
    """Nothing is patched on classes or globally: a resident run after a blockwise one matches a fresh one."""
    before = fit(CausalLMModule(lambda: build_model("phi3")), "auto")
    fit(CausalLMModule(lambda: build_model("phi3")), "blockwise")
    after = fit(CausalLMModule(lambda: build_model("phi3")), "auto")
    assert_equal_runs(before, after)


def test_trainer_fit_again_with_blockwise_matches_a_two_phase_resident_run() -> None:
    resident = CausalLMModule(lambda: build_model("qwen3"))
    blockwise = CausalLMModule(lambda: build_model("qwen3"))
    fit(resident, "auto", max_steps=2)
    fit(blockwise, "blockwise", max_steps=2)
    assert_equal_runs(fit(resident, "auto", max_steps=2), fit(blockwise, "blockwise", max_steps=2))


# ---------------------------------------------------------------------------------------------- errors


class _Trainable(LightningModule):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        raise AssertionError("the strategy must refuse this module before any step")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _NoHuggingFace(_Trainable):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)


def _fit_expecting(module: LightningModule, match: str, strategy: Any = "blockwise") -> None:
    with pytest.raises(MisconfigurationException, match=match):
        trainer(strategy).fit(module, loader(padded_batches(2)))


def test_error_no_hugging_face_model() -> None:
    _fit_expecting(_NoHuggingFace(), "found no Hugging Face `PreTrainedModel`")


def test_error_no_decoder_stack() -> None:
    class Encoder(_Trainable):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.BertConfig(
                vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
            )
            self.model = transformers.BertForMaskedLM(config)

    _fit_expecting(Encoder(), r"found no decoder stack.*module lists inside it: `bert.encoder.layer`")


@pytest.mark.parametrize("allow_unvalidated", [False, True])
def test_error_layers_not_at_get_decoder_layers_names_where_they_are(allow_unvalidated: bool) -> None:
    # GPT-2 is a causal LM, but keeps its layers at `transformer.h`: the refusal says that, not "not decoder-only",
    # and says the opt-in does not help (it is refused the same with the opt-in).
    def build() -> nn.Module:
        from peft import LoraConfig, get_peft_model

        config = transformers.GPT2Config(vocab_size=96, n_embd=16, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1)
        model = transformers.AutoModelForCausalLM.from_config(config)
        return get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))

    match = (
        r"found no decoder stack in `model.base_model.model` \(GPT2LMHeadModel, model_type 'gpt2'\): it streams"
        r" the layers at `get_decoder\(\).layers`.*`GPT2LMHeadModel.get_decoder\(\)` is a `GPT2Model` with no"
        r" `layers` \(module lists inside it: `transformer.h`\).*`BlockwiseStrategy\(allow_unvalidated=True\)`"
        r" would not help"
    )
    _fit_expecting(CausalLMModule(build), match, BlockwiseStrategy(allow_unvalidated=allow_unvalidated))


def test_error_trainable_base_weight() -> None:
    module = CausalLMModule(lambda: build_model("llama"))
    module.model.get_decoder().layers[1].mlp.down_proj.base_layer.weight.requires_grad_(True)
    _fit_expecting(module, r"`layers.1.mlp.down_proj.base_layer.weight` is trainable and is not a PEFT adapter")


def test_error_no_adapters() -> None:
    frozen = CausalLMModule(lambda: build_model("llama", peft=False).requires_grad_(False))
    frozen.model.lm_head.requires_grad_(True)  # something to optimize, but no adapter in the layers
    _fit_expecting(frozen, "no trainable adapter")


def test_validate_needs_no_adapters() -> None:
    module = CausalLMModule(lambda: build_model("llama", peft=False).requires_grad_(False))
    trainer("blockwise", limit_val_batches=None).validate(module, loader(padded_batches(1)))
    assert len(module.val_losses) == 1


def test_error_unvalidated_architecture_and_opt_in() -> None:
    def build() -> nn.Module:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        config = transformers.OlmoConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
        )
        return get_peft_model(
            transformers.AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        )

    _fit_expecting(CausalLMModule(build), r"has not validated model_type 'olmo'.*allow_unvalidated=True")
    resident = fit(CausalLMModule(build), "auto")
    opted_in = fit(CausalLMModule(build), BlockwiseStrategy(allow_unvalidated=True))
    assert_equal_runs(resident, opted_in)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": -1},
        {"prefetch_depth": 0},
        {"block_size": True},
        {"block_size": 2.5},
        {"prefetch_depth": "2"},
        {"budget_tokens": 0},
    ],
)
def test_error_bad_options(kwargs: dict[str, Any]) -> None:
    with pytest.raises(MisconfigurationException, match="must be an integer of at least 1"):
        BlockwiseStrategy(**kwargs)


def test_error_find_unused_parameters_is_refused_at_construction() -> None:
    """On 2 gloo ranks it fails in the first backward ("Expected to mark a variable ready only once")."""
    with pytest.raises(MisconfigurationException, match=r"find_unused_parameters.*ready twice.*Leave it False"):
        BlockwiseStrategy(ddp_kwargs={"find_unused_parameters": True})
    # Control: other DDP options, and False, are taken.
    assert BlockwiseStrategy(ddp_kwargs={"find_unused_parameters": False, "bucket_cap_mb": 1})._ddp_kwargs


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        ("-1GB", "must be positive"),
        (0, "must be positive"),
        (-5, "must be positive"),
        ("0GiB", "must be positive"),
        ("inf", "not finite"),
        ("nanGB", "not finite"),
        (float("inf"), r"\(float\)"),
        (16e9, r"\(float\)"),
        (True, r"\(bool\)"),
        ("lots", "Cannot read"),
    ],
)
def test_error_bad_vram_budget_when_built(budget: Any, match: str) -> None:
    """Refused when the strategy is built, before any model work, naming the option."""
    with pytest.raises(MisconfigurationException, match=rf"BlockwiseStrategy\(vram_budget=.*{match}"):
        BlockwiseStrategy(vram_budget=budget)


def test_vram_budget_accepts_bytes_and_sizes() -> None:
    assert BlockwiseStrategy(vram_budget=2**30).options.vram_budget == 2**30
    assert BlockwiseStrategy(vram_budget="1.5GiB").options.vram_budget == 3 * 2**29


@pytest.mark.parametrize("how", ["module", "inner"])
def test_error_torch_compile_is_refused_before_packing(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`torch.compile` (of the LightningModule, or of the Hugging Face model inside it) is refused at setup."""
    packed = []
    monkeypatch.setattr("lightning_blockwise.residency.placement.host_copy", lambda *a, **k: packed.append(1))
    module = CausalLMModule(lambda: build_model("llama"))
    if how == "inner":
        module.model = torch.compile(module.model)
        target: Any = module
    else:
        target = torch.compile(module)
    # A compiled LightningModule is refused by Lightning itself (a ParallelStrategy other than DDP/FSDP), first.
    error, match = (MisconfigurationException, r"does not support `torch\.compile`")
    if how == "module":
        error, match = (RuntimeError, "compiled model is incompatible with the current strategy: `BlockwiseStrategy`")
    with pytest.raises(error, match=match):
        trainer("blockwise").fit(target, loader(padded_batches(2)))
    assert not packed


def test_error_block_size_larger_than_layer_count() -> None:
    _fit_expecting(
        CausalLMModule(lambda: build_model("llama")),
        r"block_size=5\).*4 decoder layers",
        BlockwiseStrategy(block_size=5),
    )


def test_error_two_hugging_face_models() -> None:
    module = CausalLMModule(lambda: build_model("llama"))
    module.reference = build_model("llama", peft=False)
    _fit_expecting(module, "holds 2 Hugging Face models")


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_error_cpu_eval_mode_4bit_at_setup_before_sanity_check_and_parity_check(
    checkpoints: dict[str, Path], mode: str
) -> None:
    """Refused at setup: no sanity validation ran and `ParityCheck` reported nothing (control: train mode runs both)."""
    from lightning_blockwise.callbacks.parity import ParityCheck

    model = build_model("llama", checkpoint=checkpoints["llama"], quantized=True, lora_dropout=0.0)
    module = CausalLMModule(lambda: model.train(mode == "train"))
    check = ParityCheck()
    run = trainer("blockwise", callbacks=[check], num_sanity_val_steps=1, limit_val_batches=1, max_steps=1)
    data = loader(padded_batches(2))
    if mode == "train":
        run.fit(module, data, data)
        assert len(module.val_losses) >= 1 and check.result is not None and check.result.passed
        return
    with pytest.raises(MisconfigurationException, match=r"4-bit layers are in eval mode.*model.train\(\)"):
        run.fit(module, data, data)
    assert module.val_losses == [] and check.result is None


@pytest.mark.parametrize("name", ["save_frozen_base", "allow_unvalidated"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_error_bool_options_refuse_anything_else(name: str, value: Any) -> None:
    # `save_frozen_base="no"` is truthy: every checkpoint would carry the whole base.
    match = rf"`BlockwiseStrategy\({name}=.*must be True or False.*unquoted in YAML"
    with pytest.raises(MisconfigurationException, match=match):
        BlockwiseStrategy(**{name: value})
    for ok in (True, False):
        assert getattr(BlockwiseStrategy(**{name: ok}).options, name) is ok


def test_vram_budget_on_the_cpu_warns_it_has_no_effect() -> None:
    with pytest.warns(UserWarning, match=r"vram_budget=1073741824\)` has no effect on the CPU.*Drop `vram_budget`"):
        fit(CausalLMModule(lambda: build_model("llama")), BlockwiseStrategy(vram_budget="1GiB"), max_steps=1)


def test_no_vram_budget_on_the_cpu_no_warning(recwarn: pytest.WarningsRecorder) -> None:
    """Control: the warning is the budget's, not any CPU run's."""
    fit(CausalLMModule(lambda: build_model("llama")), "blockwise", max_steps=1)
    assert not [w for w in recwarn if "has no effect on the CPU" in str(w.message)]


def test_find_decoder_stack_on_a_bare_hugging_face_model() -> None:
    from lightning_blockwise.architectures import find_decoder_stack

    model = build_model("llama", peft=False)
    stack = find_decoder_stack(model)
    assert stack.model is model and stack.layers is model.model.layers


def test_error_nccl_on_cpus_before_any_process_starts() -> None:
    with pytest.raises(MisconfigurationException, match="NCCL reduces CUDA tensors only"):
        trainer(BlockwiseStrategy(process_group_backend="nccl"), accelerator="cpu", devices=2)
    # One process needs no process group, whatever the backend named.
    assert trainer(BlockwiseStrategy(process_group_backend="nccl"), accelerator="cpu", devices=1).strategy
