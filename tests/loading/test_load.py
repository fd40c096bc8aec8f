"""`load_blockwise` against the standard `from_pretrained(..., quantization_config=nf4)` path (CPU)."""

from __future__ import annotations

import gc
import hashlib
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, PreTrainedModel

import lightning_blockwise.loading.load
import lightning_blockwise.residency.arena
import lightning_blockwise.residency.layout
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.loading.load import load_blockwise, predict_block_bytes
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.placement import detach_host_copy, host_copy_of
from tests.helpers.models import (
    CONFIGS,
    GPU_SHAPES,
    TARGETS,
    VOCAB,
    CausalLMModule,
    assert_equal_runs,
    fit,
    nf4_config,
    padded_batches,
    runs_differ,
)

_DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _save(model_type: str, path: Path, dtype: torch.dtype, max_shard_size: str | None = None) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[model_type](), dtype=dtype)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def _standard(path: Path, compute_dtype: torch.dtype) -> PreTrainedModel:
    """The standard path; `.train()` at once.

    NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py.
    """
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=nf4_config(compute_dtype), device_map="cpu", dtype=compute_dtype
    ).train()


def _load(path: Path, compute_dtype: torch.dtype, block_size: int = 1) -> PreTrainedModel:
    return load_blockwise(path, compute_dtype=compute_dtype, device="cpu", block_size=block_size, progress=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints by name: fp32 and bf16, single file and sharded, and a pre-quantized one."""
    root = tmp_path_factory.mktemp("loader")
    paths = {
        "llama-bf16": _save("llama", root / "llama-bf16", torch.bfloat16),
        "llama-fp32-sharded": _save("llama", root / "llama-fp32-sharded", torch.float32, max_shard_size="40KB"),
        "qwen2-bf16-sharded": _save("qwen2", root / "qwen2-bf16-sharded", torch.bfloat16, max_shard_size="40KB"),
        "phi3-fp32": _save("phi3", root / "phi3-fp32", torch.float32),
        "gemma2-bf16": _save("gemma2", root / "gemma2-bf16", torch.bfloat16),
    }
    for name in ("llama", "qwen2"):
        # What a `*-bnb-4bit` checkpoint is: `save_pretrained` of a model loaded in 4-bit.
        quantized = _standard(paths[f"{name}-bf16" if name == "llama" else "qwen2-bf16-sharded"], torch.bfloat16)
        quantized.save_pretrained(root / f"{name}-nf4")
        paths[f"{name}-nf4"] = root / f"{name}-nf4"
    assert (paths["qwen2-bf16-sharded"] / "model.safetensors.index.json").is_file()
    return paths


def _frozen_4bit(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every 4-bit linear's packed weight, absmax, nested absmax, offset and code tables, by name."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear4bit):
            continue
        state = module.weight.quant_state
        found[f"{name}.weight"] = module.weight.data
        found[f"{name}.absmax"] = state.absmax
        found[f"{name}.code"] = state.code
        if state.nested:
            found[f"{name}.offset"] = state.offset
            found[f"{name}.nested_absmax"] = state.state2.absmax
            found[f"{name}.nested_code"] = state.state2.code
    return found


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _assert_same_model(expected: nn.Module, actual: nn.Module) -> None:
    a, b = _frozen_4bit(expected), _frozen_4bit(actual)
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name
        assert _digest(a[name]) == _digest(b[name]), name
    for name, module in expected.named_modules():
        if isinstance(module, Linear4bit):
            theirs, ours = module.weight.quant_state, actual.get_submodule(name).weight.quant_state
            assert (theirs.blocksize, theirs.quant_type, theirs.dtype, theirs.shape) == (
                ours.blocksize,
                ours.quant_type,
                ours.dtype,
                ours.shape,
            ), name
    params_a, params_b = dict(expected.named_parameters()), dict(actual.named_parameters())
    assert params_a.keys() == params_b.keys()
    for name, param in params_a.items():
        assert param.dtype == params_b[name].dtype and torch.equal(param, params_b[name]), name
    buffers_b = dict(actual.named_buffers())
    for name, buffer in expected.named_buffers():
        assert torch.equal(buffer, buffers_b[name]), name


@pytest.mark.parametrize(
    ("name", "compute_dtype"),
    [
        ("llama-bf16", torch.bfloat16),
        ("llama-bf16", torch.float32),
        ("llama-fp32-sharded", torch.bfloat16),
        ("llama-fp32-sharded", torch.float32),
        ("qwen2-bf16-sharded", torch.bfloat16),
        ("phi3-fp32", torch.float32),
        ("gemma2-bf16", torch.bfloat16),
        ("llama-nf4", torch.float32),
        ("qwen2-nf4", torch.bfloat16),
    ],
)
def test_bytes_equal_standard_path(saved: dict[str, Path], name: str, compute_dtype: torch.dtype) -> None:
    expected = _standard(saved[name], compute_dtype)
    actual = _load(saved[name], compute_dtype, block_size=2)
    _assert_same_model(expected, actual)
    assert actual.training and actual.is_loaded_in_4bit


def test_prequantized_needs_no_quantization(saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A pre-quantized checkpoint is deserialized: no weight goes through bitsandbytes' quantizer."""
    monkeypatch.setattr("bitsandbytes.functional.quantize_4bit", _refuse)
    _load(saved["llama-nf4"], torch.float32)


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("quantize_4bit called for a pre-quantized checkpoint")


def test_host_copy_is_the_arena(saved: dict[str, Path]) -> None:
    """Every frozen layer tensor is a view of the arena, whose block sizes were predicted exactly."""
    model = _load(saved["qwen2-bf16-sharded"], torch.float32, block_size=3)
    copy = host_copy_of(model)
    layers = model.model.layers
    assert copy.layer_ranges == (range(0, 3), range(3, 4)) and copy.is_bound()
    assert [layout.nbytes for layout in copy.layouts] == [slab.numel() for slab in copy.arena.slabs]
    assert [predict_block_bytes(layers[r.start : r.stop]) for r in copy.layer_ranges] == [
        layout.nbytes for layout in copy.layouts
    ]
    arena = copy.arena.storage
    for layer in layers:
        for param in layer.parameters():
            # NOTE [ One storage per slab entry ] in residency/binding.py: a storage of its own, inside the arena.
            start = param.untyped_storage().data_ptr()
            assert (
                arena.data_ptr() <= start
                and start + param.untyped_storage().nbytes() <= arena.data_ptr() + arena.numel()
            )
        assert not any(param.requires_grad for param in layer.parameters())


def test_arena_is_on_the_host_under_a_default_device(saved: dict[str, Path]) -> None:
    """Lightning runs `configure_model` under `torch.device(root_device)`; the arena must still be host memory.

    On the GPU a bare `torch.empty` there allocated the arena on the device and `cudaHostRegister` failed;
    the meta device stands in for it on the CPU.
    """
    with torch.device("meta"):
        model = _load(saved["llama-bf16"], torch.bfloat16)
    copy = host_copy_of(model)
    assert copy.arena.storage.device.type == "cpu" and copy.is_bound()
    _assert_same_model(_standard(saved["llama-bf16"], torch.bfloat16), model)


def test_bias_dtype_is_predicted(tmp_path: Path) -> None:
    """Biases bigger than the alignment: the arena predicted from config.json is the one packed.

    bitsandbytes creates a `Linear4bit`'s bias in float32 on the meta model while the load casts it to the
    compute dtype; at a Qwen2.5-14B shape that made the prediction 14,336 bytes too large per layer and the
    load fail. The tiny configs hide it: their biases fit in one alignment unit either way.
    """
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    model = _load(tmp_path, torch.bfloat16)
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert bias.dtype == torch.bfloat16 and bias.numel() * 2 > lightning_blockwise.residency.layout.ALIGNMENT
    copy = host_copy_of(model)
    expected = model_sizes(config, torch.bfloat16).block_bytes(1)
    assert [slab.numel() for slab in copy.arena.slabs] == [layout.nbytes for layout in copy.layouts] == expected
    _assert_same_model(_standard(tmp_path, torch.bfloat16), model)


def _lora(model_type: str) -> Callable[[PreTrainedModel], nn.Module]:
    def wrap(model: PreTrainedModel) -> nn.Module:
        torch.manual_seed(1)
        lora = LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.1,
            target_modules=TARGETS.get(model_type, _DEFAULT_TARGETS),
            init_lora_weights=False,
        )
        return get_peft_model(model, lora)

    return wrap


