"""`lightning-blockwise plan` and the sizes and card recommendation behind it (planning/sizing.py, recommend.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from bitsandbytes.nn import Params4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.architectures import adapter_parameters, find_decoder_stack
from lightning_blockwise.cli import main, plan, plan_report
from lightning_blockwise.loading.load import load_blockwise
from lightning_blockwise.planning import StepShape, parse_bytes
from lightning_blockwise.planning.recommend import CUDA_CONTEXT_RESERVE, SMALLEST_CARD
from lightning_blockwise.planning.sizing import ModelSizes, model_sizes, nf4_tensor_bytes, recommend
from lightning_blockwise.planning.step_kernels import StepKernels
from lightning_blockwise.residency.layout import layout_block
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import CONFIGS, TARGETS, build_model, moe_config

ROOT = Path(__file__).resolve().parents[2]
#: The model's own layers: the answers of plan before --kernels, whatever is installed (NOTE [ The kernels plan
#: counts ] in cli/plan_kernels.py; the default, auto, counts Liger's kernels where Liger-Kernel is installed).
OWN = ("--kernels", "none")

#: The benchmark's shapes (benchmarks/step_benchmark.py) and their measured blockwise:1:2 peaks (RESULTS.md).
QWEN25 = {
    "7b": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                num_key_value_heads=4), 3.11e9),
    "32b": (dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                 num_key_value_heads=8), 5.75e9),
}  # fmt: skip


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2", "phi3"])
def test_sizes_equal_the_layouts_of_a_loaded_nf4_model(checkpoints: dict[str, Path], model_type: str) -> None:
    model = build_model(model_type, checkpoints[model_type], quantized=True)
    stack = find_decoder_stack(model)
    sizes = model_sizes(CONFIGS[model_type](), dtype=torch.float32, lora_rank=4, targets=TARGETS.get(model_type))
    for block_size in (1, 2, 3):
        layouts = [
            layout_block(stack.layers[start : start + block_size], first_index=start)
            for start in range(0, len(stack.layers), block_size)
        ]
        assert sizes.block_bytes(block_size) == [layout.nbytes for layout in layouts]
    adapters = [p for layer in stack.layers for p in adapter_parameters(layer).values()]
    assert sizes.trainable_bytes == sum(p.numel() * p.element_size() for p in adapters)
    assert sizes.device_bytes == _frozen_device_bytes(stack)


def _frozen_device_bytes(stack: object) -> int:
    """What the strategy keeps on the device besides adapters and layers, counted on the loaded model."""
    model = stack.model
    in_layers = {id(t) for layer in stack.layers for t in [*layer.parameters(), *layer.buffers()]}
    embedding = model.get_input_embeddings()
    tied = embedding.weight is model.get_output_embeddings().weight
    skip = in_layers | (set() if tied else {id(t) for t in [*embedding.parameters(), *embedding.buffers()]})
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*model.parameters(), *model.buffers()]
        if id(t) not in skip and not t.requires_grad
    }
    codes = sum(
        p.quant_state.code.nbytes + p.quant_state.state2.code.nbytes
        for p in model.parameters()
        if isinstance(p, Params4bit)
    )
    return sum(storages.values()) + codes


def _tiny_llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip


def test_nf4_bytes_by_hand() -> None:
    # 64 x 64 weight: 2048 packed bytes, 64 uint8 absmax, fp32 offset, one fp32 nested absmax.
    assert nf4_tensor_bytes(64 * 64) == [2048, 64, 4, 4]
    # 300 blocks of 64 need two nested absmax; without double quant the absmax are fp32.
    assert nf4_tensor_bytes(300 * 64) == [9600, 300, 4, 8]
    assert nf4_tensor_bytes(300 * 64, double_quant=False) == [9600, 1200]


def test_small_config_by_hand() -> None:
    sizes = model_sizes(_tiny_llama(), dtype=torch.float32, lora_rank=4)
    # Per layer, each tensor starts 256-aligned: a linear takes its packed bytes rounded up plus 3 x 256
    # (absmax, offset, nested absmax); q and o 32x32 (512 packed), k and v 32x16 (256), gate/up/down
    # 32x64 (1024); then two fp32 norms of 32, the last one unpadded.
    layer = (512 + 768) * 2 + (256 + 768) * 2 + (1024 + 768) * 3 + 256 + 128
    assert layer == 10368
    assert sizes.block_bytes(1) == [layer] * 4
    assert sizes.block_bytes(2) == [10496 + layer] * 2
    assert sizes.host_bytes(1) == 4 * 10496
    # LoRA r4 on all seven: r * (in + out) fp32 elements each.
    assert sizes.trainable_bytes == 4 * 4 * 4 * (64 * 2 + 48 * 2 + 96 * 3)
    # LM head 96x32 fp32, final norm, two rotary tables of 4 fp32, code tables of 28 linears (16 + 256 fp32).
    assert sizes.device_bytes == 96 * 32 * 4 + 32 * 4 + 2 * 4 * 4 + 28 * (16 + 256) * 4
    assert sizes.host_embedding_bytes == 96 * 32 * 4

    plan = sizes.residency(tokens=12, block_size=1, prefetch_depth=2)
    activation = StepShape(12, 32, 64, 96, 4, activation_bytes=4).activation_peak()
    fixed = sizes.device_bytes + sizes.trainable_bytes + 2 * 32 * 2**20  # and two cuBLAS workspaces, as on Hopper
    assert plan.predicted_peak == fixed + 3 * sizes.trainable_bytes + activation + 3 * layer


@pytest.mark.parametrize("shape", ["7b", "32b"])
def test_predicted_peak_within_10_percent_of_measured(shape: str) -> None:
    kwargs, measured = QWEN25[shape]
    config = transformers.Qwen2Config(vocab_size=152064, tie_word_embeddings=False, **kwargs)
    sizes = model_sizes(config, dtype=torch.bfloat16, lora_rank=16)
    predicted = sizes.residency(tokens=512, block_size=1, prefetch_depth=2).predicted_peak
    # Within 10% and never under (issue 12's long-context model: the loss and a layer's backward are not
    # alive together; before it, the strategy logged 3.35 GB and 6.28 GB for these runs).
    assert 0 <= (predicted - measured) / measured < 0.10, f"{shape}: predicted {predicted / 1e9:.3f} GB"
    assert round(predicted / 1e9, 2) == {"7b": 3.28, "32b": 5.88}[shape]


def test_long_context_peak_within_10_percent_of_measured() -> None:
    # Qwen2.5-32B shape at 8192 tokens, offload off and Hugging Face's loss: 24.48 GB allocated on the H100
    # (LoRA r16 on all seven linears, bf16, batch 1).
    sizes = model_sizes(_qwen25("32b"), dtype=torch.bfloat16, lora_rank=16)
    predicted = sizes.residency(tokens=8192, block_size=1, prefetch_depth=2).predicted_peak
    assert 0 <= (predicted - 24.48e9) / 24.48e9 < 0.10, f"predicted {predicted / 1e9:.3f} GB"


def test_recommendation_for_a_card() -> None:
    sizes = model_sizes(_tiny_llama(), dtype=torch.float32)
    advice = recommend(sizes, gpu_memory=24 * 2**30, tokens=512)
    # The card less 1 GiB for the CUDA context; the allocator's headroom is inside the plan.
    assert advice.plan is not None and advice.budget <= 23 * 2**30
    # A tiny model fits resident whole: block_size 1, nothing streams.
    assert advice.block_size == 1 and len(advice.plan.resident) == 4
    assert advice.plan.predicted_reserved <= advice.budget
    # A card that leaves no budget once the CUDA context is on it is refused, not planned for with a negative one.
    with pytest.raises(ValueError, match=r"1,073,741,825 bytes \(1 GiB\) is too small for a card: the CUDA context"):
        recommend(sizes, gpu_memory=2**30 + 1, tokens=512)
    # Control: the smallest card is planned for; it only does not fit.
    assert recommend(sizes, gpu_memory=SMALLEST_CARD, tokens=512).budget == SMALLEST_CARD - CUDA_CONTEXT_RESERVE


@pytest.mark.parametrize("card", ["1KB", "1GiB"])
def test_plan_refuses_a_card_the_cuda_context_fills(card: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --gpu-memory 1KB` printed "-1.07 GB the card leaves"; now one line, before the config is read."""
    with pytest.raises(
        SystemExit,
        match=rf"^lightning-blockwise plan: argument --gpu-memory/--card: '{card}': .* is too"
        r" small for a card: .* needs at least 1.1 GiB\. Give the card's whole memory",
    ) as exit_info:
        main(["plan", "missing-checkpoint", f"--gpu-memory={card}"])
    assert "\n" not in str(exit_info.value) and "-1" not in capsys.readouterr().out
    # The same through the API.
    with pytest.raises(MisconfigurationException, match=r"^--gpu-memory: .* is too small for a card"):
        plan_report(_tiny_llama(), tokens=512, gpu_memory=parse_bytes(card))


