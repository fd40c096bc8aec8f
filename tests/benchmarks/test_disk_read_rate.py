"""`benchmarks/disk_read_rate.py`: its O_DIRECT readers read every byte once, and stop at their budget (CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.disk_read_rate import _implied, direct_read_rate, largest_files, write_probe

_CHUNK = 64 * 1024


@pytest.fixture
def odd_file(tmp_path: Path) -> Path:
    # Not a multiple of the chunk, nor of a page: the last read is short.
    path = tmp_path / "probe"
    path.write_bytes(os.urandom(5 * _CHUNK + 1234))
    return path


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_every_byte_is_read_once(odd_file: Path, threads: int) -> None:
    moved, seconds = direct_read_rate(odd_file, _CHUNK, threads)
    assert moved == odd_file.stat().st_size and seconds > 0


def test_control_a_spent_budget_reads_nothing(odd_file: Path) -> None:
    assert direct_read_rate(odd_file, _CHUNK, 2, budget_s=0.0)[0] == 0


def test_unaligned_chunk_is_refused(odd_file: Path) -> None:
    with pytest.raises(ValueError, match="chunk=1000 must be a positive multiple of 4096"):
        direct_read_rate(odd_file, 1000)


def test_probe_is_written_in_whole_chunks_within_its_budget(tmp_path: Path) -> None:
    assert (
        write_probe(tmp_path / "a", 4 * _CHUNK, _CHUNK, budget_s=60.0)[0]
        == 4 * _CHUNK
        == (tmp_path / "a").stat().st_size
    )
    assert write_probe(tmp_path / "b", 4 * _CHUNK, _CHUNK, budget_s=0.0)[0] == 0


def test_largest_files_first_until_the_limit(tmp_path: Path) -> None:
    for name, size in (("small", 10), ("big", 300), ("mid", 100)):
        (tmp_path / name).write_bytes(b"x" * size)
    assert [f.name for f in largest_files(tmp_path, 350)] == ["big", "mid"]
    assert [f.name for f in largest_files(tmp_path, 10**6, min_size=100)] == ["big", "mid"]


def test_block_major_divides_the_reads_per_micro_batch() -> None:
    # 64 GB at 2 GB/s: 32 s for the forward's reads and 32 s for the backward's, per micro-batch or per 4.
    assert _implied(64.0, 2e9, 4) == {"plain": 64.0, "block_major_4": 16.0}
