"""``tools/gpu-suite`` names every GPU test file in one of its parts: a file outside them would never run (CPU test)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _named_in_parts(script: str) -> set[str]:
    return set(re.findall(r"tests/gpu/(test_\w+\.py)", script)) | set(re.findall(r"\b(test_gpu_\w+\.py)\b", script))


def test_every_gpu_test_file_is_in_a_part() -> None:
    script = (ROOT / "tools" / "gpu-suite").read_text()
    files = {path.name for path in (ROOT / "tests" / "gpu").glob("test_gpu_*.py")}
    assert len(files) > 15
    assert files <= _named_in_parts(script), sorted(files - _named_in_parts(script))
    # Control: a file left out of the script is caught.
    assert "test_gpu_kept_attention.py" not in _named_in_parts(script.replace("test_gpu_kept_attention.py", ""))