def test_plan_from_config_json_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    args = ["--seq-len", "12", "--lora-rank", "4", "--dtype", "float32", "--gpu-memory", "8GiB", "--json", *OWN]
    main(["plan", str(tmp_path / "config.json"), *args])
    report = json.loads(capsys.readouterr().out)
    assert report["model_type"] == "llama" and report["num_layers"] == 4
    assert report["block_bytes"] == [10368] * 4 and report["host_arena_bytes"] == 4 * 10496
    assert report["recommendation"]["fits"] and report["recommendation"]["block_size"] == 1
    assert report == plan_report(_load(tmp_path), tokens=12, lora_rank=4, dtype="float32", gpu_memory=8 * 2**30)


def _load(path: Path) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(path)


def test_plan_table_and_budget_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    main(["plan", str(tmp_path), "--block-size", "2", "--vram-budget", "1GiB"])
    out = capsys.readouterr().out
    assert "predicted peak" in out and "2 of 2 layers: 2 x 0.0 MB" in out and "2 blocks resident" in out
    with pytest.raises(SystemExit, match=r"below the .* GiB this run needs"):
        main(["plan", str(tmp_path), "--vram-budget", "1KiB"])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["plan", str(tmp_path / "missing")])


def test_plan_help_through_the_console_entry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lightning_blockwise", "plan", "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--gpu-memory" in result.stdout and "--seq-len" in result.stdout
    # The rank under CausalLMFineTune's name, and the first spelling as its alias.
    assert "--lora-r LORA_R, --lora-rank LORA_R" in result.stdout


def test_lora_r_and_its_alias_lora_rank_are_one_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _tiny_llama().save_pretrained(tmp_path)

    def adapter_bytes(*flags: str) -> int:
        main(["plan", str(tmp_path), "--dtype", "float32", "--json", *flags])
        return json.loads(capsys.readouterr().out)["adapter_bytes"]

    assert adapter_bytes("--lora-r", "4") == adapter_bytes("--lora-rank", "4") == _adapter_bytes(rank=4)
    # The control: the flag reaches the sizes (another rank, other bytes; no flag, the default 16).
    assert adapter_bytes("--lora-r", "8") == _adapter_bytes(rank=8) != _adapter_bytes(rank=4)
    assert adapter_bytes() == _adapter_bytes(rank=16)


