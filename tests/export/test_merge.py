"""`lightning-blockwise export`'s merge (export/): exact against PEFT, streamed, atomic, refused early.

The references are PEFT's own merges of the same adapter on the same base loaded by
``from_pretrained``: ``merge_and_unload`` on the NF4 model for an NF4 export (PEFT re-quantizes), and
``merge_and_unload`` on transformers' ``dequantize()`` of it for a dense export. Every adapter has
non-zero ``B`` (a fresh LoRA merges to the base, which any check passes), and each equality has a
control arm that a wrong scale or a skipped layer fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from torch import Tensor
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.export import merge as merge_module
from lightning_blockwise.export.merge import export
from lightning_blockwise.export.model_card import CONFIG_KEY
from lightning_blockwise.export.shards import INDEX_FILE, SINGLE_FILE, ShardWriter
from lightning_blockwise.export.sources import open_adapter
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from tests.helpers.models import VOCAB, trainer

#: Adapted linears of the test adapters: attention, two of the MLP's three, and the (unquantized) LM head.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "lm_head"]
ADAPTED_IN_LAYER_1 = [f"model.layers.1.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
    "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]  # fmt: skip


def _adapter(
    base: Path, directory: Path, seed: int = 0, save_embedding_layers: bool | str = "auto", **lora: Any
) -> Path:
    """A LoRA adapter over ``base`` with random, non-zero ``A`` and ``B`` (``B`` small, as after training)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    settings = dict(r=4, lora_alpha=8, target_modules=TARGETS, alpha_pattern={"down_proj": 16}) | lora
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **settings))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    peft_model.save_pretrained(directory, save_embedding_layers=save_embedding_layers)
    return directory


