"""Requirement sets derived from pyproject.toml's tested ranges, for CI and `tools/newest-deps` (Python 3.11+).

Usage::

    python3 tools/deps.py floor [--except NAME ...]  # `name==floor` per run-time dependency (the floor pass)
    python3 tools/deps.py newest                      # one name per dependency (newest, upper bounds ignored)
    python3 tools/deps.py spec NAME                   # NAME's requirement as pyproject.toml declares it
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def requirements(with_test: bool = True) -> list[Requirement]:
    """The run-time dependencies (and the test extra's) as parsed requirements."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = list(project["dependencies"])
    if with_test:
        lines += project["optional-dependencies"]["test"]
    return [Requirement(line) for line in lines]


def floor(requirement: Requirement) -> str:
    """``name==X`` for the requirement's ``>=X`` floor."""
    floors = [s.version for s in requirement.specifier if s.operator == ">="]
    if len(floors) != 1:
        raise SystemExit(f"tools/deps.py: {requirement} needs exactly one `>=` floor in pyproject.toml")
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}=={floors[0]}"


def main(argv: list[str]) -> None:
    """Print the requirement set the arguments name (see the module docstring)."""
    if argv[:1] == ["floor"] and all(a == "--except" for a in argv[1::2]):
        skip = set(argv[2::2])
        print("\n".join(floor(r) for r in requirements(with_test=False) if r.name not in skip))
    elif argv == ["newest"]:
        print("\n".join(floor(r).split("==")[0] for r in requirements()))
    elif len(argv) == 2 and argv[0] == "spec":
        (found,) = [r for r in requirements() if r.name == argv[1]] or [None]
        if found is None:
            raise SystemExit(f"tools/deps.py: pyproject.toml declares no {argv[1]!r}")
        print(found)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
