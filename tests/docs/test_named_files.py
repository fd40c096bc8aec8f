"""The files the README and docs/ name, and the README's option table, against the repository (issue 43 item 11).

- A path with a folder in a code span (``recipes/finetune.py``): a file of the repository or the package.
- The README's option table of ``BlockwiseStrategy``: every option of its own, with the signature's default, and
  nothing else.

Each check has a control. Commands, options and keyword arguments: tests/docs/test_named_options.py.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


#: The arguments `BlockwiseStrategy` takes for Lightning's strategies (the device, the cluster, DDP's), not its own.
_LIGHTNING_STRATEGY_ARGUMENTS = {
    "accelerator", "device", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "ddp_kwargs",
}  # fmt: skip


def option_table_problems(text: str) -> list[str]:
    """Where the README's option table of ``BlockwiseStrategy`` misses an option, names another, or gives a default
    the signature does not have."""
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| `([^`]+)` \|", text, flags=re.M))
    parameters = inspect.signature(BlockwiseStrategy).parameters
    own = [name for name in parameters if name not in _LIGHTNING_STRATEGY_ARGUMENTS]
    found = [f"`{name}` is missing from the table" for name in own if name not in rows]
    for name, default in rows.items():
        if name not in parameters:
            found.append(f"`{name}` is no argument of BlockwiseStrategy")
            continue
        actual = parameters[name].default
        written = f'"{actual}"' if isinstance(actual, str) else repr(actual)
        if default != written:
            found.append(f"`{name}` defaults to `{written}`, the table says `{default}`")
    return found


def test_the_readme_option_table_is_the_strategy_signature() -> None:
    """Every option of `BlockwiseStrategy` is in the README's table, with its default, and nothing else is."""
    assert option_table_problems((ROOT / "README.md").read_text()) == []
    # Control: a made-up row, a wrong default and a missing row are each found.
    table = "| `block_size` | `2` |\n| `blok_size` | `1` |\n"
    wrong = option_table_problems(table)
    assert "`block_size` defaults to `1`, the table says `2`" in wrong
    assert "`blok_size` is no argument of BlockwiseStrategy" in wrong
    assert "`prefetch_depth` is missing from the table" in wrong


_PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]+\.(?:py|yaml|jsonl|json|md))`")


def missing_paths(page: Path) -> list[str]:
    """Paths with a folder in ``page``'s code spans (``recipes/finetune.py``) that name no file of the repository
    or the package."""
    found = []
    for number, line in enumerate(page.read_text().splitlines(), 1):
        for path in _PATH.findall(line):
            if not any((base / path).exists() for base in (ROOT, ROOT / "lightning_blockwise", page.parent)):
                found.append(f"{page.name}:{number}: `{path}` is no file")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_file_a_page_names_exists(page: Path) -> None:
    wrong = missing_paths(page)
    assert not wrong, "\n".join(wrong)


def test_control_a_moved_file_is_found(tmp_path: Path) -> None:
    page = tmp_path / "moved.md"
    page.write_text("See `recipes/finetune.py` and `configs/demo.yaml`, not `recipes/finetuning.py`.\n")
    assert missing_paths(page) == ["moved.md:1: `recipes/finetuning.py` is no file"]
