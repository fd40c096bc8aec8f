"""The house rules as tests: modules short enough to hold in one's head, NOTE references that resolve, public names
documented (issue 45; ../shared/STYLE.md). The layer order of the folders is tests/house/test_package_layout.py's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_blockwise

PACKAGE = Path(lightning_blockwise.__file__).parent
ROOT = PACKAGE.parent
#: The most lines a module of the package may have.
MAX_LINES = 330
#: A NOTE block's definition: a comment line naming it (``# NOTE [ Name ]``, optionally ``: ...`` after it).
_DEFINITION = re.compile(r"^\s*# NOTE \[ (.+?) \](?::.*)?$", re.MULTILINE)
#: A mention, possibly wrapped over comment or docstring lines, with the file it names where it names one.
_MENTION = re.compile(r"NOTE\s+\[\s+((?:[^\]\n]|\n\s*#?\s*)+?)\s+\](?:\s*,?\s+in\s+`?([\w./]+\.py))?")


#: Modules over the limit that a named step of a refactoring takes under it, with their size when it was written: none
#: may grow, and an entry goes once its module is under the limit. Empty since the composed strategy (issue 45).
WAITING: dict[str, int] = {}


def _over_long(paths: list[Path], waiting: dict[str, int]) -> list[str]:
    """Modules over :data:`MAX_LINES` not waiting for their step, waiting ones that grew, and waits that ended."""
    wrong = []
    for path in paths:
        where, lines = path.relative_to(ROOT).as_posix(), len(path.read_text().splitlines())
        if where in waiting:
            if lines > waiting[where] or lines <= MAX_LINES:
                wrong.append(f"{where}: {lines} lines, waiting at {waiting[where]} (update WAITING)")
        elif lines > MAX_LINES:
            wrong.append(f"{where}: {lines} lines")
    return wrong


def test_no_module_is_over_330_lines() -> None:
    assert _over_long(sorted(PACKAGE.rglob("*.py")), WAITING) == []


def test_an_over_long_module_is_found() -> None:
    """Control: a long module is found, and so are a waiting one that grew and one that no longer needs to wait."""
    long = ROOT / "tests" / "data" / "_over_long.py"
    try:
        long.write_text("x = 1\n" * (MAX_LINES + 1))
        assert _over_long([long], {}) == [f"tests/data/_over_long.py: {MAX_LINES + 1} lines"]
        assert _over_long([long], {"tests/data/_over_long.py": MAX_LINES + 1}) == []
        assert _over_long([long], {"tests/data/_over_long.py": MAX_LINES}) != []
        assert _over_long([PACKAGE / "__init__.py"], {"lightning_blockwise/__init__.py": 500}) != []
    finally:
        long.unlink(missing_ok=True)


def _definitions(paths: list[Path]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in paths:
        for name in _DEFINITION.findall(path.read_text()):
            found.setdefault(name, []).append(path.relative_to(ROOT).as_posix())
    return found


def _unresolved(texts: dict[str, str], definitions: dict[str, list[str]]) -> list[str]:
    """Mentions of a NOTE that is defined nowhere, or that name a file it is not defined in."""
    wrong = []
    for where, text in texts.items():
        for match in _MENTION.finditer(text):
            # A mention wraps over comment lines (`#`, `#:`) or over string literals joined in the source (`"` `"`).
            name = " ".join(re.sub(r'(^|\n)\s*#:?|"\s*"', " ", match.group(1)).split())
            named = match.group(2)
            if name not in definitions:
                wrong.append(f"{where}: NOTE [ {name} ] is defined nowhere")
            elif named and not any(defined.endswith(named) for defined in definitions[name]):
                wrong.append(f"{where}: NOTE [ {name} ] in {named}, but it is in {definitions[name]}")
    return wrong


def _sources() -> list[Path]:
    """The package, the tests and the benchmarks, less this file (whose controls mention NOTEs that do not exist)."""
    folders = [PACKAGE, ROOT / "tests", ROOT / "benchmarks"]
    return [path for folder in folders for path in folder.rglob("*.py") if path != Path(__file__)]


def test_every_note_reference_resolves() -> None:
    """Each ``NOTE [ X ]`` in the code, tests and docs names a defined block, and the file it names holds it."""
    definitions = _definitions(_sources())
    docs = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    texts = {path.relative_to(ROOT).as_posix(): path.read_text() for path in [*_sources(), *docs]}
    assert _unresolved(texts, definitions) == []


def test_a_stale_note_reference_is_found() -> None:
    """Control: a mention naming the wrong file, one wrapped over comment lines, and an unknown name are found."""
    definitions = {"Kept attention": ["lightning_blockwise/replay/kept_attention.py"]}
    texts = {
        "a.py": "# (NOTE [ Kept attention ] in replay/kept_attention.py)",
        "b.py": "# see NOTE [ Kept\n    # attention ] in strategy/step_budget.py",
        "d.py": 'f"see NOTE [ Kept"\n    " attention ] in replay/kept_attention.py"',
        "c.md": "NOTE [ Kept attentions ]",
    }
    assert _unresolved(texts, definitions) == [
        "b.py: NOTE [ Kept attention ] in strategy/step_budget.py, but it is in"
        " ['lightning_blockwise/replay/kept_attention.py']",
        "c.md: NOTE [ Kept attentions ] is defined nowhere",
    ]


def _undocumented(tree: ast.Module, where: str) -> list[str]:
    """Public names without a docstring: the module, its functions and classes, their methods (overrides and
    property setters take their documentation from where they come from)."""
    missing = [] if ast.get_docstring(tree) else [f"{where} (module)"]
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if not ast.get_docstring(node):
            missing.append(f"{where}:{node.name}")
        if isinstance(node, ast.ClassDef):
            for method in node.body:
                if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or method.name.startswith("_"):
                    continue
                inherited = any(
                    (isinstance(d, ast.Name) and d.id == "override")
                    or (isinstance(d, ast.Attribute) and d.attr in ("override", "setter"))
                    for d in method.decorator_list
                )
                if not inherited and not ast.get_docstring(method):
                    missing.append(f"{where}:{node.name}.{method.name}")
    return missing


def test_every_public_name_is_documented() -> None:
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        missing += _undocumented(ast.parse(path.read_text()), path.relative_to(ROOT).as_posix())
    assert missing == []


def test_an_undocumented_name_is_found() -> None:
    """Control: a public function and method without docstrings are found; private ones and overrides are not."""
    source = '''"""A module."""
def public(): pass
def _private(): pass
class Thing:
    """A thing."""
    def method(self): pass
    @override
    def hook(self): pass
'''
    assert _undocumented(ast.parse(source), "m.py") == ["m.py:public", "m.py:Thing.method"]
