"""tools/readme_commands.py: CI's install and set-up commands are the README's own, as a reader would copy them."""

from __future__ import annotations

import pytest

from tests.helpers.readme import ROOT, readme_commands


def test_the_readme_has_both_blocks_ci_runs() -> None:
    text = (ROOT / "README.md").read_text()
    install = readme_commands.commands(text, readme_commands.SECTIONS["install"])
    setup = readme_commands.commands(text, readme_commands.SECTIONS["setup"])
    # torch first, alone: resolving the project's torch range would otherwise pull a CUDA build.
    assert install[0].startswith("pip install torch==") and install[1] == 'pip install -e ".[test]"'
    assert setup == ["lightning-blockwise fit --config configs/demo.yaml", "python3 -m pytest -q"]


def test_control_a_readme_without_the_block_is_refused() -> None:
    text = "## Install\n\nRun pip.\n\n## Next\n\n```bash\npip install x\n```\n"
    with pytest.raises(ValueError, match="no ```bash block under the README's '## Install'"):
        readme_commands.commands(text, "## Install")
    with pytest.raises(ValueError, match="no heading"):
        readme_commands.commands(text, "## Quick start: the two set-up commands")
    assert readme_commands.commands(text.replace("Run pip.", "```bash\npip a  # why\n\n```"), "## Install") == ["pip a"]


def test_script_sets_expands_and_splits_as_bash_does() -> None:
    lines = [
        "MODEL=/models/X",
        "RUN=out/version_0",
        'lightning-blockwise generate $MODEL --adapter ${RUN}/adapter --prompt "a b"',
    ]
    variables = {"MODEL": "/tmp/made up"}
    assert readme_commands.script(lines, variables) == [
        ["lightning-blockwise", "generate", "/tmp/made up", "--adapter", "out/version_0/adapter", "--prompt", "a b"]
    ]
    assert variables["RUN"] == "out/version_0"  # carried over to the section's next block
    # Control: a variable no line sets is refused, not expanded to nothing as bash would.
    with pytest.raises(ValueError, match=r"uses \$DATA, which no line before it sets"):
        readme_commands.script(["lightning-blockwise fit --data.init_args.path=$DATA"], {})


def test_blocks_reads_every_block_of_a_section_and_no_further() -> None:
    text = "## A\n\n```bash\none\n```\n\ntext\n\n```bash\ntwo  # why\n```\n\n## B\n\n```bash\nthree\n```\n"
    assert readme_commands.blocks(text, "## A") == [["one"], ["two"]]
    assert readme_commands.commands(text, "## A") == ["one"]
