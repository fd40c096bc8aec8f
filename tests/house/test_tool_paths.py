"""The test paths CI's scripts name (``.ci/run``, ``tools/``) exist: a test file moved without them would make a CI
phase run nothing (the floor pass once named ``tests/test_parity.py`` after it had moved to ``tests/strategy/``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: A path under tests/ as a script names it: a file or a folder.
_PATH = re.compile(r"(?<![\w/.-])(tests/[\w/.-]*\w)")


def _missing(texts: dict[str, str]) -> list[str]:
    return [
        f"{where}: {path}"
        for where, text in texts.items()
        for path in _PATH.findall(text)
        if not (ROOT / path).exists()
    ]


def test_every_test_path_ci_names_exists() -> None:
    scripts = [ROOT / ".ci" / "run", *sorted(path for path in (ROOT / "tools").iterdir() if path.is_file())]
    texts = {path.relative_to(ROOT).as_posix(): path.read_text() for path in scripts}
    assert any(_PATH.search(text) for text in texts.values())
    assert _missing(texts) == []


def test_a_moved_test_file_is_found() -> None:
    """Control: the path the floor pass named before the move is reported."""
    assert _missing({"tools/dependency-pass": "pytest tests/test_parity.py tests/replay"}) == [
        "tools/dependency-pass: tests/test_parity.py"
    ]
