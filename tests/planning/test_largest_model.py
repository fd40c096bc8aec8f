"""The 405B plan (issue 46 item 6): ``plan --shape 405b --devices 8`` against the arithmetic done by hand here.

Every expected number is computed in this file from the published Llama-3.1-405B sizes, not by the planner's
functions: bitsandbytes' NF4 layout (4 bits a weight, one uint8 absmax per 64, one float32 per 256 absmax and an
offset with double quantization), LoRA's ``r x (in + out)`` float32 per linear, the forward + recompute streaming
and NOTE [ Expected step time ]'s FLOPs. docs/several-gpus.md quotes the same numbers.
"""

from __future__ import annotations

import pytest

from lightning_blockwise.cli.plan_command import plan
from lightning_blockwise.planning.shapes import shape_config

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB = 16384, 53248, 126, 128, 8, 128256
KV = KV_HEADS * HIDDEN // HEADS  # 1024: k_proj's and v_proj's outputs
#: (out_features, in_features) of a decoder layer's seven linears.
LINEARS = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN)] + [(INTERMEDIATE, HIDDEN)] * 2
LINEARS += [(HIDDEN, INTERMEDIATE)]
TOKENS, DEVICES, TFLOPS, LINK_GBPS, RANK = 4096, 8, 450.0, 54.0, 16
#: The host of the 8-GPU kind (560 GB) and the arena's reserve (residency/arena.py's HOST_RAM_RESERVE).
HOST_RAM, RESERVE = 560e9, 2 * 2**30


def _nf4(numel: int) -> int:
    """One NF4 weight with double quantization: packed nibbles, uint8 absmax, the float32 offset and nested absmax."""
    blocks = -(-numel // 64)
    return -(-numel // 2) + blocks + 4 + 4 * -(-blocks // 256)


def _plan(shape: str, capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    args = ["--shape", shape, "--seq-len", str(TOKENS), "--devices", str(DEVICES), "--kernels", "none"]
    report = plan([*args, "--tflops", str(TFLOPS), "--link-gbps", str(LINK_GBPS), "--json", *extra])
    capsys.readouterr()
    return report


def test_the_shape_is_the_published_config() -> None:
    config = shape_config("405b")
    assert type(config).__name__ == "LlamaConfig" and config.tie_word_embeddings is False
    sizes = (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads)
    assert (*sizes, config.num_key_value_heads, config.vocab_size) == (HIDDEN, INTERMEDIATE, LAYERS, HEADS, 8, VOCAB)
    assert config.rope_parameters["rope_theta"] == 500000.0 and config.rope_parameters["rope_type"] == "llama3"
    assert (
        config.head_dim == 128
        and config.rms_norm_eps == 1e-5
        and (config.bos_token_id, config.eos_token_id) == (128000, 128001)
    )
    assert type(shape_config("72b")).__name__ == "Qwen2Config"  # control: the other shapes keep their family


def test_405b_on_one_node_of_eight_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    report = _plan("405b", capsys)
    # The arena: 126 layers of seven NF4 linears and two bf16 norms; each block's slab is its tensors' bytes plus
    # their alignment (30 tensors; at most a few KB).
    layer = sum(_nf4(out * inp) for out, inp in LINEARS) + 2 * HIDDEN * 2
    assert layer == 1_644_486_684  # 1.64 GB, 13.05 bytes per 100 weights of 4 bits
    assert all(0 <= block - layer <= 4096 for block in report["block_bytes"]) and len(report["block_bytes"]) == LAYERS
    assert 0 <= report["host_arena_bytes"] - LAYERS * layer <= LAYERS * 4096
    assert round(report["host_arena_bytes"] / 1e9, 1) == 207.2
    # The embedding table stays on the host in bf16, one per rank; the untied head and the last norm go on the GPU.
    assert report["host_embedding_bytes"] == DEVICES * VOCAB * HIDDEN * 2
    # On each GPU: the head, the last norm, every NF4 linear's fp32 code tables (16 + 256 entries) and RoPE's two
    # fp32 frequency buffers (64 entries each).
    frozen = VOCAB * HIDDEN * 2 + HIDDEN * 2 + LAYERS * len(LINEARS) * (16 + 256) * 4 + 2 * 64 * 4
    assert report["device_frozen_bytes"] == frozen and round(frozen / 1e9, 2) == 4.20
    # LoRA r=16 on the seven projections, float32: 2.49 GB of adapters, the same again in DDP's buckets.
    adapters = LAYERS * sum(RANK * (out + inp) for out, inp in LINEARS) * 4
    assert report["adapter_bytes"] == adapters == report["ddp_bucket_bytes"]
    # Traffic: every block crosses each GPU's link twice a micro-batch; the ring all-reduce 2 x 7/8 of the adapters.
    assert report["streamed_bytes_per_gpu"] == 2 * report["host_arena_bytes"]
    assert report["streamed_bytes_per_node"] == DEVICES * 2 * report["host_arena_bytes"]
    assert report["allreduce_bytes_per_gpu"] == int(2 * 7 / 8 * adapters)
    # Time: 6 x matmul weights x tokens (two forwards, one input-gradient pass) + 9 x tokens^2 x width x layers.
    weights = LAYERS * sum(out * inp for out, inp in LINEARS) + VOCAB * HIDDEN
    flops = 6 * weights * TOKENS + 9 * TOKENS**2 * HIDDEN * LAYERS
    assert report["step_flops"] == pytest.approx(flops, rel=1e-12)
    compute, link = flops / (TFLOPS * 1e12), 2 * report["host_arena_bytes"] / (LINK_GBPS * 1e9)
    assert report["bound"] == "compute" and report["step_seconds"] == pytest.approx(compute) and link < compute
    assert report["tokens_per_second"] == pytest.approx(DEVICES * TOKENS / compute)
    assert round(report["tokens_per_second"]) == 1441 and round(compute, 1) == 22.7


def test_405b_host_ram_with_every_rank_offloading(capsys: pytest.CaptureFixture[str]) -> None:
    """560 GB holds the arena, 8 ranks' offloaded layer inputs at 4k and 8 embedding tables."""
    report = _plan("405b", capsys, "--offload-activations", "on")
    inputs = DEVICES * LAYERS * TOKENS * HIDDEN * 2  # each layer's bf16 input, per rank
    assert report["offload_host_bytes"] == inputs and round(inputs / 1e9, 1) == 135.3
    assert report["host_pinned_bytes"] == report["host_arena_bytes"] + inputs
    total = report["host_pinned_bytes"] + report["host_embedding_bytes"] + RESERVE
    assert round(total / 1e9) == 378 and total < HOST_RAM
    # Where it stops: each token more per rank pins 8 x 126 layers x 32 KB; about 10k tokens fill the host.
    per_token = DEVICES * LAYERS * HIDDEN * 2
    assert 9_000 < (HOST_RAM - total) // per_token + TOKENS < 10_500


def test_another_shape_gives_other_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    """Control: the 72B plan at the same settings, so the 405B numbers above are the shape's, not constants."""
    big, other = _plan("405b", capsys), _plan("72b", capsys)
    for key in ("host_arena_bytes", "adapter_bytes", "streamed_bytes_per_gpu", "step_flops", "tokens_per_second"):
        assert other[key] != big[key], key
    assert other["tokens_per_second"] > 5 * big["tokens_per_second"]
    assert round(other["host_arena_bytes"] / 1e9, 1) == 36.2  # docs/several-gpus.md's 72B arena
