"""The shell commands of one of the README's code blocks, one a line, for CI to run exactly as a reader would.

Usage::

    python3 tools/readme_commands.py install      # the block under "## Install"
    python3 tools/readme_commands.py setup        # the block under "## Quick start: the two set-up commands"
    python3 tools/readme_commands.py after-demo   # the block under "## After the demo: its adapter and its base"
    python3 tools/readme_commands.py own-model    # the first block under "## Your own model, your own data"

A command is a non-empty line of the first fenced ``bash`` block after the section's heading, with its trailing
``# comment`` removed. CI (``.ci/run``) runs the install and set-up commands and nothing else to install and to
test, so a README that lacks an install step fails CI the way it would fail a new user (tests/docs/test_docs.py checks
that both blocks exist). The other blocks are run by tests, through :func:`script`: tests/demos/test_after_demo.py
and tests/docs/test_own_model.py.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

#: The section heading each block follows.
SECTIONS = {
    "install": "## Install",
    "setup": "## Quick start: the two set-up commands",
    "after-demo": "## After the demo: its adapter and its base",
    "own-model": "## Your own model, your own data",
}

#: A line that sets a shell variable: ``NAME=value``.
_ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)=(\S+)$")
#: A variable's use: ``$NAME`` or ``${NAME}``.
_EXPANSION = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def blocks(text: str, heading: str) -> list[list[str]]:
    """The commands of every ``bash`` block of the section under ``heading`` (up to the next ``## `` heading).

    Raises:
        ValueError: If the heading is missing, or the section holds no ``bash`` block.
    """
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        raise ValueError(f"the README has no heading {heading!r}") from None
    found: list[list[str]] = []
    block: list[str] | None = None
    for line in lines[start + 1 :]:
        if block is None:
            if line.startswith("## "):
                break
            if line.strip() == "```bash":
                block = []
        elif line.strip() == "```":
            found.append([command for command in block if command])
            block = None
        else:
            block.append(re.sub(r"\s+#.*$", "", line).strip())
    if not found:
        raise ValueError(f"no ```bash block under the README's {heading!r}")
    return found


def commands(text: str, heading: str) -> list[str]:
    """The commands of the first ``bash`` block after ``heading`` in the Markdown ``text``.

    Raises:
        ValueError: If the heading is missing, or no ``bash`` block follows it before the next heading of its level.
    """
    return blocks(text, heading)[0]


def script(lines: list[str], variables: dict[str, str]) -> list[list[str]]:
    """The argument lists bash would run for ``lines``: variables set and expanded, words split, quotes removed.

    Only what the README's blocks use is understood: ``NAME=value`` lines, ``$NAME`` / ``${NAME}``, and quoting.

    Args:
        lines: A block's commands (:func:`commands`), carried over from block to block by passing the same
            ``variables``.
        variables: Values that win over the block's own ``NAME=value`` (a test's paths in place of
            ``/models/...``); the block's assignments are added to it.

    Raises:
        ValueError: If a line uses a variable that no line before it (nor ``variables``) sets.
    """
    given = dict(variables)
    argvs = []
    for line in lines:
        assignment = _ASSIGNMENT.match(line)
        if assignment:
            name, value = assignment.groups()
            variables[name] = given.get(name, value)
            continue
        unset = [name for pair in _EXPANSION.findall(line) for name in pair if name and name not in variables]
        if unset:
            raise ValueError(f"`{line}` uses ${unset[0]}, which no line before it sets")
        # Unquoted uses only (the README's): each value stays one word, as bash keeps a path without spaces.
        expanded = _EXPANSION.sub(lambda match: shlex.quote(variables[match.group(1) or match.group(2)]), line)
        argvs.append(shlex.split(expanded))
    return argvs


def main(argv: list[str]) -> None:
    """Print the commands of the block ``argv`` names, one a line."""
    if len(argv) != 1 or argv[0] not in SECTIONS:
        raise SystemExit(__doc__)
    print("\n".join(commands(README.read_text(), SECTIONS[argv[0]])))


if __name__ == "__main__":
    main(sys.argv[1:])
