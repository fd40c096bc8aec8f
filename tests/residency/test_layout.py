"""Packing blocks of frozen tensors into slabs and rebinding the layers to them (CPU, tiny models)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import bitsandbytes.functional as bnbf
import pytest
import torch
from bitsandbytes.functional import QuantState
from bitsandbytes.nn import Linear4bit, Params4bit
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.integrations import replace_with_bnb_linear

from lightning_blockwise.architectures import adapter_parameters, find_decoder_stack
from lightning_blockwise.loading.load import load_blockwise, predict_block_bytes
from lightning_blockwise.planning import sizing
from lightning_blockwise.residency.arena import HostArena
from lightning_blockwise.residency.binding import bind, pack, unbound, views
from lightning_blockwise.residency.layout import (
    ALIGNMENT,
    BlockLayout,
    align_up,
    frozen_tensors,
    layout_block,
    tensor_offsets,
)
from lightning_blockwise.residency.placement import host_copy_of
from lightning_blockwise.residency.walk import BindingKind
from tests.helpers.models import CONFIGS, NUM_LAYERS, SEQ, VOCAB, build_model, nf4_config

MODEL_TYPES = ["llama", "gemma2", "phi3"]
BLOCK_SIZE = 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These models are tiny: intra-op threads only cost time, and a lot of it on a loaded machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _nf4(checkpoints: dict[str, Path], model_type: str) -> nn.Module:
    return build_model(model_type, checkpoint=checkpoints[model_type], quantized=True).train()


def _layers(model: nn.Module) -> nn.ModuleList:
    return find_decoder_stack(model).layers


def _blocks(model: nn.Module) -> list[BlockLayout]:
    layers = _layers(model)
    return [
        layout_block(layers[start : start + BLOCK_SIZE], first_index=start)
        for start in range(0, NUM_LAYERS, BLOCK_SIZE)
    ]


def _inside(tensor: Tensor, slab: Tensor) -> bool:
    """Whether every byte ``tensor`` reads lies in ``slab``'s memory (no copy of its own)."""
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    return slab.data_ptr() <= start and end <= slab.data_ptr() + slab.numel()


def _bytes(tensor: Tensor) -> Tensor:
    """The tensor's bytes, so that comparisons are bit-exact (NaN payloads, signed zeros)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _input_ids() -> Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _run(model: nn.Module) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits and adapter grads of one seeded training-mode step (dropout on)."""
    model.zero_grad(set_to_none=True)
    ids = _input_ids()
    torch.manual_seed(0)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads
    return out.logits.detach(), grads


def _layer_call(model: nn.Module, index: int) -> tuple[tuple, dict]:
    """The arguments decoder layer ``index`` is called with in a model forward."""
    captured = {}

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["call"] = (args, kwargs)

    handle = _layers(model)[index].register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        # No cache: the layer is called again with these arguments and must not find its keys there.
        model(input_ids=_input_ids(), use_cache=False)
    handle.remove()
    return captured["call"]


def _layer_output(layer: nn.Module, call: tuple[tuple, dict]) -> Tensor:
    torch.manual_seed(0)
    with torch.no_grad():
        return layer(*call[0], **call[1])


def _slot_copy(layout: BlockLayout, host: Tensor) -> Tensor:
    """What the streamer does at run time: a (larger) slot filled with a copy of the host slab."""
    slot = torch.full((layout.nbytes + 3 * ALIGNMENT,), 0xAB, dtype=torch.uint8)
    slot[: layout.nbytes].copy_(host)
    return slot


def _expected_names(layers: Sequence[nn.Module], first_index: int) -> set[str]:
    """Every name a frozen tensor of ``layers`` is reachable under, found independently of residency/layout.py."""
    names = set()
    for index, layer in enumerate(layers, start=first_index):
        adapters = {id(p) for p in adapter_parameters(layer).values()}
        for name, param in layer.named_parameters(remove_duplicate=False):
            if id(param) in adapters:
                continue
            names.add(f"layers.{index}.{name}")
            if isinstance(param, Params4bit):
                names.add(f"layers.{index}.{name}.quant_state.absmax")
                if param.quant_state.nested:
                    names.add(f"layers.{index}.{name}.quant_state.offset")
                    names.add(f"layers.{index}.{name}.quant_state.state2.absmax")
        names |= {f"layers.{index}.{name}" for name, _ in layer.named_buffers(remove_duplicate=False)}
    return names