@pytest.fixture(scope="module")
def adapter(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _adapter(checkpoints["llama"], tmp_path_factory.mktemp("adapter"))


@pytest.fixture
def base(checkpoints: dict[str, Path]) -> Path:
    """A 4-layer fp32 Llama checkpoint (untied LM head)."""
    return checkpoints["llama"]


def _nf4(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=nf4_config(dtype), dtype=dtype, device_map="cpu"
    )


def _peft_nf4_merge(base: Path, adapter: Path, dtype: torch.dtype) -> dict[str, Tensor]:
    """PEFT's merge on the NF4 base: ``merge_and_unload`` re-quantizes every adapted 4-bit linear."""
    return PeftModel.from_pretrained(_nf4(base, dtype), adapter).merge_and_unload().state_dict()


def _peft_dense_merge(base: Path, adapter: Path, dtype: torch.dtype, out: torch.dtype) -> dict[str, Tensor]:
    """PEFT's merge on transformers' dequantized copy of the NF4 base, cast to ``out``: dequant(NF4) + delta."""
    merged = PeftModel.from_pretrained(_nf4(base, dtype).dequantize(), adapter).merge_and_unload()
    return {key: value.to(out) for key, value in merged.state_dict().items()}


def _written(directory: Path) -> dict[str, Tensor]:
    """Every tensor of an export's shards, as stored."""
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def _mismatches(got: dict[str, Tensor], expected: dict[str, Tensor]) -> list[str]:
    """Keys whose tensors are not ``torch.equal`` (dtype included); the key sets must be the same."""
    assert got.keys() == expected.keys()
    return sorted(k for k in expected if got[k].dtype != expected[k].dtype or not torch.equal(got[k], expected[k]))


def _wrong_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the delta scaled by ``lora_alpha`` instead of ``lora_alpha / r``, a classic merge bug."""
    real = merge_module.lora_delta
    monkeypatch.setattr(merge_module, "lora_delta", lambda a, b, scaling: real(a, b, scaling * a.shape[0]))


def _skip_layer_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the adapters of decoder layer 1 are never merged."""

    @contextmanager
    def skipping(path: Path) -> Iterator[Any]:
        with open_adapter(path) as trained:
            for name in [n for n in trained.modules if n.startswith("model.layers.1.")]:
                del trained.modules[name]
            yield trained

    monkeypatch.setattr(merge_module, "open_adapter", skipping)


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_bf16_export_is_dequantized_nf4_plus_delta(
    base: Path, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compute_dtype: str
) -> None:
    dtype = getattr(torch, compute_dtype)
    expected = _peft_dense_merge(base, adapter, dtype, torch.bfloat16)
    # Not vacuous: the adapters change every adapted weight of the dequantized base.
    unmerged = {k: v.to(torch.bfloat16) for k, v in _nf4(base, dtype).dequantize().state_dict().items()}
    assert set(ADAPTED_IN_LAYER_1) <= set(_mismatches(unmerged, expected))

    export(adapter, base, tmp_path / "out", merge="bf16", compute_dtype=compute_dtype, progress=False)
    assert _mismatches(_written(tmp_path / "out"), expected) == []
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.dtype == torch.bfloat16 and _mismatches(loaded.state_dict(), expected) == []

    _wrong_scale(monkeypatch)
    export(adapter, base, tmp_path / "scaled", merge="bf16", compute_dtype=compute_dtype, progress=False)
    assert set(ADAPTED_IN_LAYER_1) <= set(_mismatches(_written(tmp_path / "scaled"), expected))


def test_a_skipped_layer_fails_the_comparison(
    base: Path, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _peft_dense_merge(base, adapter, torch.float32, torch.float32)
    _skip_layer_1(monkeypatch)
    export(adapter, base, tmp_path / "out", merge="fp32", compute_dtype="float32", progress=False)
    assert _mismatches(_written(tmp_path / "out"), expected) == sorted(ADAPTED_IN_LAYER_1)


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_nf4_export_is_byte_identical_to_peft_merge_and_unload(
    base: Path, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compute_dtype: str
) -> None:
    dtype = getattr(torch, compute_dtype)
    expected = _peft_nf4_merge(base, adapter, dtype)
    export(adapter, base, tmp_path / "out", merge="nf4", compute_dtype=compute_dtype, progress=False)
    # Every tensor PEFT's merged model holds, byte for byte: packed weights, absmax, code tables, quant-state JSON.
    assert _mismatches(_written(tmp_path / "out"), expected) == []
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", device_map="cpu")
    assert isinstance(loaded.model.layers[0].mlp.up_proj, Linear4bit)
    assert loaded.config.quantization_config.bnb_4bit_quant_type == "nf4"
    assert _mismatches(loaded.state_dict(), expected) == []

    _wrong_scale(monkeypatch)
    export(adapter, base, tmp_path / "scaled", merge="nf4", compute_dtype=compute_dtype, progress=False)
    wrong = _mismatches(_written(tmp_path / "scaled"), expected)
    assert set(ADAPTED_IN_LAYER_1) <= set(wrong)
    # Weights without an adapter keep their training NF4 bytes either way.
    assert not any(".up_proj." in key for key in wrong)


def test_rslora_scales_as_peft_does(base: Path, tmp_path: Path) -> None:
    adapter = _adapter(base, tmp_path / "adapter", seed=1, use_rslora=True, alpha_pattern={})
    export(adapter, base, tmp_path / "out", merge="nf4", compute_dtype="float32", progress=False)
    assert _mismatches(_written(tmp_path / "out"), _peft_nf4_merge(base, adapter, torch.float32)) == []


def test_merged_logits_match_the_peft_model(base: Path, adapter: Path, tmp_path: Path) -> None:
    """The merged model computes what the trained one does: fp32 within 1e-5, bf16 within 1e-2 (its rounding).

    Measured on this model: 1.5e-7 and 2.7e-3, against 0.30 for the adapters' own effect. An NF4 export is
    off by its re-quantization (0.058 here, as PEFT's merge is: it is byte-identical to it, tested above).
    """
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = PeftModel.from_pretrained(_nf4(base, torch.float32), adapter).eval()(ids).logits
        unadapted = _nf4(base, torch.float32).eval()(ids).logits
        for mode, dtype, tolerance in (("fp32", torch.float32, 1e-5), ("bf16", torch.bfloat16, 1e-2)):
            export(adapter, base, tmp_path / mode, merge=mode, compute_dtype="float32", progress=False)
            merged = AutoModelForCausalLM.from_pretrained(tmp_path / mode).eval()
            assert merged.dtype == dtype
            error = (merged(ids).logits.float() - trained).abs().max().item()
            assert error < tolerance, mode
            # Control: the adapters' contribution is far above the tolerance.
            assert (unadapted - trained).abs().max().item() > 10 * tolerance


def test_merge_into_original_adds_to_the_checkpoint_weights_and_says_so(
    base: Path, adapter: Path, tmp_path: Path
) -> None:
    export(adapter, base, tmp_path / "original", merge="fp32", merge_into_original=True, progress=False)
    export(adapter, base, tmp_path / "trained", merge="fp32", progress=False)
    original = AutoModelForCausalLM.from_pretrained(base)
    expected = PeftModel.from_pretrained(original, adapter).merge_and_unload().state_dict()
    assert _mismatches(_written(tmp_path / "original"), expected) == []
    # The trained function is another model: every 4-bit linear differs (by the NF4 error).
    assert set(ADAPTED_IN_LAYER_1) <= set(_mismatches(_written(tmp_path / "trained"), expected))
    for name, merged_into, card in (("original", "original", "Not the model that was trained"),
                                    ("trained", "dequantized_nf4", "dequant(NF4(W)) +")):  # fmt: skip
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config[CONFIG_KEY]["merged_into"] == merged_into and "quantization_config" not in config
        assert card in (tmp_path / name / "README.md").read_text()


def test_a_pre_quantized_base_merges_as_peft_does(base: Path, adapter: Path, tmp_path: Path) -> None:
    _nf4(base, torch.bfloat16).save_pretrained(tmp_path / "nf4_base")
    expected = (
        PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tmp_path / "nf4_base", device_map="cpu"), adapter
        )
        .merge_and_unload()
        .state_dict()
    )
    export(adapter, tmp_path / "nf4_base", tmp_path / "out", merge="nf4", progress=False)
    assert _mismatches(_written(tmp_path / "out"), expected) == []
    with pytest.raises(MisconfigurationException, match="needs the original weights"):
        export(adapter, tmp_path / "nf4_base", tmp_path / "x", merge="bf16", merge_into_original=True)


