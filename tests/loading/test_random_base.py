"""`random_blockwise` against `random_nf4_model` (CPU): the same bytes, built one layer at a time into the arena."""

from __future__ import annotations

import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import PreTrainedModel

import lightning_blockwise.residency.arena
from lightning_blockwise import BlockwiseStrategy, random_blockwise
from lightning_blockwise.compat.bitsandbytes import nf4_linear
from lightning_blockwise.loading import random_base, random_draws
from lightning_blockwise.loading.random_base import random_share_key
from lightning_blockwise.recipes.random_init import random_nf4_model
from lightning_blockwise.residency.arena import slab_offsets
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import VOCAB, CausalLMModule, assert_equal_runs, fit, runs_differ

ROOT = Path(__file__).resolve().parents[2]
_SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, pad_token_id=0)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)

#: Tiny configs, hidden 64, 3 layers (blocks of 2 leave a short last block). qwen3_moe's layers hold 3-D experts,
#: drawn between the embeddings and the next layer (NOTE [ Random draw order ] in loading/random_draws.py).
CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "qwen2": lambda: transformers.Qwen2Config(**_SMALL, **_ATTN),
    "llama": lambda: transformers.LlamaConfig(**_SMALL, **_ATTN),
    "mistral": lambda: transformers.MistralConfig(**_SMALL, **_ATTN, head_dim=16, sliding_window=4),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **_SMALL, **_ATTN, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2
    ),
}


def _reference(config: transformers.PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    torch.manual_seed(seed)
    return random_nf4_model(config, "cpu", compute_dtype=dtype)


def _build(config: transformers.PretrainedConfig, seed: int, dtype: torch.dtype, **kwargs: object) -> PreTrainedModel:
    options: dict[str, object] = dict(device="cpu", block_size=2, progress=False, share=False)
    return random_blockwise(config, seed=seed, compute_dtype=dtype, **{**options, **kwargs})


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, and each 4-bit weight's statistics and code tables, by name."""
    found = {f"param {n}": p for n, p in model.named_parameters()}
    found |= {f"buffer {n}": b for n, b in model.named_buffers()}
    for name, module in model.named_modules():
        if isinstance(module, Linear4bit):
            state = module.weight.quant_state
            found |= {f"{name}.absmax": state.absmax, f"{name}.code": state.code, f"{name}.offset": state.offset}
            found |= {f"{name}.nested_absmax": state.state2.absmax, f"{name}.nested_code": state.state2.code}
    return found


def _assert_same_bytes(expected: nn.Module, actual: nn.Module) -> None:
    a, b = _tensors(expected), _tensors(actual)
    assert a.keys() == b.keys() and any(name.endswith(".absmax") for name in a)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_equal_random_nf4_model(model_type: str, dtype: torch.dtype) -> None:
    config = CONFIGS[model_type]()
    caller_state = torch.get_rng_state()
    built = _build(config, 5, dtype)
    assert torch.equal(torch.get_rng_state(), caller_state)  # the caller's generator is left as it was
    _assert_same_bytes(_reference(config, 5, dtype), built)
    assert built.training and built.is_loaded_in_4bit and host_copy_of(built).is_bound()
    # Control: another seed gives other bytes.
    with pytest.raises(AssertionError):
        _assert_same_bytes(_reference(config, 6, dtype), built)


def test_moe_needs_the_recorded_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen3_moe's experts are drawn after every linear: built without the first pass, the bytes differ."""
    config = CONFIGS["qwen3_moe"]()
    experts = [p for p in random_draws._other_parameters(_build(config, 0, torch.float32).model.layers[0])]
    assert any(p.dim() == 3 for p in experts)
    monkeypatch.setattr(random_draws, "_other_parameters", lambda layer: [])  # every layer taken for a dense one
    with pytest.raises(AssertionError):
        _assert_same_bytes(_reference(config, 0, torch.float32), _build(config, 0, torch.float32))


def test_the_contract_of_load_blockwise() -> None:
    """Layers' frozen tensors are arena views in blocks of `block_size`, the rest on the CPU, even under `meta`."""
    with torch.device("meta"):
        model = _build(CONFIGS["qwen2"](), 0, torch.bfloat16, block_size=2)
    copy = host_copy_of(model)
    assert copy.layer_ranges == (range(0, 2), range(2, 3)) and copy.block_size == 2 and copy.is_bound()
    assert copy.unfit_for(BlockPlan(num_layers=3, block_size=2), pin=False) is None
    arena = copy.arena.storage
    for layer in model.model.layers:
        for param in layer.parameters():
            start = param.untyped_storage().data_ptr()
            assert arena.data_ptr() <= start < arena.data_ptr() + arena.numel() and not param.requires_grad
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert model.config.quantization_config.bnb_4bit_use_double_quant


def test_dense_holds_the_draws_the_nf4_base_quantizes() -> None:
    """`quantize=False`: dense linears whose weights, quantized, are the NF4 build's bytes (control: another seed)."""
    config = CONFIGS["llama"]()
    nf4 = _build(config, 3, torch.bfloat16)
    for seed, same in ((3, True), (4, False)):
        dense = _build(config, seed, torch.bfloat16, quantize=False)
        q_proj = dense.model.layers[1].self_attn.q_proj
        assert (
            type(q_proj) is nn.Linear
            and q_proj.weight.dtype == torch.bfloat16
            and not getattr(dense, "is_loaded_in_4bit", False)
        )
        assert host_copy_of(dense).is_bound()
        for name, module in nf4.model.layers.named_modules():
            if isinstance(module, Linear4bit):
                weight = dense.model.layers.get_submodule(name).weight
                quantized = nf4_linear(nn.Linear(1, 1, device="meta"), weight.detach().clone(), torch.bfloat16)
                assert torch.equal(quantized.weight.data, module.weight.data) is same, name
        assert torch.equal(dense.model.embed_tokens.weight, nf4.model.embed_tokens.weight) is same


def _lora(model: PreTrainedModel) -> nn.Module:
    torch.manual_seed(1)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))