def _entry(layout: BlockLayout, suffix: str) -> int:
    return next(i for i, entry in enumerate(layout.entries) if any(n.endswith(suffix) for n in entry.names))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_layout_covers_every_frozen_tensor_and_no_adapter(checkpoints: dict[str, Path], model_type: str) -> None:
    model = _nf4(checkpoints, model_type)
    layers = _layers(model)[1:3]
    layout = layout_block(layers, first_index=1)

    assert {name for entry in layout.entries for name in entry.names} == _expected_names(layers, 1)
    adapters = {id(p) for layer in layers for p in adapter_parameters(layer).values()}
    owners = [binding.owner for entry in layout.entries for binding in entry.bindings]
    assert adapters and not adapters & {id(owner) for owner in owners}
    # Every Params4bit brings its packed data, absmax, offset and nested absmax; no `code` table is packed.
    weights = [p for layer in layers for p in layer.parameters() if isinstance(p, Params4bit)]
    assert weights and all(p.quant_state.nested for p in weights)
    kinds = [binding.kind for entry in layout.entries for binding in entry.bindings]
    assert kinds.count(BindingKind.QUANT_STATE) == 3 * len(weights)
    assert not any(entry.names[0].endswith("code") for entry in layout.entries)

    end = 0
    for entry in layout.entries:
        assert entry.offset % ALIGNMENT == 0 and entry.offset >= end
        tensor = entry.bindings[0].current()
        assert entry.nbytes == tensor.numel() * tensor.element_size()
        assert (entry.dtype, entry.shape) == (tensor.dtype, tensor.shape)
        end = entry.offset + entry.nbytes
    assert layout.nbytes == end
    assert layout.bytes_needed == sum(entry.nbytes for entry in layout.entries) <= layout.nbytes


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pack_round_trips_bit_exactly(checkpoints: dict[str, Path], model_type: str) -> None:
    model = _nf4(checkpoints, model_type)
    layers = _layers(model)[:BLOCK_SIZE]
    layout = layout_block(layers)
    before = [_bytes(entry.bindings[0].current()).clone() for entry in layout.entries]
    weights = [m.weight for layer in layers for m in layer.modules() if isinstance(m, Linear4bit)]
    dequantized = [bnbf.dequantize_4bit(w.data, w.quant_state) for w in weights]

    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(layout, host)
    for view, expected in zip(views(layout, host), before, strict=True):
        assert torch.equal(_bytes(view), expected)

    bind(layout, host)
    for entry, expected in zip(layout.entries, before, strict=True):
        for binding in entry.bindings:
            assert torch.equal(_bytes(binding.current()), expected), entry.names
    for weight, expected in zip(weights, dequantized, strict=True):
        state = weight.quant_state
        # NOTE [ One storage per slab entry ] in binding.py: each tensor has a storage of its own inside the slab.
        for tensor in (weight.data, state.absmax, state.offset, state.state2.absmax):
            assert _inside(tensor, host)
        assert torch.equal(bnbf.dequantize_4bit(weight.data, state), expected)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_bind_host_then_slot_keeps_outputs_and_identities(checkpoints: dict[str, Path], model_type: str) -> None:
    model = _nf4(checkpoints, model_type)
    call = _layer_call(model, 1)
    layer_out = _layer_output(_layers(model)[1], call)
    logits, grads = _run(model)
    names = [(n, id(p), type(p)) for n, p in model.named_parameters()]
    keys = list(model.state_dict())
    linears = [m for m in model.modules() if isinstance(m, Linear4bit)]
    states = [(id(m.weight.quant_state), id(m.weight.quant_state.state2)) for m in linears]

    layouts = _blocks(model)
    hosts = [torch.empty(layout.nbytes, dtype=torch.uint8) for layout in layouts]
    for layout, host in zip(layouts, hosts, strict=True):
        pack(layout, host)
        bind(layout, host)
    slabs = [hosts, [_slot_copy(layout, host) for layout, host in zip(layouts, hosts, strict=True)]]
    for slab in slabs:
        for layout, block_slab in zip(layouts, slab, strict=True):
            bind(layout, block_slab)
        assert torch.equal(_layer_output(_layers(model)[1], call), layer_out)
        new_logits, new_grads = _run(model)
        assert torch.equal(new_logits, logits)
        assert new_grads.keys() == grads.keys()
        assert all(torch.equal(new_grads[n], grads[n]) for n in grads)
        assert [unbound(layout, block_slab) for layout, block_slab in zip(layouts, slab, strict=True)] == [[], []]

        assert [(n, id(p), type(p)) for n, p in model.named_parameters()] == names
        assert list(model.state_dict()) == keys
        assert [(id(m.weight.quant_state), id(m.weight.quant_state.state2)) for m in linears] == states
        # The module's own reference to its quant state is the same object, so it sees the slab too.
        assert all(m.quant_state is m.weight.quant_state for m in linears)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_perturbed_slab_changes_the_output(checkpoints: dict[str, Path], model_type: str) -> None:
    """Control: every kind of packed tensor is really read from the bound slab."""
    model = _nf4(checkpoints, model_type)
    layer = _layers(model)[1]
    call = _layer_call(model, 1)
    expected = _layer_output(layer, call)
    layout = layout_block([layer], first_index=1)
    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(layout, host)

    suffixes = ["base_layer.weight", "quant_state.absmax", "quant_state.offset", "state2.absmax", "layernorm.weight"]
    for suffix in suffixes:
        entry = layout.entries[_entry(layout, suffix)]
        slot = _slot_copy(layout, host)
        slot[entry.offset : entry.offset + entry.nbytes] ^= 0x5A
        bind(layout, slot)
        assert not torch.equal(_layer_output(layer, call), expected), f"perturbing {entry.names[0]} changed nothing"
    bind(layout, _slot_copy(layout, host))
    assert torch.equal(_layer_output(layer, call), expected)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fp32_model(model_type: str) -> None:
    model = build_model(model_type).train()
    call = _layer_call(model, 2)
    layer_out = _layer_output(_layers(model)[2], call)
    logits, grads = _run(model)
    layouts = _blocks(model)
    assert all(b.kind is BindingKind.PARAMETER for layout in layouts for e in layout.entries for b in e.bindings)
    assert {n for layout in layouts for e in layout.entries for n in e.names} == _expected_names(_layers(model), 0)

    hosts = [torch.empty(layout.nbytes, dtype=torch.uint8) for layout in layouts]
    for layout, host in zip(layouts, hosts, strict=True):
        pack(layout, host)
        bind(layout, _slot_copy(layout, host))
    new_logits, new_grads = _run(model)
    assert torch.equal(new_logits, logits)
    assert all(torch.equal(new_grads[n], grads[n]) for n in grads)

    slot = _slot_copy(layouts[1], hosts[1])
    entry = layouts[1].entries[_entry(layouts[1], "layers.2.mlp.down_proj.base_layer.weight")]
    slot[entry.offset : entry.offset + entry.nbytes] ^= 0x5A
    bind(layouts[1], slot)
    assert not torch.equal(_layer_output(_layers(model)[2], call), layer_out)