def test_a_checkpoint_of_causal_lm_finetune_exports_its_adapter_and_merges(base: Path, tmp_path: Path) -> None:
    module = CausalLMFineTune(
        str(base), lora_r=4, compute_dtype="bfloat16", learning_rate=1e-2, warmup_steps=1,
        adapter_dir=str(tmp_path / "adapter"),
    )  # fmt: skip
    fitter = trainer(BlockwiseStrategy(), max_steps=2, accumulate_grad_batches=1, default_root_dir=tmp_path)
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=4, batch_size=2))
    fitter.save_checkpoint(tmp_path / "run.ckpt")
    trained = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    assert all(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)

    export(tmp_path / "run.ckpt", base, tmp_path / "from_ckpt", progress=False)
    reloaded = PeftModel.from_pretrained(_nf4(base, torch.bfloat16), tmp_path / "from_ckpt")
    weights = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert weights.keys() == trained.keys() and all(torch.equal(weights[n], trained[n]) for n in trained)

    # The checkpoint's compute dtype is used: its merge is PEFT's over the bf16-loaded NF4 base.
    export(tmp_path / "run.ckpt", base, tmp_path / "merged", merge="nf4", progress=False)
    expected = _peft_nf4_merge(base, tmp_path / "adapter", torch.bfloat16)
    assert _mismatches(_written(tmp_path / "merged"), expected) == []
    # Another dtype is the user's to ask for, but not silently (NOTE [ The training record of an adapter ]).
    with pytest.warns(UserWarning, match=r"--compute-dtype float32 differs from the bfloat16 that"):
        export(tmp_path / "run.ckpt", base, tmp_path / "x", merge="nf4", compute_dtype="float32", progress=False)


