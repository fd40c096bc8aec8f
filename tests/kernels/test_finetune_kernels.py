"""``CausalLMFineTune(kernels=...)``: the switch reaches the model, and what it refuses before any model work."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.kernels.fused_lora import fused_lora_in
from lightning_blockwise.kernels.liger import liger_kernels_in
from lightning_blockwise.longcontext.tiling import tile_mlps
from lightning_blockwise.recipes import kernel_choice
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.kernel_choice import install_kernels, resolve_auto
from tests.helpers.models import NUM_LAYERS, build_model, trainer


def test_kernels_liger_installs_the_switch_after_the_adapters(checkpoints: dict[str, Path]) -> None:
    module = CausalLMFineTune(str(checkpoints["qwen2"]), lora_r=4, compute_dtype="float32", kernels="liger")
    module.configure_model()
    assert liger_kernels_in(module.model) == {"rms_norm": 2 * NUM_LAYERS + 1, "rope": NUM_LAYERS, "mlp": NUM_LAYERS}
    # The MLP's Liger forward calls the adapted linears.
    mlp = module.model.get_base_model().model.layers[0].mlp
    assert "lora_A" in dict(mlp.gate_proj.named_children())
    # Control: None leaves the model's own layers.
    plain = CausalLMFineTune(str(checkpoints["qwen2"]), lora_r=4, compute_dtype="float32", kernels=None)
    plain.configure_model()
    assert liger_kernels_in(plain.model) == {"rms_norm": 0, "rope": 0, "mlp": 0}
    assert not fused_lora_in(plain.model)


def test_kernels_liger_on_a_cpu_trainer_is_refused_before_the_base_loads(tmp_path: Path) -> None:
    # The checkpoint does not exist: the refusal comes before any loading.
    module = CausalLMFineTune("/no/such/checkpoint", kernels="liger")
    module.trainer = trainer("auto", default_root_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match=r"kernels='liger'\) needs a CUDA device.*on cpu"):
        module.configure_model()
    # Control: without the switch the same module goes on to load, and fails on the missing checkpoint instead.
    plain = CausalLMFineTune("/no/such/checkpoint")
    plain.trainer = trainer("auto", default_root_dir=tmp_path)
    with pytest.raises(Exception) as loading:
        plain.configure_model()
    assert "CUDA" not in str(loading.value)


def test_kernels_choices_and_combinations_are_checked_in_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MisconfigurationException, match=r"'unsloth' is not a kernel choice; choose 'auto', None"):
        CausalLMFineTune("/no/such/checkpoint", kernels=["fused_lora", "unsloth"])
    with pytest.raises(MisconfigurationException, match=r"use_dora=True\): the fused LoRA update computes plain LoRA"):
        CausalLMFineTune("/no/such/checkpoint", kernels="fused_lora", use_dora=True)
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    with pytest.raises(MisconfigurationException, match=r'pip install "lightning-blockwise\[kernels\]"'):
        CausalLMFineTune("/no/such/checkpoint", kernels="liger")
    monkeypatch.undo()
    # Control: each alone is taken.
    assert CausalLMFineTune("/no/such/checkpoint", kernels="liger").hparams.kernels == "liger"
    assert CausalLMFineTune("/no/such/checkpoint", mlp_tile_tokens=4096).mlp_tile_tokens == 4096
    assert CausalLMFineTune("/no/such/checkpoint", kernels="fused_lora", mlp_tile_tokens=4096).mlp_tile_tokens == 4096
    # Liger with tiled MLPs is its RMSNorm and RoPE (install_kernels), no longer refused.
    assert CausalLMFineTune("/no/such/checkpoint", kernels="liger", mlp_tile_tokens=4096).mlp_tile_tokens == 4096


def test_kernels_fused_lora_installs_on_every_adapted_linear_on_the_cpu(checkpoints: dict[str, Path]) -> None:
    module = CausalLMFineTune(
        str(checkpoints["qwen2"]), lora_r=4, compute_dtype="float32", kernels=["fused_lora"], mlp_tile_tokens=16
    )
    module.configure_model()
    assert fused_lora_in(module.model)
    assert liger_kernels_in(module.model) == {"rms_norm": 0, "rope": 0, "mlp": 0}
    # Control: None leaves PEFT's forward.
    plain = CausalLMFineTune(str(checkpoints["qwen2"]), lora_r=4, compute_dtype="float32", kernels=None)
    plain.configure_model()
    assert not fused_lora_in(plain.model)


def test_kernels_auto_is_the_default_and_takes_what_applies_here(
    checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """On the CPU: the fused update, not Liger (CUDA only), and the log says why."""
    module = CausalLMFineTune(str(checkpoints["qwen2"]), lora_r=4, compute_dtype="float32")
    assert module.hparams.kernels == "auto"
    with caplog.at_level(logging.INFO):
        module.configure_model()
    assert fused_lora_in(module.model)
    assert liger_kernels_in(module.model) == {"rms_norm": 0, "rope": 0, "mlp": 0}
    assert "kernels='auto'): fused_lora; no Liger-Kernel: its kernels need CUDA" in caplog.text
    # Control: DoRA adapters get no fused update (it computes plain LoRA only), and "auto" does not refuse them.
    dora = CausalLMFineTune(str(checkpoints["qwen2"]), lora_r=4, compute_dtype="float32", use_dora=True)
    dora.configure_model()
    assert not fused_lora_in(dora.model)


@pytest.mark.parametrize(
    ("device", "tile", "liger_installed", "expected"),
    [
        ("cuda", None, True, {"liger", "fused_lora"}),
        ("cuda", 4096, True, {"liger", "fused_lora"}),
        ("cuda", None, False, {"fused_lora"}),
        ("cpu", None, True, {"fused_lora"}),
    ],
    ids=["cuda", "tiled-mlp", "liger-missing", "cpu"],
)
def test_kernels_auto_takes_liger_only_where_it_applies(
    device: str, tile: int | None, liger_installed: bool, expected: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if not liger_installed:
        monkeypatch.setattr(kernel_choice.importlib.util, "find_spec", lambda name: None)
    model = build_model("llama")
    assert resolve_auto(model, device, tile) == expected


def test_fused_lora_for_a_dora_adapter_directory_is_refused_before_the_base_loads(tmp_path: Path) -> None:
    """With adapter_path the adapter's config decides DoRA (the constructor's use_dora is ignored)."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": True}))
    module = CausalLMFineTune("/no/such/checkpoint", kernels="fused_lora", adapter_path=str(adapter))
    with pytest.raises(MisconfigurationException, match=r"the adapter is DoRA.*Drop 'fused_lora'"):
        module.configure_model()
    # Control: a plain LoRA adapter passes the check and goes on to load (and fails on the missing checkpoint),
    # even with use_dora=True in the constructor, which the adapter's config overrides.
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "use_dora": False}))
    plain = CausalLMFineTune("/no/such/checkpoint", kernels="fused_lora", adapter_path=str(adapter), use_dora=True)
    with pytest.raises(Exception) as loading:
        plain.configure_model()
    assert "DoRA" not in str(loading.value)


def test_liger_with_tiled_mlps_installs_its_norms_and_rope_and_leaves_the_mlps_to_the_tiles() -> None:
    """``install_kernels(..., mlp_tiled=True)`` keeps Liger's SwiGLU off, so ``tile_mlps`` can tile every MLP after it.

    Control: untiled, Liger takes every MLP.
    """
    model = build_model("llama")
    install_kernels(model, frozenset({"liger"}), mlp_tiled=True)
    counts = liger_kernels_in(model)
    assert counts["rms_norm"] > 0 and counts["rope"] > 0 and counts["mlp"] == 0
    assert tile_mlps(model, 16) == NUM_LAYERS
    control = build_model("llama")
    install_kernels(control, frozenset({"liger"}))
    assert liger_kernels_in(control)["mlp"] == NUM_LAYERS