def test_training_equals_resident_training_of_random_nf4_model() -> None:
    """`BlockwiseStrategy` from the built arena is `torch.equal` to resident training of `random_nf4_model`'s model."""
    config = CONFIGS["llama"]()
    resident = fit(CausalLMModule(lambda: _lora(_reference(config, 0, torch.float32))))
    built = CausalLMModule(lambda: _lora(_build(config, 0, torch.float32)))
    arena = host_copy_of(built.model.base_model.model)
    strategy = BlockwiseStrategy(block_size=2)
    blockwise = fit(built, strategy)
    assert_equal_runs(resident, blockwise)
    assert strategy.host_copy is arena  # trained from the builder's arena, not a second packing
    # Control: another seed's base trains differently.
    assert runs_differ(resident, fit(CausalLMModule(lambda: _lora(_build(config, 1, torch.float32))), "auto"))


def _spy_unquantized(monkeypatch: pytest.MonkeyPatch, keep: bool) -> list[int]:
    """Before each linear is quantized: how many earlier unquantized weights are still alive (``keep``: leak them)."""
    alive: list[weakref.ref[torch.Tensor]] = []
    kept: list[torch.Tensor] = []
    counts: list[int] = []

    def spy(linear: nn.Linear, weight: torch.Tensor, compute_dtype: torch.dtype) -> Linear4bit:
        if not weight.is_meta:
            counts.append(sum(ref() is not None for ref in alive))
            alive.append(weakref.ref(weight))
            kept.extend([weight] if keep else [])
        return nf4_linear(linear, weight, compute_dtype)

    monkeypatch.setattr(random_draws, "nf4_linear", spy)
    return counts


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_one_layer_at_a_time(monkeypatch: pytest.MonkeyPatch, model_type: str) -> None:
    """One unquantized weight at a time; at each block's packing, later layers are still meta, earlier ones packed."""
    counts = _spy_unquantized(monkeypatch, keep=False)
    packed: list[range] = []

    def check_pack(layers: nn.ModuleList, layer_range: range, slab: torch.Tensor) -> object:
        arena = slab.untyped_storage()
        for index, layer in enumerate(layers):
            params = list(layer.parameters())
            if index >= layer_range.stop:
                assert all(p.is_meta for p in params), f"layer {index} built before block {layer_range}"
            elif index < layer_range.start:
                inside = [arena.data_ptr() <= p.data_ptr() < arena.data_ptr() + arena.nbytes() for p in params]
                assert all(inside), f"layer {index} not in the arena when block {layer_range} is packed"
        packed.append(layer_range)
        return pack_block(layers, layer_range, slab)

    pack_block = random_base.pack_block
    monkeypatch.setattr(random_base, "pack_block", check_pack)
    model = _build(CONFIGS[model_type](), 0, torch.bfloat16, block_size=1)
    assert packed == [range(i, i + 1) for i in range(3)] and host_copy_of(model).is_bound()
    assert len(counts) == sum(isinstance(m, Linear4bit) for m in model.modules()) and max(counts) == 0
    # Control: the spy sees weights that are kept alive.
    leaked = _spy_unquantized(monkeypatch, keep=True)
    _build(CONFIGS[model_type](), 0, torch.bfloat16)
    assert max(leaked) == len(leaked) - 1 > 0