def test_a_dora_checkpoint_exports_its_adapter_but_is_not_merged(base: Path, tmp_path: Path) -> None:
    module = CausalLMFineTune(
        str(base), lora_r=4, use_dora=True, compute_dtype="float32", learning_rate=1e-2, warmup_steps=1,
        adapter_dir=str(tmp_path / "adapter"),
    )  # fmt: skip
    fitter = trainer(BlockwiseStrategy(), max_steps=1, accumulate_grad_batches=1, default_root_dir=tmp_path)
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=VOCAB, num_samples=2, batch_size=2))
    fitter.save_checkpoint(tmp_path / "run.ckpt")
    trained = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in trained)

    export(tmp_path / "run.ckpt", base, tmp_path / "from_ckpt", progress=False)
    reloaded = PeftModel.from_pretrained(_nf4(base, torch.float32), tmp_path / "from_ckpt")
    weights = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert weights.keys() == trained.keys() and all(torch.equal(weights[n], trained[n]) for n in trained)
    with pytest.raises(MisconfigurationException, match="DoRA rescales every row"):
        export(tmp_path / "run.ckpt", base, tmp_path / "merged", merge="bf16", progress=False)
    assert not (tmp_path / "merged").exists()


def test_shards_respect_the_cap_and_the_index_lists_every_tensor(base: Path, adapter: Path, tmp_path: Path) -> None:
    cap = 20_000
    export(adapter, base, tmp_path / "sharded", merge="bf16", max_shard_size=cap, progress=False)
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [s.name for s in shards]
    tensors = _written(tmp_path / "sharded")
    assert index["weight_map"].keys() == tensors.keys()
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            sizes = [handle.get_tensor(k).nbytes for k in handle.keys()]
        assert sum(sizes) <= cap or len(sizes) == 1, shard.name  # one tensor above the cap stands alone
    export(adapter, base, tmp_path / "single", merge="bf16", progress=False)
    assert not (tmp_path / "single" / INDEX_FILE).exists() and (tmp_path / "single" / SINGLE_FILE).is_file()
    assert _mismatches(_written(tmp_path / "single"), tensors) == []


def test_a_failure_mid_write_leaves_nothing_behind(
    base: Path, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out"
    export(adapter, base, target, merge="bf16", progress=False)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    real, written = ShardWriter.write, []

    def failing(self: ShardWriter, name: str, tensor: Tensor) -> None:
        if len(written) == 20:
            raise OSError("disk full")
        written.append(name)
        real(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing)
    for overwrite, destination in ((True, target), (False, tmp_path / "fresh")):
        written.clear()
        with pytest.raises(OSError, match="disk full"):
            export(adapter, base, destination, merge="fp32", max_shard_size=5000, overwrite=overwrite, progress=False)
        assert len(written) == 20  # it failed in the middle, after shards were written
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # the previous export is intact
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging directory, no partial `fresh`


def _dora_adapter(base: Path, directory: Path) -> Path:
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
    )
    model.save_pretrained(directory)
    return directory


def _other_base(directory: Path, vocab_size: int = VOCAB, hidden_size: int = 48, layers: int = 2, **more: Any) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, **more,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _resized_vocabulary(base: Path, tmp_path: Path) -> dict[str, Any]:
    """An adapter that carries the embedding (PEFT's `save_embedding_layers`), over a base of another vocabulary."""
    adapter = _adapter(base, tmp_path / "carries", target_modules=["q_proj"], save_embedding_layers=True)
    return dict(
        adapter=adapter, base=_other_base(tmp_path / "resized", vocab_size=VOCAB + 32, hidden_size=32, layers=4)
    )


