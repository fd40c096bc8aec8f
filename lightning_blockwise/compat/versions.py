"""The versions of its dependencies this package was tested with, read from its own metadata.

The tested range is stated once, in ``pyproject.toml``'s dependencies (a floor and an upper bound each);
the installed distribution's metadata carries it, so the run-time check and the README's table cannot
drift from what pip enforces. ``lightning-blockwise versions`` prints the table.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from importlib import metadata

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

DISTRIBUTION = "lightning-blockwise"


@dataclass(frozen=True)
class Dependency:
    """One dependency: the range it was tested in and what is installed."""

    name: str
    tested: str
    installed: str | None

    @property
    def in_range(self) -> bool:
        """Whether the installed version lies in the tested range (a local tag such as ``+cpu`` is ignored)."""
        if self.installed is None:
            return False
        try:
            version = Version(self.installed)
        except InvalidVersion:
            return False
        # A pre-release or a local build of a tested release (a container's `2.11.0a0+git...` torch, `+cpu`) counts
        # as that release: it is checked by its base version.
        return Requirement(f"{self.name}{self.tested}").specifier.contains(Version(version.base_version))


def dependencies(requirements: list[str] | None = None) -> list[Dependency]:
    """The package's run-time dependencies with their tested ranges and installed versions.

    Args:
        requirements: Requirement strings to read instead of the installed package's metadata (tests).

    Raises:
        RuntimeError: If the package is not installed, so its metadata (the tested ranges) cannot be read.
    """
    if requirements is None:
        try:
            requirements = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            raise RuntimeError(
                f"{DISTRIBUTION} is not installed, so the versions it was tested with cannot be read. Install it:"
                ' `pip install -e ".[test]"` from a checkout.'
            ) from None
    found = []
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement (test tools), not a run-time dependency
        try:
            installed: str | None = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            installed = None
        # Floor first: `>=5.17,<5.25` reads as a range.
        tested = ",".join(sorted((str(s) for s in requirement.specifier), key=lambda s: not s.startswith(">=")))
        found.append(Dependency(requirement.name, tested, installed))
    return found


def untested(requirements: list[str] | None = None) -> list[Dependency]:
    """The dependencies installed outside their tested range (see :func:`dependencies`)."""
    return [dependency for dependency in dependencies(requirements) if not dependency.in_range]


def untested_message(outside: list[Dependency]) -> str:
    """What to say about dependencies outside the tested range, and what to do; empty if there are none."""
    if not outside:
        return ""
    listed = ", ".join(f"{d.name} {d.installed or '(not installed)'} (tested: {d.tested})" for d in outside)
    pins = " ".join(f'"{d.name}{d.tested}"' for d in outside)
    return (
        f"{DISTRIBUTION} replays internals of its dependencies, and these are outside the versions it was tested"
        f" with: {listed}. Training may fail or differ from resident training without an error. Install the"
        f" tested versions (`pip install {pins}`), or check the run with the `ParityCheck` callback under"
        " `Trainer(deterministic=True)`."
    )


def warn_if_untested() -> None:
    """Warn once per process, on rank zero, about dependencies outside the tested range, with the fix."""
    # Here, not at the top: `lightning-blockwise versions` runs without Lightning (tests/cli/test_startup.py).
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    try:
        outside = untested()
    except RuntimeError as error:  # run from a source tree without an install: say so, do not guess
        rank_zero_warn(str(error))
        return
    if outside:
        rank_zero_warn(untested_message(outside))


def table() -> str:
    """A Markdown table of the dependencies: tested range and installed version."""
    rows = ["| package | tested range | installed |", "| --- | --- | --- |"]
    for d in dependencies():
        mark = "" if d.in_range else " (untested)"
        rows.append(f"| {d.name} | `{d.tested}` | {d.installed or 'not installed'}{mark} |")
    return "\n".join(rows)


VERSIONS_COMMAND = "versions"
_DESCRIPTION = "The tested range of each dependency (pyproject.toml) and the version installed here."


def versions_command(argv: list[str]) -> None:
    """``lightning-blockwise versions [--check]``: print the table; with ``--check``, exit 1 outside the range."""
    # argparse answers `--help` (exit 0) and a wrong argument (usage, exit 2) as the other commands do.
    parser = argparse.ArgumentParser(prog=f"lightning-blockwise {VERSIONS_COMMAND}", description=_DESCRIPTION)
    parser.add_argument("--check", action="store_true", help="Exit 1 where an installed version is outside its range.")
    check = parser.parse_args(argv).check
    print(table())
    outside = untested()
    if outside:
        print(untested_message(outside), file=sys.stderr)
        if check:
            raise SystemExit(1)
