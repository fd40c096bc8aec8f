"""The README and the docs/ pages: the set-up commands CI runs, links that resolve, the tested-versions table.

Text only: nothing is imported from the package, nothing is run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tests.helpers.readme import ROOT, readme_commands

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, ROOT / "CHANGELOG.md", *DOCS]

#: The README's two set-up commands, in this order; `.ci/run` runs each of them.
SETUP_COMMANDS = ["lightning-blockwise fit --config configs/demo.yaml", "python3 -m pytest -q"]

_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines of a Markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors: set[str] = set()
    for line in _prose(page.read_text()):
        match = re.match(r"^#{1,6} (.+)$", line)
        if match:
            slug = _slug(match.group(1))
            count = 0
            while (slug if count == 0 else f"{slug}-{count}") in anchors:
                count += 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a Markdown text."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README.md has no section '## {heading}'"
    return match.group(1)


def test_readme_quick_start_holds_the_two_setup_commands_in_one_block() -> None:
    body = _section(README.read_text(), "Quick start: the two set-up commands")
    blocks = re.findall(r"^```bash\n(.*?)^```", body, flags=re.M | re.S)
    assert len(blocks) == 1, "the quick start has one bash block"
    commands = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines()]
    assert [command for command in commands if command] == SETUP_COMMANDS


def test_ci_runs_the_readme_setup_commands() -> None:
    """`.ci/run` runs the README's own install and set-up blocks (tools/readme_commands.py), not copies of them."""
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for block in ("install", "setup"):
        assert f"done < <(python3 tools/readme_commands.py {block})" in ci_lines, f".ci/run does not run {block}"
    # Control: what the tool reads for `setup` is the block this file checks above.
    assert readme_commands.commands(README.read_text(), readme_commands.SECTIONS["setup"]) == SETUP_COMMANDS


def test_slug_follows_github_anchors() -> None:
    assert _slug("Planning a run: `lightning-blockwise plan`") == "planning-a-run-lightning-blockwise-plan"
    assert _slug("Dense (unquantized) bases and mixed MoE bases") == "dense-unquantized-bases-and-mixed-moe-bases"
    assert _slug("One host copy per machine, and concurrent jobs") == "one-host-copy-per-machine-and-concurrent-jobs"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for line in _prose(page.read_text()):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{target}: no file {linked}")
            elif anchor and (linked.suffix != ".md" or anchor not in _anchors(linked)):
                broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_the_control_catches_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Real heading\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#real-heading) [bad](a.md#no-such-heading)\n")
    with pytest.raises(AssertionError, match="no-such-heading"):
        test_relative_links_resolve_to_a_file_and_heading(page)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    targets = {target.partition("#")[0] for line in _prose(README.read_text()) for target in _LINK.findall(line)}
    missing = [page.name for page in DOCS if f"docs/{page.name}" not in targets]
    assert not missing, f"docs pages a README reader cannot find: {missing}"


@pytest.mark.parametrize("page", DOCS, ids=lambda page: page.name)
def test_docs_page_starts_with_what_the_user_does(page: Path) -> None:
    paragraphs = [part.strip() for part in page.read_text().split("\n\n") if part.strip()]
    assert paragraphs[0].startswith("# "), f"{page.name} opens with its title"
    assert paragraphs[1].startswith("**What you do:**"), f"{page.name}: the first paragraph says what a user does"


def test_readme_tested_versions_table_matches_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = {Requirement(dependency).name: Requirement(dependency).specifier for dependency in dependencies}
    rows = re.findall(r"^\| ([a-z]+) \| `([^`]+)` \|", _section(README.read_text(), "Install"), flags=re.M)
    assert {name for name, _ in rows} >= {"torch", "transformers", "peft", "bitsandbytes", "lightning"}
    for name, tested in rows:
        assert SpecifierSet(tested) == bounds[name], f"README says {name} {tested}, pyproject {bounds[name]}"
