"""The shell commands of one of the README's code blocks, one a line, for CI to run exactly as a reader would.

Usage::

    python3 tools/readme_commands.py install   # the block under "## Install"
    python3 tools/readme_commands.py setup     # the block under "## Quick start: the two set-up commands"

A command is a non-empty line of the first fenced ``bash`` block after the section's heading, with its trailing
``# comment`` removed. CI (``.ci/run``) runs these and nothing else to install and to test, so a README that lacks an
install step fails CI the way it would fail a new user (tests/test_docs.py checks that both blocks exist).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"

#: The section heading each block follows.
SECTIONS = {"install": "## Install", "setup": "## Quick start: the two set-up commands"}


def commands(text: str, heading: str) -> list[str]:
    """The commands of the first ``bash`` block after ``heading`` in the Markdown ``text``.

    Raises:
        ValueError: If the heading is missing, or no ``bash`` block follows it before the next heading of its level.
    """
    lines = text.splitlines()
    try:
        start = lines.index(heading)
    except ValueError:
        raise ValueError(f"the README has no heading {heading!r}") from None
    block: list[str] | None = None
    for line in lines[start + 1 :]:
        if block is None:
            if line.startswith("## "):
                break
            if line.strip() == "```bash":
                block = []
        elif line.strip() == "```":
            return [command for command in block if command]
        else:
            block.append(re.sub(r"\s+#.*$", "", line).strip())
    raise ValueError(f"no ```bash block under the README's {heading!r}")


def main(argv: list[str]) -> None:
    """Print the commands of the block ``argv`` names, one a line."""
    if len(argv) != 1 or argv[0] not in SECTIONS:
        raise SystemExit(__doc__)
    print("\n".join(commands(README.read_text(), SECTIONS[argv[0]])))


if __name__ == "__main__":
    main(sys.argv[1:])