def test_tied_shared_and_non_contiguous_tensors() -> None:
    model = build_model("llama").train()
    layer = _layers(model)[0]
    norm = layer.input_layernorm.weight
    num_frozen = sum(1 for p in layer.parameters() if not p.requires_grad)
    # The same Parameter under a second name; a second Parameter over the same bytes; a buffer
    # over the same bytes; a non-contiguous buffer.
    layer.mlp.register_parameter("tied", norm)
    layer.mlp.alias = nn.Parameter(norm.data, requires_grad=False)
    layer.mlp.register_buffer("norm_view", norm.data)
    strided = torch.arange(24, dtype=torch.float64).reshape(4, 6).t()
    layer.self_attn.register_buffer("strided", strided)

    layout = layout_block([layer])
    entry = layout.entries[_entry(layout, "input_layernorm.weight")]
    assert set(entry.names) == {
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.tied",
        "layers.0.mlp.alias",
        "layers.0.mlp.norm_view",
    }
    assert [b.kind for b in entry.bindings] == [BindingKind.PARAMETER, BindingKind.PARAMETER, BindingKind.BUFFER]
    assert len(layout.entries) == num_frozen + 1  # the aliases share one entry; `strided` has its own

    expected = norm.detach().clone()
    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(layout, host)
    bind(layout, _slot_copy(layout, host))
    view = views(layout, host)[layout.entries.index(entry)]
    for tensor in (norm, layer.mlp.tied, layer.mlp.alias, layer.mlp.norm_view):
        assert torch.equal(tensor, expected)
    assert len({t.data_ptr() for t in (norm, layer.mlp.alias, layer.mlp.norm_view)}) == 1
    assert norm.data_ptr() != view.data_ptr()  # bound to the slot, not the host slab
    assert layer.self_attn.strided.is_contiguous() and torch.equal(layer.self_attn.strided, strided)