@pytest.mark.parametrize(
    ("model_type", "name"), [("llama", "llama-bf16"), ("qwen2", "qwen2-bf16-sharded"), ("llama", "llama-nf4")]
)
def test_training_equals_standard_path(saved: dict[str, Path], model_type: str, name: str) -> None:
    """Fitting with `BlockwiseStrategy` from the loaded model is `torch.equal` to fitting from the standard path."""
    wrap = _lora(model_type)
    control = fit(CausalLMModule(lambda: wrap(_standard(saved[name], torch.float32))), BlockwiseStrategy(block_size=2))
    loaded = CausalLMModule(lambda: wrap(_load(saved[name], torch.float32, block_size=2)))
    arena = host_copy_of(loaded.model.base_model.model)
    strategy = BlockwiseStrategy(block_size=2)
    assert_equal_runs(control, fit(loaded, strategy))
    # The strategy trained from the loader's arena instead of packing a second one.
    assert strategy.host_copy is arena


def test_host_copy_knows_its_block_size_and_why_it_does_not_fit(saved: dict[str, Path]) -> None:
    """The hand-over: the copy `load_blockwise` attaches says which runs it can serve, and if not, why."""
    model = _load(saved["llama-bf16"], torch.float32, block_size=1)
    copy = host_copy_of(model)
    assert copy is not None and copy.block_size == 1
    assert host_copy_of(nn.Linear(2, 2)) is None
    assert copy.unfit_for(BlockPlan(num_layers=4, block_size=1), pin=False) is None
    reason = copy.unfit_for(BlockPlan(num_layers=4, block_size=2), pin=False)
    assert reason is not None and "packed in blocks of 1 layers but the strategy's `block_size` is 2" in reason
    reason = copy.unfit_for(BlockPlan(num_layers=4, block_size=1), pin=True)
    assert reason is not None and "not page-locked" in reason
    norm = model.model.layers[3].input_layernorm.weight
    norm.data = norm.data.clone()
    reason = copy.unfit_for(BlockPlan(num_layers=4, block_size=1), pin=False)
    assert reason is not None and "tensors were replaced" in reason


