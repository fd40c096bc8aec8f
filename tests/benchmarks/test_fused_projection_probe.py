"""`benchmarks/fused_projection_probe.py` on the CPU: one dequantization of a group's packed NF4 bytes is the
projections' own dequantizations, bit for bit, when each absmax is dequantized with its own nested statistics."""

from __future__ import annotations

import json

import pytest
import torch
from bitsandbytes.functional import QuantState, dequantize_4bit

from benchmarks import fused_projection_probe as probe


def test_one_dequantization_of_the_group_is_the_projections_bits() -> None:
    group = [probe.quantized(size, 64, torch.device("cpu")) for size in (64, 16, 16)]
    separate = torch.cat([dequantize_4bit(p, s) for p, s in group])
    assert torch.equal(probe.fused_dequantize(group), separate)
    # Control: the nested statistics concatenated as they are (the first projection's offset and second-level
    # state for all) dequantize other weights: each projection's offset is its own.
    first = group[0][1]
    naive = QuantState(
        absmax=torch.cat([s.absmax for _, s in group]), shape=separate.shape, code=first.code,
        blocksize=first.blocksize, quant_type="nf4", dtype=first.dtype, offset=first.offset, state2=first.state2,
    )  # fmt: skip
    packed = torch.cat([p.reshape(-1) for p, _ in group]).reshape(-1, 1)
    assert not torch.equal(dequantize_4bit(packed, naive), separate)


def test_the_probe_runs_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    probe.main(["--shape", "tiny", "--tokens", "32", "--repeats", "1", "--device", "cpu"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["group"] for row in rows] == ["qkv", "gate_up"] and all(row["dequant_equal"] for row in rows)