def _adapter_bytes(rank: int) -> int:
    return model_sizes(_tiny_llama(), dtype=torch.float32, lora_rank=rank).trainable_bytes


def test_sizes_are_a_dataclass_of_the_config() -> None:
    sizes = model_sizes(_tiny_llama(), dtype=torch.float32, lora_rank=0)
    assert isinstance(sizes, ModelSizes) and sizes.trainable_bytes == 0 and sizes.num_layers == 4


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--seq-len", "0", "argument --seq-len: 0 must be at least 1"),
        ("--batch-size", "-2", "argument --batch-size: -2 must be at least 1"),
        ("--lora-r", "0", "argument --lora-r/--lora-rank: 0 must be at least 1"),
        ("--lora-rank", "0", "argument --lora-r/--lora-rank: 0 must be at least 1"),
        ("--block-size", "0", "argument --block-size: 0 must be at least 1"),
        ("--prefetch-depth", "0", "argument --prefetch-depth: 0 must be at least 1"),
        ("--loss-chunk-tokens", "0", "argument --loss-chunk-tokens: 0 must be at least 1"),
        ("--loss-chunk-tokens", "1k", "argument --loss-chunk-tokens: '1k' is not a whole number"),
        ("--mlp-tile-tokens", "0", "argument --mlp-tile-tokens: 0 must be at least 1"),
        ("--mlp-tile-tokens", "4k", "argument --mlp-tile-tokens: '4k' is not a whole number"),
        ("--attention-tile-tokens", "0", "argument --attention-tile-tokens: 0 must be at least 1"),
        ("--offload-activations", "yes", "argument --offload-activations: invalid choice: 'yes'"),
        ("--seq-len", "2k", "argument --seq-len: '2k' is not a whole number"),
        ("--vram-budget", "0GiB", "argument --vram-budget: The memory size '0GiB' must be positive"),
        ("--vram-budget", "sixteen", "argument --vram-budget: Cannot read 'sixteen' as a memory size"),
        ("--gpu-memory", "-24GiB", "argument --gpu-memory/--card: The memory size '-24GiB' must be positive"),
        ("--gpu-memory", "inf", "argument --gpu-memory/--card: Cannot read 'inf' as a memory size: it is not finite"),
    ],
)
def test_plan_refuses_bad_numbers_before_reading_the_config(
    tmp_path: Path, flag: str, value: str, message: str
) -> None:
    # The checkpoint does not exist either: the flag's error coming first shows it is checked before any work.
    with pytest.raises(SystemExit, match=f"^lightning-blockwise plan: {re.escape(message)}") as exit_info:
        main(["plan", str(tmp_path / "missing"), f"{flag}={value}"])
    assert "\n" not in str(exit_info.value)