def test_strategy_repacks_another_block_size_and_says_why(saved: dict[str, Path]) -> None:
    wrap = _lora("llama")
    module = CausalLMModule(lambda: wrap(_load(saved["llama-bf16"], torch.float32, block_size=1)))
    base = module.model.base_model.model
    loaded = host_copy_of(base)
    strategy = BlockwiseStrategy(block_size=2)
    with pytest.warns(UserWarning, match=r"repacking the model's host copy: it was packed in blocks of 1 layers but"):
        fit(module, strategy, max_steps=1)
    assert strategy.host_copy is not None and strategy.host_copy is not loaded
    assert host_copy_of(base) is strategy.host_copy and strategy.host_copy.block_size == 2


def _flip_one_byte(model: PreTrainedModel) -> PreTrainedModel:
    """Change one packed byte (two NF4 codes) of layer 0's q_proj weight, in the arena."""
    flat = model.model.layers[0].self_attn.q_proj.weight.data.view(-1)
    flat[0] = flat[0] ^ 0x11
    return model


def test_control_one_changed_byte_is_caught(saved: dict[str, Path]) -> None:
    """The byte-identity and training comparisons above fail when one packed byte of the load differs."""
    expected = _standard(saved["llama-bf16"], torch.float32)
    with pytest.raises(AssertionError, match=r"layers\.0\.self_attn\.q_proj\.weight"):
        _assert_same_model(expected, _flip_one_byte(_load(saved["llama-bf16"], torch.float32)))

    wrap = _lora("llama")
    reference = fit(CausalLMModule(lambda: wrap(_standard(saved["llama-bf16"], torch.float32))), "blockwise")
    flipped = CausalLMModule(lambda: wrap(_flip_one_byte(_load(saved["llama-bf16"], torch.float32))))
    assert runs_differ(reference, fit(flipped, "blockwise"))