def test_share_key_covers_every_input() -> None:
    config = CONFIGS["llama"]()
    cpu = torch.device("cpu")
    base = dict(config=config, seed=0, std=0.02, compute_dtype=torch.bfloat16, block_size=1, quantize=True, device=cpu)
    key = random_share_key(**base)
    _build(config, 0, torch.bfloat16)  # the build leaves the caller's config alone
    assert random_share_key(**{**base, "config": CONFIGS["llama"]()}) == random_share_key(**base) == key
    other_layers = transformers.LlamaConfig(**{**_SMALL, "num_hidden_layers": 2}, **_ATTN)
    changes = dict(seed=1, std=0.01, compute_dtype=torch.float32, block_size=2, quantize=False, config=other_layers)
    changes |= dict(device=torch.device("meta"))
    keys = {name: random_share_key(**{**base, name: value}) for name, value in changes.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys
    assert random_share_key(**{**base, "config": CONFIGS["mistral"]()}) != key


_WORKER = """
import sys, torch, transformers
from lightning_blockwise import random_blockwise
from lightning_blockwise.residency.placement import host_copy_of
config = transformers.LlamaConfig(**{config})
model = random_blockwise(config, seed=0, compute_dtype=torch.float32, device="cpu", block_size=2, progress=False)
assert not host_copy_of(model).arena.read_only
print("ready", flush=True)
sys.stdin.readline()
"""


def test_two_processes_map_one_copy() -> None:
    """A second process building the same base maps the first one's arena; another seed builds its own."""
    config = {**_SMALL, **_ATTN}
    worker = subprocess.Popen(
        [sys.executable, "-c", _WORKER.format(config=config)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "ready"
        mapped = random_blockwise(
            transformers.LlamaConfig(**config), compute_dtype=torch.float32, device="cpu", block_size=2, progress=False
        )
        assert host_copy_of(mapped).arena.read_only and host_copy_of(mapped).is_bound()
        _assert_same_bytes(_reference(transformers.LlamaConfig(**config), 0, torch.float32), mapped)
        # Control: another seed is another key: a copy of this process's own.
        own = random_blockwise(
            transformers.LlamaConfig(**config), seed=1, compute_dtype=torch.float32, device="cpu", block_size=2
        )
        assert not host_copy_of(own).arena.read_only
    finally:
        worker.communicate("\n", timeout=60)
    assert worker.returncode == 0


def test_host_ram_refused_before_anything_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused from the config alone, naming how many layers would fit; nothing is drawn or allocated."""
    config = CONFIGS["llama"]()
    slabs = [layout.nbytes for layout in host_copy_of(_build(config, 0, torch.bfloat16, block_size=1)).layouts]
    arena = lightning_blockwise.residency.arena
    room = slab_offsets(slabs[:2])[-1]
    monkeypatch.setattr(arena, "available_host_memory", lambda: arena.HOST_RAM_RESERVE + room)
    monkeypatch.setattr(random_base, "HostArena", _refuse)
    monkeypatch.setattr(random_base, "draw_in_order", _refuse)
    with pytest.raises(MisconfigurationException, match=r"at most 2 of the 3 decoder layers fit") as refused:
        _build(config, 0, torch.bfloat16, block_size=1)
    assert "random_blockwise: the decoder layers of `a random LlamaConfig` need" in str(refused.value)
    # Control: with room for all three layers it is built (through the real arena).
    monkeypatch.undo()
    monkeypatch.setattr(arena, "available_host_memory", lambda: arena.HOST_RAM_RESERVE + slab_offsets(slabs)[-1])
    assert host_copy_of(_build(config, 0, torch.bfloat16, block_size=1)).is_bound()


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("allocated or drawn before the host RAM was checked")


def test_refusals_name_the_argument() -> None:
    with pytest.raises(MisconfigurationException, match=r"random_blockwise\(block_size=0\)"):
        _build(CONFIGS["llama"](), 0, torch.float32, block_size=0)
    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB)
    with pytest.raises(MisconfigurationException, match="random_blockwise"):
        _build(gpt2, 0, torch.float32)


@pytest.mark.parametrize("name", ["share", "progress", "quantize"])
def test_a_flag_that_is_not_a_bool_is_refused(name: str) -> None:
    """NOTE [ A string is not a flag ] in compat/flags.py: `share="no"` is refused, as `load_blockwise`'s is."""
    with pytest.raises(MisconfigurationException, match=rf"^`random_blockwise\({name}='no'\)` must be True or False"):
        _build(CONFIGS["qwen2"](), 0, torch.float32, **{name: "no"})
    # Control: the bools are taken.
    assert host_copy_of(_build(CONFIGS["qwen2"](), 0, torch.float32, **{name: False})).is_bound()