def test_alignment_is_configurable() -> None:
    model = build_model("llama").train()
    small = layout_block(_layers(model)[:1], alignment=16)
    large = layout_block(_layers(model)[:1])
    assert all(entry.offset % 16 == 0 for entry in small.entries)
    assert small.bytes_needed == large.bytes_needed <= small.nbytes < large.nbytes


def test_refuses_trainable_non_adapter(checkpoints: dict[str, Path]) -> None:
    model = _nf4(checkpoints, "llama")
    _layers(model)[0].post_attention_layernorm.weight.requires_grad_(True)
    with pytest.raises(
        ValueError, match=r"`layers\.0\.post_attention_layernorm\.weight` requires grad.*requires_grad_"
    ):
        layout_block(_layers(model)[:1])


def test_refuses_params4bit_without_quant_state(checkpoints: dict[str, Path]) -> None:
    model = _nf4(checkpoints, "llama")
    _layers(model)[1].mlp.up_proj.base_layer.weight.quant_state = None
    with pytest.raises(ValueError, match=r"`layers\.1\.mlp\.up_proj\.base_layer\.weight` is .* without a quant state"):
        layout_block(_layers(model)[1:2], first_index=1)


def test_refuses_weights_repacked_for_the_cpu_kernel(checkpoints: dict[str, Path]) -> None:
    model = _nf4(checkpoints, "llama")
    _layers(model)[0].self_attn.o_proj.base_layer.weight.quant_state.packing_format_for_cpu = True
    with pytest.raises(ValueError, match=r"`layers\.0\.self_attn\.o_proj\.base_layer\.weight` was repacked.*train\(\)"):
        layout_block(_layers(model)[:1])


def test_refuses_a_real_bitsandbytes_cpu_repack(checkpoints: dict[str, Path]) -> None:
    model = _nf4(checkpoints, "llama")
    weight = _layers(model)[0].mlp.down_proj.base_layer.weight
    # What an eval-mode `Linear4bit.forward` without grad does on a CPU with AVX512-BF16 (only
    # down_proj, 32 x 64, has the shape its repack needs at these tiny sizes).
    weight.data, weight.quant_state = bnbf._convert_weight_packed_for_cpu(weight.data, weight.quant_state)
    with pytest.raises(
        ValueError, match=r"`layers\.0\.mlp\.down_proj\.base_layer\.weight` was repacked by bitsandbytes"
    ):
        layout_block(_layers(model)[:1])


def test_refuses_meta_tensors() -> None:
    model = build_model("llama", peft=False)
    layer = model.model.layers[0]
    layer.input_layernorm.weight = nn.Parameter(torch.empty(32, device="meta"), requires_grad=False)
    for param in layer.parameters():
        param.requires_grad_(False)
    with pytest.raises(ValueError, match=r"`layers\.0\.input_layernorm\.weight` is on the meta device"):
        layout_block([layer])