def test_plan_refuses_targets_the_decoder_layers_do_not_have(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _tiny_llama().save_pretrained(tmp_path / "llama")
    CONFIGS["phi3"]().save_pretrained(tmp_path / "phi3")
    llama_linears = "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
    with pytest.raises(SystemExit, match=re.escape(f"is named q_prj; their linears are {llama_linears}.")):
        main(["plan", str(tmp_path / "llama"), "--targets", "q_prj", "v_proj"])
    # The valid names are the config's: Phi-3 fuses q/k/v and gate/up.
    with pytest.raises(SystemExit, match=re.escape("are down_proj, gate_up_proj, o_proj, qkv_proj.")):
        main(["plan", str(tmp_path / "phi3"), "--targets", "q_proj"])
    # A qualified name is not how the targets are matched.
    with pytest.raises(SystemExit, match=r"is named self_attn\.q_proj;"):
        main(["plan", str(tmp_path / "llama"), "--targets", "self_attn.q_proj"])
    # Control arm: names the layers have are planned for, with fewer adapters than all of them.
    capsys.readouterr()
    some = plan([str(tmp_path / "llama"), "--targets", "q_proj", "v_proj", "--json"])
    every = plan([str(tmp_path / "llama"), "--json"])
    assert 0 < some["adapter_bytes"] < every["adapter_bytes"]


def test_plan_refuses_a_block_larger_than_the_model(tmp_path: Path) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    with pytest.raises(SystemExit, match=r"--block-size 5 is more than the 4 decoder layers of this llama model"):
        main(["plan", str(tmp_path), "--block-size", "5"])


def test_model_sizes_refuses_unknown_targets_and_negative_ranks() -> None:
    with pytest.raises(ValueError, match=r"no linear of the llama decoder layers is named q_prj or w_proj;"):
        model_sizes(_tiny_llama(), targets=["w_proj", "q_proj", "q_prj"])
    with pytest.raises(ValueError, match="lora_rank=-1 must be at least 0"):
        model_sizes(_tiny_llama(), lora_rank=-1)


def _qwen25(shape: str) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(vocab_size=152064, tie_word_embeddings=False, **QWEN25[shape][0])


def _plan_json(path: Path, capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    capsys.readouterr()
    main(["plan", str(path), "--dtype", "bfloat16", "--json", *args])
    return json.loads(capsys.readouterr().out)


def test_seq_len_changes_the_prediction_as_the_step_shape_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _qwen25("7b").save_pretrained(tmp_path)
    short = _plan_json(tmp_path, capsys, "--seq-len", "1024")
    long = _plan_json(tmp_path, capsys, "--seq-len", "16384")
    # The same tokens per micro-batch as batches: seq-len x batch-size is what counts.
    assert _plan_json(tmp_path, capsys, "--seq-len", "4096", "--batch-size", "4") == long
    assert long["tokens"] == 16384 and not long["offload_activations"] and long["loss_chunk_tokens"] is None

    def activations(tokens: int) -> int:
        return StepShape.for_config(_qwen25("7b"), tokens, num_layers=28, activation_bytes=2).activation_peak()

    # Only the activations depend on the tokens: blocks, slots, head and adapters stay.
    assert long["predicted_peak_bytes"] - short["predicted_peak_bytes"] == activations(16384) - activations(1024)
    assert long["slot_bytes"] == short["slot_bytes"] and long["num_slots"] == short["num_slots"] == 3


def test_offload_lowers_the_peak_by_the_inputs_it_moves_to_the_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _qwen25("7b").save_pretrained(tmp_path)
    kept = _plan_json(tmp_path, capsys, "--seq-len", "16384", "--offload-activations", "off")
    moved = _plan_json(tmp_path, capsys, "--seq-len", "16384", "--offload-activations", "on")
    assert (kept["offload_activations"], moved["offload_activations"]) == (False, True)
    # One layer's input: tokens x hidden x 2 bytes (bf16); 3 stay on the device (in use, coming back, going out).
    input_bytes = 16384 * 3584 * 2
    lowered = kept["predicted_peak_bytes"] - moved["predicted_peak_bytes"]
    # x 1.02: the allocator's rounding the memory model adds to the activations (planning/memory.py).
    assert abs(lowered - (28 - 3) * input_bytes * 1.02) <= 1
    # Every layer's input waits in pinned host memory, next to the arena.
    assert (kept["offload_host_bytes"], moved["offload_host_bytes"]) == (0, 28 * 16384 * 3584 * 2)
    assert moved["host_pinned_bytes"] == moved["host_arena_bytes"] + 28 * 16384 * 3584 * 2
    assert kept["host_pinned_bytes"] == kept["host_arena_bytes"]


def test_recommendation_makes_the_step_smaller_only_when_needed() -> None:
    seven = model_sizes(_qwen25("7b"), dtype=torch.bfloat16, lora_rank=16)
    card = 24 * 2**30
    # Control arm: at 2048 tokens the plain step fits; neither offload nor the chunked loss.
    plain = recommend(seven, card, tokens=2048)
    assert plain.plan is not None and not plain.offload_activations and plain.loss_chunk_tokens is None
    assert plain.mlp_tile_tokens is None
    assert plain.offload_host_bytes == 0

    # At 16384 tokens Hugging Face's loss alone holds 16384 x 152064 x 12 B = 29.9 GB of logits: neither the
    # plain step nor offload fits the 23.0 GiB budget. The chunked loss (1024 rows) brings every block streamed
    # to 11.0 GiB with the allocator's headroom, so offload is not needed on top of it. The rest of the budget
    # keeps the attention outputs of the layers it recomputes first (0.12 GB each at 16k tokens: NOTE [ Kept
    # attention ]), then one block's activations (4.8 GB of graph at 16k tokens with adapter dropout, replacing its
    # attention outputs: NOTE [ Kept activations ]), then every block resident.
    advice = recommend(seven, card, tokens=16384)
    assert advice.budget == int(23 * 2**30 / (2**30 // 10)) * (2**30 // 10)
    for offload in (False, True):
        assert seven.residency(16384, 1, 2, offload_inputs=offload).minimum > advice.budget
    assert (advice.offload_activations, advice.loss_chunk_tokens, advice.offload_host_bytes) == (False, 1024, 0)
    assert advice.mlp_tile_tokens is None
    assert advice.plan is not None and advice.block_size == 1 and len(advice.plan.resident) == 28
    assert advice.plan.kept == (0,) and advice.plan.attention == tuple(range(1, 28))
    assert advice.minimum == seven.residency(16384, kernels=StepKernels(1024)).minimum
    assert round(advice.plan.predicted_peak / 1e9, 2) == 21.81

    # Offload alone is enough where the saved inputs, not the logits, tip it over: 32B at 8192 tokens.
    thirty_two = model_sizes(_qwen25("32b"), dtype=torch.bfloat16, lora_rank=16)
    advice = recommend(thirty_two, card, tokens=8192)
    assert (advice.offload_activations, advice.loss_chunk_tokens) == (True, None) and advice.plan is not None
    assert advice.offload_host_bytes == 64 * 8192 * 5120 * 2
    # Both where the chunked loss alone is not enough: 32B at 16384 tokens.
    assert seven.residency(16384, 1, 2, kernels=StepKernels(1024)).minimum < advice.budget  # (the 7B's did fit)
    assert thirty_two.residency(16384, 1, 2, kernels=StepKernels(1024)).minimum > advice.budget
    advice = recommend(thirty_two, card, tokens=16384)
    assert (advice.offload_activations, advice.loss_chunk_tokens) == (True, 1024) and advice.plan is not None
    assert advice.mlp_tile_tokens is None  # the tiled MLP only where these are not enough


def test_recommendation_keeps_the_options_the_user_gave() -> None:
    seven = model_sizes(_qwen25("7b"), dtype=torch.bfloat16, lora_rank=16)
    # Offload forced off (or on) is never switched; the chunked loss is still suggested when it is needed.
    assert not recommend(seven, 16 * 2**30, tokens=32768, offload=False).offload_activations
    forced = recommend(seven, 24 * 2**30, tokens=2048, offload=True)
    assert forced.offload_activations and forced.loss_chunk_tokens is None
    # A chunk the module already uses is kept; at 32k tokens on 16 GiB it fits with offload (13.2 GiB streamed
    # with the allocator's headroom, a 15.0 GiB budget) but not without, so offload is added and no tiling.
    advice = recommend(seven, 16 * 2**30, tokens=32768, kernels=StepKernels(512))
    assert seven.residency(32768, offload_inputs=False, kernels=StepKernels(512)).minimum > advice.budget
    assert seven.residency(32768, offload_inputs=True, kernels=StepKernels(512)).minimum <= advice.budget
    assert (advice.offload_activations, advice.loss_chunk_tokens, advice.mlp_tile_tokens) == (True, 512, None)
    assert advice.plan is not None


def test_plan_json_and_table_carry_the_long_context_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _qwen25("32b").save_pretrained(tmp_path)
    report = _plan_json(tmp_path, capsys, "--seq-len", "16384", "--gpu-memory", "24GiB", *OWN)
    # Automatic offload plans for the card (as the strategy does without a budget): too big without it.
    assert report["offload_activations_option"] == "auto" and report["offload_activations"]
    assert report["offload_host_bytes"] == 64 * 16384 * 5120 * 2
    advice = report["recommendation"]
    assert advice["fits"] and advice["offload_activations"] and advice["loss_chunk_tokens"] == 1024
    assert advice["offload_host_bytes"] == 64 * 16384 * 5120 * 2
    assert advice["host_pinned_bytes"] == report["host_arena_bytes"] + advice["offload_host_bytes"]
    assert advice["strategy_settings"] == {"vram_budget": "23.0GiB", "block_size": 2, "offload_activations": True}
    assert advice["model_settings"] == {"loss_chunk_tokens": 1024} and advice["mlp_tile_tokens"] is None

    chunked = _plan_json(tmp_path, capsys, "--seq-len", "16384", "--loss-chunk-tokens", "1024")
    assert chunked["loss_chunk_tokens"] == 1024 and not chunked["offload_activations"]
    assert chunked["predicted_peak_bytes"] < report["predicted_peak_bytes"]

    monkeypatch.setenv("COLUMNS", "400")  # one row per line in rich's table
    main(["plan", str(tmp_path), "--seq-len", "16384", "--gpu-memory", "24GiB", *OWN])
    out = capsys.readouterr().out
    assert "vram_budget: 23.0GiB, block_size: 2, offload_activations: true: predicted peak" in out
    assert "use chunked_causal_lm_loss(..., chunk_tokens=1024) / CausalLMFineTune(loss_chunk_tokens=1024)" in out
    assert "offloaded to pinned host memory (offload_activations: auto" in out
    assert re.search(rf"host RAM, offloaded layer inputs\W+{64 * 16384 * 5120 * 2 / 1e9:.2f} GB pinned", out)


def _qwen25_72b() -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, tie_word_embeddings=False,
    )  # fmt: skip


def test_mlp_tiling_lowers_the_peak_as_the_step_shape_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _qwen25("7b").save_pretrained(tmp_path)
    # The chunked loss and offload fixed, so that one layer's backward, not the logits, sets the peak.
    fixed = ("--seq-len", "16384", "--loss-chunk-tokens", "1024", "--offload-activations", "on", *OWN)
    untiled = _plan_json(tmp_path, capsys, *fixed)
    tiled = _plan_json(tmp_path, capsys, *fixed, "--mlp-tile-tokens", "4096")
    assert (untiled["mlp_tile_tokens"], tiled["mlp_tile_tokens"]) == (None, 4096)

    def working_set(tile: int | None) -> int:
        shape = StepShape.for_config(_qwen25("7b"), 16384, 28, kernels=StepKernels(1024, tile))
        return shape.layer_working_set()

    # The MLP's part of one layer's working set shrinks from 16384 tokens to 4096 (6 x 12288 x 18944 x 2 bytes),
    # and the tiles' input gradients add one hidden-sized tensor (16384 x 3584 x 2 bytes); at 16k tokens the tiled
    # MLP's backward still binds, not the norm's (NOTE [ A layer's backward peak ]).
    assert working_set(None) - working_set(4096) == 6 * (16384 - 4096) * 18944 * 2 - 16384 * 3584 * 2
    lowered = untiled["predicted_peak_bytes"] - tiled["predicted_peak_bytes"]
    # Tiled, the layer's backward (1.91 GB) still outweighs one chunk's logits (1024 x 152064 x 12 B, 1.87 GB). x 1.02:
    # the allocator's rounding the memory model adds to the activations.
    assert 1024 * 152064 * 12 < working_set(4096)
    assert abs(lowered - (working_set(None) - working_set(4096)) * 1.02) <= 1
    # Control arms: a tile of every token is no tiling; and under Hugging Face's loss the logits (29.9 GB), not a
    # layer's backward, set the peak, so tiling lowers nothing there.
    assert _plan_json(tmp_path, capsys, *fixed, "--mlp-tile-tokens", "16384") == {**untiled, "mlp_tile_tokens": 16384}
    logits_bound = ("--seq-len", "16384", "--offload-activations", "on", *OWN)
    assert (
        _plan_json(tmp_path, capsys, *logits_bound, "--mlp-tile-tokens", "4096")["predicted_peak_bytes"]
        == _plan_json(tmp_path, capsys, *logits_bound)["predicted_peak_bytes"]
    )


def test_attention_tiling_is_planned_and_reported_but_leaves_the_norm_bound_peak(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _qwen25("7b").save_pretrained(tmp_path)
    # Offload, chunked loss and tiled MLP: one layer's backward sets the peak, at the norm's (NOTE [ A layer's
    # backward peak ]), which Hugging Face's RMSNorm keeps above attention's even untiled.
    fixed = (
        "--seq-len", "65536", "--loss-chunk-tokens", "1024", "--mlp-tile-tokens", "4096", "--gpu-memory", "24GiB", *OWN
    )  # fmt: skip
    untiled = _plan_json(tmp_path, capsys, *fixed)
    tiled = _plan_json(tmp_path, capsys, *fixed, "--attention-tile-tokens", "16384")
    assert (untiled["attention_tile_tokens"], tiled["attention_tile_tokens"]) == (None, 16384)
    assert tiled["recommendation"]["model_settings"]["attention_tile_tokens"] == 16384
    assert tiled["predicted_peak_bytes"] == untiled["predicted_peak_bytes"]
    # Control: the step shape it planned with did see the tile, and its attention peak is the smaller one.
    shapes = [
        StepShape.for_config(_qwen25("7b"), 65536, 28, kernels=StepKernels(1024, 4096, attention_tile_tokens=tile))
        for tile in (None, 16384)
    ]  # fmt: skip
    assert shapes[1].attention_working_set() < shapes[0].attention_working_set() < shapes[0].norm_working_set()
    monkeypatch.setenv("COLUMNS", "400")  # one row per line in rich's table
    main(["plan", str(tmp_path), "--seq-len", "65536", "--attention-tile-tokens", "16384"])
    assert re.search(r"attention\W+tiled: each layer's attention on 16384 queries at a time", capsys.readouterr().out)
    # --longest takes the tile too (it refused it before), and its settings to paste carry it.
    main(["plan", str(tmp_path), "--longest", "--card", "24GiB", "--host-ram", "128GiB", "--attention-tile-tokens",
          "16384", *OWN])  # fmt: skip
    assert "attention_tile_tokens=16384)" in capsys.readouterr().out


def test_recommendation_tiles_the_mlp_last() -> None:
    seventy_two = model_sizes(_qwen25_72b(), dtype=torch.bfloat16, lora_rank=16)
    card, tokens = 24 * 2**30, 32768
    advice = recommend(seventy_two, card, tokens)
    # Qwen2.5-72B at 32k tokens on a 24 GiB card (a 23.0 GiB budget): offload and the chunked loss still leave
    # one layer's backward at 15.3 GB (an untiled MLP on 32768 tokens), so every block streamed needs 27.5 GiB
    # with the allocator's headroom. Tiles of 4096 tokens bring that layer to 8.2 GB (the post-attention norm's
    # backward now binds) and the step to 20.1 GiB streamed: all three are picked.
    assert seventy_two.residency(tokens, offload_inputs=True, kernels=StepKernels(1024)).minimum > advice.budget
    assert (advice.offload_activations, advice.loss_chunk_tokens, advice.mlp_tile_tokens) == (True, 1024, 4096)
    assert advice.plan is not None and advice.plan.predicted_reserved <= advice.budget
    tiled = seventy_two.residency(tokens, offload_inputs=True, kernels=StepKernels(1024, 4096))
    assert advice.minimum == tiled.minimum
    # Block size 2: the rest stream in fewer, larger copies, and the last block (two layers) keeps its attention
    # outputs (1.1 GB at 32k tokens), which the budget spends before residency (NOTE [ Kept attention ]).
    assert advice.block_size == 2 and advice.plan.resident == () and advice.plan.attention == (39,)
    assert round(advice.plan.predicted_peak / 1e9, 2) == 21.94
    assert advice.offload_host_bytes == 80 * tokens * 8192 * 2

    # A tile the module already uses is kept from the first option on: at 4096 tokens the plain step fits.
    given = recommend(seventy_two, card, 4096, kernels=StepKernels(mlp_tile_tokens=2048))
    assert (given.offload_activations, given.loss_chunk_tokens, given.mlp_tile_tokens) == (False, None, 2048)
    assert given.minimum == seventy_two.residency(4096, kernels=StepKernels(mlp_tile_tokens=2048)).minimum
    # Nothing fits 32k tokens on a 16 GiB card (15.0 GiB budget, 20.1 GiB needed with all three), and the minimum
    # says so for the smallest step tried.
    short = recommend(seventy_two, 16 * 2**30, tokens)
    assert short.plan is None and short.minimum == advice.minimum > short.budget
    assert (short.offload_activations, short.loss_chunk_tokens, short.mlp_tile_tokens) == (True, 1024, 4096)


def test_plan_json_and_table_carry_the_tiled_mlp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _qwen25_72b().save_pretrained(tmp_path)
    report = _plan_json(tmp_path, capsys, "--seq-len", "32768", "--gpu-memory", "24GiB", *OWN)
    assert report["mlp_tile_tokens"] is None
    advice = report["recommendation"]
    assert advice["fits"] and (advice["loss_chunk_tokens"], advice["mlp_tile_tokens"]) == (1024, 4096)
    assert advice["strategy_settings"] == {"vram_budget": "23.0GiB", "block_size": 2, "offload_activations": True}
    assert advice["model_settings"] == {"loss_chunk_tokens": 1024, "mlp_tile_tokens": 4096}

    monkeypatch.setenv("COLUMNS", "400")  # one row per line in rich's table
    main(["plan", str(tmp_path), "--seq-len", "32768", "--gpu-memory", "24GiB", *OWN])
    out = capsys.readouterr().out
    assert re.search(r"MLP\W+untiled: each layer's MLP on all 32768 tokens at once", out)
    assert re.search(
        r"on a 24 GiB card, MLP\W+use tile_mlps\(model, 4096\) / CausalLMFineTune\(mlp_tile_tokens=4096\): nothing"
        r" untiled fits",
        out,
    )
    main(["plan", str(tmp_path), "--seq-len", "32768", "--mlp-tile-tokens", "4096"])
    assert re.search(r"MLP\W+tiled: each layer's MLP on 4096 tokens at a time", capsys.readouterr().out)
    # A budget too small with the chunked loss points at the tiled MLP next; with both given, at neither.
    with pytest.raises(SystemExit, match=r"Or plan for tiled MLPs \(--mlp-tile-tokens 4096\)"):
        main(["plan", str(tmp_path), "--seq-len", "32768", "--loss-chunk-tokens", "1024", "--vram-budget", "4GiB"])
    with pytest.raises(SystemExit, match=r"tokens per micro-batch\.$"):
        main(["plan", str(tmp_path), "--seq-len", "32768", "--loss-chunk-tokens", "1024", "--mlp-tile-tokens", "4096",
              "--vram-budget", "4GiB"])  # fmt: skip


#: Long-context peaks measured on the H100 (benchmarks/RESULTS.md "Long context"): shape, tokens, offload, loss
#: chunk, MLP tile, peak allocated bytes.
LONG_CONTEXT_PEAKS = [
    ("7b", 16384, False, None, None, 35.43e9),
    ("7b", 16384, True, 1024, None, 7.34e9),
    ("7b", 16384, True, 1024, 4096, 4.67e9),
    ("32b", 8192, False, None, None, 24.48e9),
    ("32b", 8192, True, 1024, None, 8.28e9),
    ("32b", 8192, True, 1024, 4096, 7.03e9),
    ("72b", 16384, True, 1024, None, 16.39e9),
    ("72b", 16384, True, 1024, 4096, 12.99e9),
    ("72b", 32768, True, 1024, 4096, 18.72e9),
]


@pytest.mark.parametrize(("shape", "tokens", "offload", "chunk", "tile", "measured"), LONG_CONTEXT_PEAKS)
def test_long_context_prediction_is_never_under_the_measured_peak(
    shape: str, tokens: int, offload: bool, chunk: int | None, tile: int | None, measured: float
) -> None:
    config = _qwen25_72b() if shape == "72b" else _qwen25(shape)
    sizes = model_sizes(config, dtype=torch.bfloat16, lora_rank=16)
    predicted = sizes.residency(tokens, offload_inputs=offload, kernels=StepKernels(chunk, tile))
    over = (predicted.predicted_peak - measured) / measured
    # Within 10%, tiled or not, and never under (every measured point: tests/planning/test_calibration.py).
    assert 0 <= over < 0.10, f"{shape} at {tokens}: {over:+.1%}"


@pytest.fixture(scope="module")
def bf16_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """bf16 checkpoints of a tiny Llama and a tiny Qwen3-MoE (fused 3-D experts that bitsandbytes leaves dense)."""
    root = tmp_path_factory.mktemp("plan_dense")
    paths = {}
    for name, config in (("llama", CONFIGS["llama"]()), ("qwen3_moe", moe_config())):
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(root / name)
        paths[name] = root / name
    return paths


@pytest.mark.parametrize(
    ("model_type", "quantize"), [("llama", False), ("qwen3_moe", False), ("qwen3_moe", True)],
    ids=["llama-dense", "qwen3_moe-dense", "qwen3_moe-mixed"],
)  # fmt: skip
def test_dense_and_mixed_sizes_equal_the_arena_load_blockwise_fills(
    bf16_checkpoints: dict[str, Path], model_type: str, quantize: bool
) -> None:
    """Sizes from the config alone, from the real per-tensor dtypes, equal the slabs `load_blockwise` packs."""
    config = transformers.AutoConfig.from_pretrained(bf16_checkpoints[model_type])
    sizes = model_sizes(config, dtype=torch.bfloat16, lora_rank=4, quantize=quantize)
    for block_size in (1, 3):
        model = load_blockwise(
            bf16_checkpoints[model_type], device="cpu", block_size=block_size, progress=False, share=False,
            quantize=quantize,
        )  # fmt: skip
        assert sizes.block_bytes(block_size) == [layout.nbytes for layout in host_copy_of(model).layouts]
    model.requires_grad_(False)
    assert sizes.device_bytes == _frozen_device_bytes(find_decoder_stack(model))
    # Control: the other base of the same config has other sizes; dense blocks are the larger.
    other = model_sizes(config, dtype=torch.bfloat16, lora_rank=4, quantize=not quantize)
    dense, nf4 = (sizes, other) if not quantize else (other, sizes)
    assert all(d > n for d, n in zip(dense.block_bytes(1), nf4.block_bytes(1), strict=True))


def test_plan_dense_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --dense` mirrors `load_blockwise(quantize=False)`: every tensor in --dtype, said in JSON and table."""
    _tiny_llama().save_pretrained(tmp_path)
    main(["plan", str(tmp_path), "--dense", "--dtype", "bfloat16", "--json"])
    report = json.loads(capsys.readouterr().out)
    dense = model_sizes(_load(tmp_path), dtype=torch.bfloat16, quantize=False)
    assert report["base"] == "dense" and report["block_bytes"] == dense.block_bytes(1)
    main(["plan", str(tmp_path), "--dtype", "bfloat16", "--json"])
    nf4 = json.loads(capsys.readouterr().out)
    assert nf4["base"] == "nf4" and nf4["host_arena_bytes"] < report["host_arena_bytes"]
    # The head and the norms are dense in both; NF4 adds the code tables each of the 4 x 7 linears keeps on the device.
    assert nf4["device_frozen_bytes"] - report["device_frozen_bytes"] == 4 * 7 * (16 + 256) * 4
    main(["plan", str(tmp_path), "--dense"])
    assert "dense, every tensor unquantized" in capsys.readouterr().out


def test_plan_for_block_major_accumulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--block-major G`: G micro-batches' layer inputs saved at once, and G more cuBLAS workspaces (its workers)."""
    _tiny_llama().save_pretrained(tmp_path)
    common = ["--seq-len", "12", "--lora-rank", "4", "--dtype", "float32", "--json"]
    main(["plan", str(tmp_path), *common])
    plain = json.loads(capsys.readouterr().out)
    main(["plan", str(tmp_path), *common, "--block-major", "4"])
    windowed = json.loads(capsys.readouterr().out)
    extra = (
        StepShape(12, 32, 64, 96, 4, activation_bytes=4, window=4).activation_peak()
        - StepShape(12, 32, 64, 96, 4, activation_bytes=4).activation_peak()
    )
    # 3 more micro-batches' inputs of 4 layers, and their decoder outputs and gradients, 12 x 32 fp32 each.
    assert extra >= (3 * 4 + 2 * 3) * 12 * 32 * 4
    assert windowed["block_major"] == 4 and plain["block_major"] is None
    assert windowed["predicted_peak_bytes"] == plain["predicted_peak_bytes"] + extra + 4 * 32 * 2**20
    with pytest.raises(SystemExit, match="--block-major"):
        main(["plan", str(tmp_path), *common, "--block-major", "4", "--offload-activations", "on"])


def test_plan_for_several_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--devices N`: VRAM per GPU (plus DDP's gradient buckets), host RAM the machine's: one arena for all ranks."""
    dims, _ = QWEN25["7b"]
    config = transformers.Qwen2Config(vocab_size=152064, tie_word_embeddings=False, **dims)
    one, two = (
        plan_report(config, tokens=16384, offload_activations=True, loss_chunk_tokens=1024, devices=devices)
        for devices in (1, 2)
    )
    assert two["host_arena_bytes"] == one["host_arena_bytes"] > 0, "one host copy per machine"
    assert two["offload_host_bytes"] == 2 * one["offload_host_bytes"] > 0, "each rank offloads its own inputs"
    assert two["host_embedding_bytes"] == 2 * one["host_embedding_bytes"] > 0
    assert two["host_pinned_bytes"] == two["host_arena_bytes"] + two["offload_host_bytes"]
    assert one["ddp_bucket_bytes"] == 0 and two["ddp_bucket_bytes"] == two["adapter_bytes"] > 0
    # Every block streams without a budget: the GPU's peak grows by the buckets alone.
    assert two["predicted_peak_bytes"] - one["predicted_peak_bytes"] == two["adapter_bytes"]
    config.save_pretrained(tmp_path)
    main(["plan", str(tmp_path), "--seq-len", "2048", "--devices", "2"])
    out = capsys.readouterr().out
    assert "2 GPUs, one data-parallel rank each" in out and "DDP gradient buckets (per GPU)" in out
    with pytest.raises(SystemExit):
        main(["plan", str(tmp_path), "--devices", "0"])


def test_masked_attention_is_planned_for_and_refused_where_it_cannot_be(capsys: pytest.CaptureFixture[str]) -> None:
    """`--masked-attention` (padded or packed rows): the mask and the repeated keys and values counted, as the
    strategy counts them from its first masked batch (NOTE [ Masked attention ] in planning/step_shape.py)."""
    # The chunked loss, so that a layer's working set, not the logits, is the step's peak.
    args = ["plan", "--shape", "7b", "--seq-len", "4096", "--batch-size", "2", "--kernels", "liger", "--json",
            "--loss-chunk-tokens", "1024"]  # fmt: skip
    main([*args, "--vram-budget", "22GiB", "--gpu-memory", "24GiB"])
    causal = json.loads(capsys.readouterr().out)
    main([*args, "--vram-budget", "22GiB", "--gpu-memory", "24GiB", "--masked-attention"])
    masked = json.loads(capsys.readouterr().out)
    assert (causal["masked_row"], masked["masked_row"]) == (None, 4096)
    # Every block streamed: the recomputed layer's share and the boolean mask, exactly; the recommendation too.
    shape = StepShape.for_config(
        transformers.Qwen2Config(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 intermediate_size=18944), tokens=8192, num_layers=28, masked_row=4096,
        kernels=StepKernels(loss_chunk_tokens=1024, fused_norm=True, fused_mlp=True),
    )  # fmt: skip
    boolean = 8192 * 4096
    more = masked["minimum_bytes"] - causal["minimum_bytes"]
    assert more == pytest.approx((shape.masked_attention_bytes() + boolean) * 1.02 * 1.1, rel=0.01)
    assert masked["recommendation"]["minimum_bytes"] > causal["recommendation"]["minimum_bytes"]
    # Refused: one long unpadded row per length (--longest), and tiled attention, which runs causal rows only.
    with pytest.raises(SystemExit, match="--longest plans one row of each length without padding"):
        main(["plan", "--shape", "7b", "--longest", "--card", "24GB", "--masked-attention"])
    with pytest.raises(SystemExit, match="--masked-attention with --attention-tile-tokens"):
        main([*args, "--masked-attention", "--attention-tile-tokens", "1024"])
    # Control: tiled attention alone is planned.
    main([*args, "--attention-tile-tokens", "1024"])
    assert json.loads(capsys.readouterr().out)["attention_tile_tokens"] == 1024
