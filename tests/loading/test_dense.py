"""`load_blockwise(quantize=False)` (a dense base) and mixed bases (NF4 attention, fused bf16 experts) on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import CONFIGS, moe_config


def _save(config: object, path: Path, dtype: torch.dtype, max_shard_size: str | None = None) -> Path:
    torch.manual_seed(0)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A bf16 Llama, an fp32 sharded Qwen2 (cast on load), a bf16 Qwen3-MoE and an NF4 pre-quantized Llama."""
    root = tmp_path_factory.mktemp("dense")
    paths = {
        "llama-bf16": _save(CONFIGS["llama"](), root / "llama-bf16", torch.bfloat16),
        "qwen2-fp32-sharded": _save(CONFIGS["qwen2"](), root / "qwen2-fp32", torch.float32, max_shard_size="40KB"),
        "qwen3_moe-bf16": _save(moe_config(), root / "qwen3_moe-bf16", torch.bfloat16),
    }
    quantized = AutoModelForCausalLM.from_pretrained(
        paths["llama-bf16"], quantization_config=nf4_config(torch.bfloat16), device_map="cpu"
    )
    quantized.save_pretrained(root / "llama-nf4")
    paths["llama-nf4"] = root / "llama-nf4"
    return paths


def _dense(path: Path, block_size: int = 2) -> PreTrainedModel:
    return load_blockwise(path, device="cpu", block_size=block_size, progress=False, share=False, quantize=False)


def _assert_same_state(expected: nn.Module, actual: nn.Module) -> None:
    """Every state-dict entry (4-bit packed weights and quant states included) has the same dtype, shape and bytes."""
    a, b = expected.state_dict(), actual.state_dict()
    assert a.keys() == b.keys() and len(a) > 0
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and tensor.shape == b[name].shape, name
        assert torch.equal(tensor, b[name]), name


def _assert_in_arena(model: PreTrainedModel) -> None:
    """Every decoder-layer tensor is a view of the host arena, which was sized exactly."""
    copy = host_copy_of(model)
    assert copy is not None and copy.is_bound()
    assert [layout.nbytes for layout in copy.layouts] == [slab.numel() for slab in copy.arena.slabs]
    arena = copy.arena.storage
    for param in model.get_decoder().layers.parameters():
        start = param.untyped_storage().data_ptr()
        assert arena.data_ptr() <= start < arena.data_ptr() + arena.numel()


@pytest.mark.parametrize("name", ["llama-bf16", "qwen2-fp32-sharded", "qwen3_moe-bf16"])
def test_dense_bytes_equal_from_pretrained(saved: dict[str, Path], name: str) -> None:
    """bf16 into the arena: `from_pretrained(path, dtype=bfloat16)` byte for byte, no 4-bit layer, no 4-bit flag."""
    expected = AutoModelForCausalLM.from_pretrained(saved[name], dtype=torch.bfloat16, device_map="cpu")
    actual = _dense(saved[name])
    _assert_same_state(expected, actual)
    assert all(t.dtype == torch.bfloat16 for t in actual.state_dict().values() if t.is_floating_point())
    assert not getattr(actual, "is_loaded_in_4bit", False) and actual.training
    assert not any(type(m).__name__ == "Linear4bit" for m in actual.modules())
    _assert_in_arena(actual)


def test_mixed_moe_bytes_equal_nf4_from_pretrained(saved: dict[str, Path]) -> None:
    """Qwen3-MoE as NF4: attention quantized, the per-expert checkpoint weights fused into bf16 3-D experts.

    Before `loading/conversions.py` this load failed: the checkpoint's `mlp.experts.<i>.up_proj.weight` keys are not
    the model's `mlp.experts.gate_up_proj`, and only `from_pretrained` knew how to map them.
    """
    path = saved["qwen3_moe-bf16"]
    expected = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=nf4_config(torch.bfloat16), dtype=torch.bfloat16, device_map="cpu"
    ).train()
    actual = load_blockwise(path, device="cpu", block_size=2, progress=False, share=False)
    _assert_same_state(expected, actual)
    layer = actual.model.layers[0]
    assert type(layer.self_attn.q_proj).__name__ == "Linear4bit"
    assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16 and layer.mlp.experts.gate_up_proj.dim() == 3
    _assert_in_arena(actual)


def test_control_one_changed_expert_element_is_caught(saved: dict[str, Path]) -> None:
    """The comparison above sees one changed element of a fused expert tensor, and one expert stacked out of order."""
    path = saved["qwen3_moe-bf16"]
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    actual = _dense(path)
    experts = actual.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.down_proj.view(-1)[0] += 1
    with pytest.raises(AssertionError, match=r"layers\.1\.mlp\.experts\.down_proj"):
        _assert_same_state(expected, actual)
    with torch.no_grad():
        experts.down_proj.view(-1)[0] -= 1
        experts.gate_up_proj.copy_(experts.gate_up_proj.flip(0))
    with pytest.raises(AssertionError, match=r"layers\.1\.mlp\.experts\.gate_up_proj"):
        _assert_same_state(expected, actual)


def test_dense_refuses_quantization_settings_and_quantized_checkpoints(saved: dict[str, Path]) -> None:
    with pytest.raises(MisconfigurationException, match=r"quantize=False\) loads a dense base, but a `quantization_"):
        load_blockwise(saved["llama-bf16"], device="cpu", quantize=False, quantization_config=nf4_config())
    with pytest.raises(MisconfigurationException, match=r"checkpoint is already quantized \('bitsandbytes'"):
        _dense(saved["llama-nf4"])


def test_dense_arena_is_bigger_than_nf4_by_the_layer_bytes(saved: dict[str, Path]) -> None:
    """The arena holds bf16 bytes: exactly the sum of the layer tensors' bytes, aligned."""
    dense = host_copy_of(_dense(saved["llama-bf16"], block_size=1))
    layer_bytes = [
        sum(t.nbytes for t in layer.state_dict().values())
        for layer in AutoModelForCausalLM.from_pretrained(saved["llama-bf16"], dtype=torch.bfloat16).model.layers
    ]
    assert len(dense.layouts) == len(layer_bytes) == CONFIGS["llama"]().num_hidden_layers
    # At most one alignment unit of padding per tensor (9 tensors per Llama layer).
    assert all(b <= la.nbytes < b + 9 * 256 for la, b in zip(dense.layouts, layer_bytes, strict=True))