def test_refuses_bad_alignment_and_unfit_slabs() -> None:
    model = build_model("llama").train()
    with pytest.raises(ValueError, match="power of two"):
        layout_block(_layers(model)[:1], alignment=8)
    with pytest.raises(ValueError, match="power of two"):
        layout_block(_layers(model)[:1], alignment=384)
    layout = layout_block(_layers(model)[:1])
    for slab in (
        torch.empty(layout.nbytes - 1, dtype=torch.uint8),
        torch.empty(layout.nbytes, dtype=torch.int8),
        torch.empty(2, layout.nbytes, dtype=torch.uint8)[:, 0],
    ):
        with pytest.raises(ValueError, match="contiguous 1-D uint8 tensor"):
            bind(layout, slab)


def test_pack_refuses_a_stale_layout(checkpoints: dict[str, Path]) -> None:
    model = _nf4(checkpoints, "llama")
    layout = layout_block(_layers(model)[:1])
    state: QuantState = _layers(model)[0].mlp.down_proj.base_layer.weight.quant_state
    state.absmax = state.absmax.float()
    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"down_proj\.base_layer\.weight\.quant_state\.absmax` is now torch\.float32"):
        pack(layout, host)


def test_unbound_reports_replaced_tensors() -> None:
    model = build_model("llama").train()
    layer = _layers(model)[0]
    layout = layout_block([layer])
    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(layout, host)
    bind(layout, host)
    assert unbound(layout, host) == []
    layer.post_attention_layernorm.weight.data = layer.post_attention_layernorm.weight.data.clone()
    assert unbound(layout, host) == ["layers.0.post_attention_layernorm.weight"]


def test_unbound_catches_linear4bit_casting_its_bias(checkpoints: dict[str, Path]) -> None:
    """A trap for the streamer: `Linear4bit.forward` rebinds a bias to a new tensor of the compute dtype."""
    config = nf4_config()
    config.bnb_4bit_compute_dtype = torch.bfloat16
    model = (
        AutoModelForCausalLM.from_pretrained(
            checkpoints["qwen2"], quantization_config=config, device_map="cpu", dtype=torch.float32
        )
        .train()
        .requires_grad_(False)
    )
    layout = layout_block(model.model.layers[:1])
    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(layout, host)
    bind(layout, host)
    with torch.no_grad():
        model(input_ids=_input_ids(), use_cache=False)
    assert unbound(layout, host) == [f"layers.0.self_attn.{name}_proj.bias" for name in "qkv"]