REFUSALS: dict[str, tuple[Callable[[Path, Path, Path], dict[str, Any]], str]] = {
    "missing adapter": (lambda b, a, t: dict(adapter=t / "nope"), "does not exist"),
    "no weights file": (lambda b, a, t: dict(adapter=t / "empty"), "has no adapter_config.json"),
    "bad merge": (lambda b, a, t: dict(merge="int8"), "is not one of none, bf16, fp32, nf4"),
    "original without merge": (lambda b, a, t: dict(merge="none", merge_into_original=True), "needs a merge"),
    "bad compute dtype": (lambda b, a, t: dict(compute_dtype="int8"), "--compute-dtype 'int8'"),
    "bad shard size": (lambda b, a, t: dict(max_shard_size="5 parsecs"), "--max-shard-size"),
    "missing base": (lambda b, a, t: dict(base=t / "nope"), "does not exist"),
    "other base size": (lambda b, a, t: dict(base=_other_base(t / "other")), r"lora_A \(4, 32\)"),
    "resized vocabulary": (lambda b, a, t: _resized_vocabulary(b, t), r"which PEFT loads over the base's"),
    "tied lm_head": (
        lambda b, a, t: dict(base=_other_base(t / "tied", hidden_size=32, layers=4, tie_word_embeddings=True)),
        "whose weight the base .* does not store",
    ),
    "dora": (lambda b, a, t: dict(adapter=_dora_adapter(b, t / "dora")), "DoRA"),
    "non-empty target": (lambda b, a, t: dict(overwrite=False), "already holds files"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_input_is_refused_before_any_weight_is_read(
    base: Path, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    (tmp_path / "empty").mkdir()
    target = tmp_path / "target"
    if case == "non-empty target":
        target.mkdir()
        (target / "keep.txt").write_text("an earlier export")
    arguments = dict(adapter=adapter, base=base, target=target, merge="nf4", progress=False)
    build, message = REFUSALS[case]
    arguments.update(build(base, adapter, tmp_path))

    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a weight was read or written before the input was refused")

    monkeypatch.setattr(merge_module, "_write_weights", no_work)
    with pytest.raises(MisconfigurationException, match=message) as refused:
        export(**arguments)
    assert str(refused.value).startswith("lightning-blockwise export: ")  # one line the CLI prints as it is
    assert not [p for p in tmp_path.iterdir() if p.name.endswith((".partial", ".old"))]
    assert case == "non-empty target" or not target.exists()


def test_the_refusal_harness_sees_work(
    base: Path, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control of the test above: good input reaches the weights."""

    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("reached")

    monkeypatch.setattr(merge_module, "_write_weights", no_work)
    with pytest.raises(AssertionError, match="reached"):
        export(adapter, base, tmp_path / "target", merge="nf4", progress=False)


def _profiled_peak_bytes(work: Callable[[], object], trace: Path) -> int:
    """The most bytes torch's CPU allocator held at once during ``work``, of those allocated during it.

    From the profiler's memory events (``profile_memory=True``): each allocation and free records
    the running total of the bytes allocated while profiling (in this profile or an earlier one: the
    callers keep nothing alive between profiles). That is every tensor storage the merge makes (the
    base's tensors as read and cast, the NF4 weights, the dequantized and merged weights, the
    outputs), and not Python objects or the page cache of the memory-mapped checkpoint.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        work()
    profiler.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    totals = [e["args"]["Total Allocated"] for e in sorted(events, key=lambda e: e["ts"])]
    assert totals and min(totals) >= 0, "the profiler recorded no allocation, or frees it did not see"
    return max(totals)


def test_peak_host_memory_does_not_grow_with_the_number_of_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Merging 2N layers holds no more than merging N, up to less than one layer's size; a merge that keeps
    what it wrote (the control) holds N layers more."""
    shape = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
    layers = {2: None, 4: None}
    for count in layers:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(transformers.LlamaConfig(num_hidden_layers=count, **shape))
        model.save_pretrained(tmp_path / f"base{count}")
        layers[count] = _adapter(tmp_path / f"base{count}", tmp_path / f"adapter{count}")
    layer_bytes = sum(p.numel() * 2 for p in model.model.layers[0].parameters())  # one merged bf16 layer

    kept: list[Tensor] = []

    def peak(count: int, name: str) -> int:
        def merge() -> None:
            export(layers[count], tmp_path / f"base{count}", tmp_path / name, merge="bf16", progress=False)
            kept.clear()  # inside the profile, which sees only the frees made while it runs

        return _profiled_peak_bytes(merge, tmp_path / f"{name}.json")

    growth = peak(4, "m4") - peak(2, "m2")
    assert abs(growth) < layer_bytes, (growth, layer_bytes)
    # In fact it does not grow at all (measured: 0 bytes). A merge that kept each linear's NF4 statistics alive
    # (bitsandbytes points the meta module at every quant state it makes) grew by 7,488 bytes here.
    assert abs(growth) < layer_bytes // 100, (growth, layer_bytes)

    real = ShardWriter.write
    monkeypatch.setattr(
        ShardWriter, "write", lambda self, name, tensor: (kept.append(tensor), real(self, name, tensor))
    )
    leaking_growth = peak(4, "k4") - peak(2, "k2")
    assert leaking_growth > 1.5 * layer_bytes, (leaking_growth, layer_bytes)


@pytest.mark.gpu
def test_on_the_gpu_nf4_equals_peft_and_vram_does_not_grow_with_the_layers(tmp_path: Path) -> None:
    shape = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)
    adapters = {}
    for count in (2, 4):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(transformers.LlamaConfig(num_hidden_layers=count, **shape))
        model.save_pretrained(tmp_path / f"base{count}")
        adapters[count] = _adapter(tmp_path / f"base{count}", tmp_path / f"adapter{count}")
    # The first merge allocates what CUDA libraries keep for good (cuBLAS' workspace): not the merge's own peak.
    export(adapters[2], tmp_path / "base2", tmp_path / "warm-up", merge="nf4", device="cuda", progress=False)
    peaks = {}
    for count in (2, 4):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        export(adapters[count], tmp_path / f"base{count}", tmp_path / f"m{count}", merge="nf4", device="cuda",
               progress=False)  # fmt: skip
        peaks[count] = torch.cuda.max_memory_allocated() - before
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())  # one fp32 layer
    assert abs(peaks[4] - peaks[2]) < layer_bytes, (peaks, layer_bytes)

    def reference() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(
            tmp_path / "base4",
            quantization_config=nf4_config(torch.bfloat16),
            dtype=torch.bfloat16,
            device_map="cuda:0",
        )

    merged = PeftModel.from_pretrained(reference(), adapters[4]).merge_and_unload().state_dict()
    assert _mismatches(_written(tmp_path / "m4"), {k: v.cpu() for k, v in merged.items()}) == []
    export(adapters[4], tmp_path / "base4", tmp_path / "dense", merge="bf16", device="cuda", progress=False)
    dense = PeftModel.from_pretrained(reference().dequantize(), adapters[4]).merge_and_unload().state_dict()
    assert _mismatches(_written(tmp_path / "dense"), {k: v.cpu() for k, v in dense.items()}) == []


def test_another_base_path_is_warned_about(base: Path, adapter: Path, tmp_path: Path) -> None:
    """The adapter names the checkpoint it was trained on; a BASE elsewhere gets a warning (control: the same one)."""
    import shutil
    import warnings

    copy = Path(shutil.copytree(base, tmp_path / "copy"))
    with pytest.warns(UserWarning, match=r"the adapter was trained on .*, and BASE is .*copy"):
        export(adapter, copy, tmp_path / "out", progress=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*the adapter was trained on.*")
        export(adapter, base, tmp_path / "same", progress=False)