def _corrupt(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for file in saved.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    return copy


def test_missing_checkpoint_files(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _corrupt(saved["qwen2-bf16-sharded"], tmp_path)
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.1.mlp.up_proj.weight"
    ]
    (path / shard).unlink()
    with pytest.raises(MisconfigurationException, match="shards that do not exist"):
        _load(path, torch.float32)
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(MisconfigurationException, match="has neither"):
        _load(path, torch.float32)
    with pytest.raises(MisconfigurationException, match=r"no config\.json"):
        _load(tmp_path, torch.float32)


def test_missing_path_says_it_does_not_exist(saved: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException, match=r"`.*missing` does not exist; pass a local Hugging Face"):
        _load(tmp_path / "missing", torch.float32)
    with pytest.raises(MisconfigurationException, match=r"config\.json` is a file; pass the checkpoint directory"):
        _load(saved["llama-bf16"] / "config.json", torch.float32)


def test_gpt2_names_where_its_layers_are(tmp_path: Path) -> None:
    """GPT-2 is a causal LM that keeps its layers at `transformer.h`: the strategy's message, not "not decoder-only"."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    match = (
        r"load_blockwise found no decoder stack in `GPT2LMHeadModel` \(model_type 'gpt2'\): it"
        r" streams the layers at `get_decoder\(\).layers`.*module lists inside it: `transformer.h`"
    )
    with pytest.raises(MisconfigurationException, match=match) as refused:
        _load(tmp_path, torch.float32)
    assert "decoder-only" not in str(refused.value)


def test_truncated_shard(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _corrupt(saved["llama-bf16"], tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        _load(path, torch.float32)


def _rewrite(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_unexpected_and_missing_tensors(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _corrupt(saved["llama-bf16"], tmp_path)
    _rewrite(path, lambda t: t.update({"model.layers.2.mlp.extra_proj.weight": torch.zeros(4, 4)}))
    with pytest.raises(ValueError, match=r"config does not explain: model\.layers\.2\.mlp\.extra_proj\.weight"):
        _load(path, torch.float32)
    _rewrite(
        path, lambda t: [t.pop("model.layers.2.mlp.extra_proj.weight"), t.pop("model.layers.3.self_attn.o_proj.weight")]
    )
    with pytest.raises(ValueError, match=r"lacks decoder-layer tensors: model\.layers\.3\.self_attn\.o_proj\.weight"):
        _load(path, torch.float32)


def test_unsupported_dtype(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _corrupt(saved["llama-bf16"], tmp_path)
    key = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(path, lambda t: t.update({key: t[key].to(torch.int8)}))
    with pytest.raises(ValueError, match=rf"`{key}` is I8"):
        _load(path, torch.float32)


@pytest.mark.parametrize(
    "config",
    [
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
        BitsAndBytesConfig(load_in_8bit=True),
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16),
    ],
)
def test_unsupported_quantization_settings(saved: dict[str, Path], config: BitsAndBytesConfig) -> None:
    with pytest.raises(MisconfigurationException, match="only bitsandbytes 4-bit NF4"):
        load_blockwise(saved["llama-bf16"], device="cpu", quantization_config=config, progress=False)


def test_saved_8bit_config_refused(saved: dict[str, Path], tmp_path: Path) -> None:
    path = _corrupt(saved["llama-bf16"], tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True, "load_in_4bit": False}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(MisconfigurationException, match="load_in_8bit=True"):
        _load(path, torch.float32)


def test_not_enough_host_ram(saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused from config.json alone, before any shard is opened."""
    arena = lightning_blockwise.residency.arena
    monkeypatch.setattr(arena, "available_host_memory", lambda: arena.HOST_RAM_RESERVE)
    monkeypatch.setattr("lightning_blockwise.loading.files.safe_open", _refuse)
    with pytest.raises(
        MisconfigurationException, match=r"host arena \(predicted from config\.json\), but only 2\.15 GB"
    ):
        _load(saved["llama-bf16"], torch.float32)


_needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 Llama-3.2-1B-shape checkpoint (1.2B parameters, random init)."""
    path = tmp_path_factory.mktemp("loader_gpu")
    torch.manual_seed(0)
    config = GPU_SHAPES["llama"]()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="1GB")
    del model
    torch.cuda.empty_cache()
    return path


@pytest.mark.gpu
@_needs_gpu
def test_gpu_bytes_and_load_peak(gpu_checkpoint: Path) -> None:
    """Quantized on the GPU: the same bytes as `from_pretrained(device_map="cuda:0")`, a fraction of its VRAM peak."""
    torch.cuda.reset_peak_memory_stats()
    expected = AutoModelForCausalLM.from_pretrained(
        gpu_checkpoint, quantization_config=nf4_config(torch.bfloat16), device_map="cuda:0", dtype=torch.bfloat16
    ).train()
    standard_peak = torch.cuda.max_memory_allocated()
    expected_host = {name: t.cpu() for name, t in _frozen_4bit(expected).items()}
    del expected
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # the peak counts what is still allocated; only the load's own is wanted
    actual = load_blockwise(gpu_checkpoint, compute_dtype=torch.bfloat16, progress=False)
    loader_peak = torch.cuda.max_memory_allocated() - before
    print(
        f"[loader] Llama-3.2-1B shape: load peak {loader_peak / 2**20:.0f} MiB,"
        f" standard {standard_peak / 2**20:.0f} MiB"
    )
    found = _frozen_4bit(actual)
    assert found.keys() == expected_host.keys()
    for name, tensor in expected_host.items():
        assert found[name].device.type == "cpu" and torch.equal(tensor, found[name]), name
        assert _digest(tensor) == _digest(found[name]), name
    assert host_copy_of(actual).arena.pinned
    # One weight (bf16 plus its quantized copy) at a time: 8192 x 2048 bf16 is 34 MB.
    assert loader_peak < 256 * 1024**2 < standard_peak, (loader_peak, standard_peak)


@pytest.mark.gpu
@_needs_gpu
def test_gpu_training_equals_standard_path(gpu_checkpoint: Path) -> None:
    """Two optimizer steps on the GPU from either load are `torch.equal`.

    Deterministic algorithms, as in the GPU tests: run with `CUBLAS_WORKSPACE_CONFIG=:4096:8`.
    """
    torch.use_deterministic_algorithms(True)
    wrap = _lora("llama")
    kwargs = dict(accelerator="gpu", precision="bf16-mixed", max_steps=2, batches=padded_batches(4, seq=64))
    control = fit(
        CausalLMModule(
            lambda: wrap(
                AutoModelForCausalLM.from_pretrained(
                    gpu_checkpoint, quantization_config=nf4_config(torch.bfloat16), device_map="cuda:0"
                ).train()
            )
        ),
        BlockwiseStrategy(block_size=2),
        **kwargs,
    )
    strategy = BlockwiseStrategy(block_size=2)
    loaded = fit(
        CausalLMModule(lambda: wrap(load_blockwise(gpu_checkpoint, compute_dtype=torch.bfloat16, block_size=2))),
        strategy,
        **kwargs,
    )
    assert_equal_runs(control, loaded)


def test_a_detached_host_copy_is_not_reused(saved: dict[str, Path]) -> None:
    """`detach_host_copy`: the model forgets its copy (freed once nothing holds it); the next run packs a new one."""
    wrap = _lora("llama")
    module = CausalLMModule(lambda: wrap(_load(saved["llama-bf16"], torch.float32, block_size=1)))
    base = module.model.base_model.model
    loaded = host_copy_of(base)
    assert loaded is not None and detach_host_copy(base) is loaded
    assert host_copy_of(base) is None and detach_host_copy(base) is None
    strategy = BlockwiseStrategy(block_size=1)
    fit(module, strategy, max_steps=1)
    assert strategy.host_copy is not None and strategy.host_copy is not loaded


@pytest.mark.parametrize("name", ["share", "progress", "quantize"])
def test_a_flag_that_is_not_a_bool_is_refused(saved: dict[str, Path], name: str) -> None:
    """NOTE [ A string is not a flag ] in compat/flags.py: `share="no"` shared; now it is refused before any work."""
    with pytest.raises(MisconfigurationException, match=rf"^`load_blockwise\({name}='no'\)` must be True or False"):
        load_blockwise(saved["llama-bf16"], compute_dtype=torch.float32, device="cpu", **{name: "no"})


def test_control_without_the_check_share_no_shares(saved: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """What the check prevents: `share="no"` serves the copy to other processes, as `share=True` does."""
    monkeypatch.setattr(lightning_blockwise.loading.load, "check_flag", lambda *args, **kwargs: None)
    served = {}
    # A scope of its own: a copy of the same checkpoint that an earlier test's model still owns in this process would
    # be reused without serving (`owned_here`), whatever `share` says.
    scope = f"control-{uuid.uuid4().hex}"
    for share in ("no", False):
        model = load_blockwise(
            saved["llama-bf16"], compute_dtype=torch.float32, device="cpu", progress=False, share=share,
            share_scope=scope,
        )  # fmt: skip
        copy = detach_host_copy(model)
        served[share] = copy.serving is not None
        if copy.serving is not None:
            copy.serving.release()  # no thread left serving it to the tests that follow
    assert served == {"no": True, False: False}
