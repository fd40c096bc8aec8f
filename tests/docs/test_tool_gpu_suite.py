"""``tools/gpu-suite`` names every file that holds a GPU test in one of its parts: one left out would never run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A GPU marker on a module (``pytestmark = pytest.mark.gpu``) or on a test (``@pytest.mark.gpu``).
_MARKED = re.compile(r"^(?:pytestmark = \[?\s*|@)pytest\.mark\.gpu\b", re.MULTILINE)


def _named_in_parts(script: str) -> set[str]:
    return set(re.findall(r"\b(tests/[\w/]+\.py)\b", script))


def _gpu_test_files() -> set[str]:
    files = (path for path in (ROOT / "tests").rglob("test_*.py") if _MARKED.search(path.read_text()))
    return {path.relative_to(ROOT).as_posix() for path in files}


def test_every_gpu_test_file_is_in_a_part() -> None:
    script = (ROOT / "tools" / "gpu-suite").read_text()
    files = _gpu_test_files()
    assert len(files) > 20
    assert files <= _named_in_parts(script), sorted(files - _named_in_parts(script))
    # Control: a file left out of the script is caught.
    left_out = script.replace("tests/replay/test_gpu_kept_attention.py", "")
    assert "tests/replay/test_gpu_kept_attention.py" not in _named_in_parts(left_out)


def test_gpu_tests_sit_beside_their_subject() -> None:
    """No folder of GPU tests: each is in the test folder of what it tests (``tests/<folder>/``), marked ``gpu``."""
    assert not (ROOT / "tests" / "gpu").exists()
    gpu_named = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tests").rglob("test_gpu_*.py")}
    assert gpu_named <= _gpu_test_files(), sorted(gpu_named - _gpu_test_files())  # named so, and marked