def test_align_up_and_tensor_offsets() -> None:
    assert [align_up(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]
    assert align_up(17, 16) == 32
    # Every start aligned, the end unpadded; an empty slab has size 0.
    assert tensor_offsets([1000, 3, 512]) == [0, 1024, 1280, 1792]
    assert tensor_offsets([10, 10], alignment=16) == [0, 16, 26]
    assert tensor_offsets([]) == [0]


def _frozen_nf4(checkpoints: dict[str, Path], model_type: str) -> nn.Module:
    """The standard NF4 load without adapters, frozen."""
    return build_model(model_type, checkpoint=checkpoints[model_type], quantized=True, peft=False).requires_grad_(False)


def _meta_nf4(config: PretrainedConfig) -> PreTrainedModel:
    """What `predict_block_bytes` predicts from: the model on the meta device, its linears converted to NF4."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"], quantization_config=nf4_config())
    return model


def _specs(tensors: Sequence[object]) -> list[tuple[tuple[str, ...], torch.dtype, torch.Size, int]]:
    return [(t.names, t.dtype, t.shape, t.nbytes) for t in tensors]


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_arena_prediction_and_plan_agree(checkpoints: dict[str, Path], model_type: str) -> None:
    """One walk: the layout of a loaded NF4 model, the loader's prediction and `plan`'s sizes, byte for byte."""
    standard = _frozen_nf4(checkpoints, model_type)
    loaded = load_blockwise(
        checkpoints[model_type], compute_dtype=torch.float32, device="cpu", block_size=2, progress=False
    )
    copy = host_copy_of(loaded)
    meta = _layers(_meta_nf4(CONFIGS[model_type]()))
    sizes = sizing.model_sizes(CONFIGS[model_type](), dtype=torch.float32)
    assert copy is not None and copy.block_size == 2

    for block, layers in enumerate(copy.layer_ranges):
        layout = layout_block(_layers(standard)[layers.start : layers.stop], first_index=layers.start)
        # The arena `load_blockwise` packed and the layout of the standard load: the same tensors at the same offsets.
        entries = [(*spec, e.offset) for spec, e in zip(_specs(layout.entries), layout.entries, strict=True)]
        ours = copy.layouts[block]
        assert entries == [(*spec, e.offset) for spec, e in zip(_specs(ours.entries), ours.entries, strict=True)]
        # Predicted on the meta device: the same names, dtypes, shapes and sizes, so the same offsets.
        predicted = frozen_tensors(meta[layers.start : layers.stop], first_index=layers.start)
        assert _specs(predicted) == _specs(layout.entries)
        assert predict_block_bytes(meta[layers.start : layers.stop]) == layout.nbytes
        # `plan`: each tensor's bytes from the config alone.
        planned = [nbytes for layer in sizes.layer_tensors[layers.start : layers.stop] for nbytes in layer]
        assert planned == [entry.nbytes for entry in layout.entries]
    assert sizes.block_bytes(2) == [layout.nbytes for layout in copy.layouts]
    assert sizes.host_bytes(2) == copy.arena.nbytes == HostArena(sizes.block_bytes(2), pin=False).nbytes


def _tie(model: nn.Module) -> nn.Module:
    """Tie, inside decoder layer 0, a norm to another and a (4-bit) linear's weight to another's."""
    layer = _layers(model)[0]
    layer.post_attention_layernorm.weight = layer.input_layernorm.weight
    layer.mlp.up_proj.weight = layer.mlp.gate_proj.weight
    return model


class _TiedFromConfig:
    """`AutoModelForCausalLM` for `model_sizes`, building the model with `_tie`'s ties."""

    @staticmethod
    def from_config(*args: object, **kwargs: object) -> nn.Module:
        return _tie(AutoModelForCausalLM.from_config(*args, **kwargs))


@pytest.mark.parametrize("tied", [False, True])
def test_a_tied_tensor_is_one_entry_for_arena_prediction_and_plan(
    checkpoints: dict[str, Path], tied: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied tensor is allocated once in the arena; the loader's prediction and `plan` count it once too.

    Control arm: untied, the same three agree on a larger layer.
    """
    tie = _tie if tied else (lambda model: model)
    if tied:
        monkeypatch.setattr(sizing, "AutoModelForCausalLM", _TiedFromConfig)
    model = tie(_frozen_nf4(checkpoints, "llama"))
    layout = layout_block(_layers(model)[:1])
    meta = _layers(tie(_meta_nf4(CONFIGS["llama"]())))[:1]
    sizes = sizing.model_sizes(CONFIGS["llama"](), dtype=torch.float32)

    assert _specs(frozen_tensors(meta)) == _specs(layout.entries)
    assert list(sizes.layer_tensors[0]) == [entry.nbytes for entry in layout.entries]
    assert predict_block_bytes(meta) == sizes.block_bytes(1)[0] == layout.nbytes

    shared = [entry.names for entry in layout.entries if len(entry.names) > 1]
    untied = layout_block(_layers(_frozen_nf4(checkpoints, "llama"))[:1])
    if not tied:
        assert not shared
        return
    # The norm, and the packed weight with each of its three quant-state tensors: one entry under both names.
    assert shared == [
        ("layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight"),
        *(
            (f"layers.0.mlp.gate_proj.weight.{s}", f"layers.0.mlp.up_proj.weight.{s}")
            for s in ("quant_state.absmax", "quant_state.offset", "quant_state.state2.absmax")
        ),
        ("layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"),
    ]
    assert len(layout.entries) == len(untied.entries) - 5 and layout.nbytes < untied.nbytes
