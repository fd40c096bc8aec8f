"""Every third-party package the tests import is declared: a run-time dependency, or in the ``test`` extra.

A test that may run without a package imports it through ``pytest.importorskip``, whose skip reason names the extra
to install. CI installs only what the README says, in a virtualenv made from nothing (``.ci/run``), so an import
missing from ``pyproject.toml`` fails there as it fails a new user; this test says which and where, sooner. The
package's own imports are run-time dependencies, or packages that a run-time dependency itself requires (checked
against that dependency's metadata, so an upstream that drops one fails here), or optional (``except ImportError``).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib import metadata
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: Imports that are this repository's own code.
OWN = {"tests", "lightning_blockwise", "benchmarks", "__future__"}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(distribution: str, extra: str | None) -> set[str]:
    """The distributions ``distribution`` requires at run time, plus those of its ``extra``."""
    names = set()
    for line in metadata.requires(distribution) or []:
        name, _, marker = line.partition(";")
        if "extra" in marker and (extra is None or repr(extra) not in marker.replace('"', "'")):
            continue
        names.add(_canonical(re.split(r"[\s<>=!~\[(]", name.strip(), maxsplit=1)[0]))
    return names


def declared_distributions(extra: str | None = "test") -> set[str]:
    """The distributions the installed project declares: its run-time requirements and those of ``extra``."""
    return _requirement_names("lightning-blockwise", extra)


#: What the package imports without declaring it, and the run-time dependency that requires each.
TRANSITIVE = {
    "typing_extensions": "lightning",
    "lightning_utilities": "lightning",
    "fsspec": "lightning",
    "packaging": "lightning",
    "tqdm": "transformers",
    "tokenizers": "transformers",
    "numpy": "transformers",
    "jinja2": "torch",
}
#: Imported only where installed (``RequirementCache``, a fallback without it): plain-text tables without rich.
OPTIONAL = {"rich"}


def imported_modules(source: str) -> tuple[set[str], set[str]]:
    """The top-level modules ``source`` imports, and those it imports through ``pytest.importorskip``."""
    imported, optional = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try) and any(_catches_import_error(handler) for handler in node.handlers):
            optional.update(imported_modules(ast.unparse(ast.Module(body=node.body, type_ignores=[])))[0])
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            optional.add(str(node.args[0].value).split(".")[0])
    return imported, optional


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(name, ast.Name) and name.id in ("ImportError", "ModuleNotFoundError") for name in caught)


def undeclared_imports(sources: dict[str, str], declared: set[str]) -> dict[str, str]:
    """Third-party modules imported without ``importorskip`` whose distribution is not declared: module -> file."""
    distributions = metadata.packages_distributions()
    found: dict[str, str] = {}
    for where, source in sorted(sources.items()):
        imported, optional = imported_modules(source)
        for module in sorted(imported - optional - OWN - set(sys.stdlib_module_names)):
            owners = {_canonical(d) for d in distributions.get(module, [])}
            if not owners & declared:
                found.setdefault(module, where)
    return found


def _test_sources() -> dict[str, str]:
    return {str(path.relative_to(TESTS.parent)): path.read_text() for path in TESTS.rglob("*.py")}


def test_every_test_import_is_declared() -> None:
    undeclared = undeclared_imports(_test_sources(), declared_distributions())
    assert undeclared == {}, (
        f"tests import {undeclared} (module: first file), which pyproject.toml does not declare: add each to the"
        " `test` extra, or import it with `pytest.importorskip(name, reason='pip install ...[extra]')`."
    )


def test_every_package_import_is_a_dependency() -> None:
    package = TESTS.parent / "lightning_blockwise"
    sources = {str(path.relative_to(TESTS.parent)): path.read_text() for path in package.rglob("*.py")}
    undeclared = undeclared_imports(sources, declared_distributions(extra=None))
    assert set(undeclared) <= set(TRANSITIVE) | OPTIONAL, (
        f"the package imports {undeclared} without declaring it: add it to `dependencies` in pyproject.toml"
    )
    runtime = declared_distributions(extra=None)
    for module, through in TRANSITIVE.items():
        owners = {_canonical(d) for d in metadata.packages_distributions().get(module, [])}
        assert through in runtime and owners & _requirement_names(through, None), (module, through)


def test_control_a_made_up_import_is_reported_and_importorskip_is_not() -> None:
    declared = declared_distributions()
    made_up = "import made_up_package_xyz\nfrom torch import nn\n"
    assert undeclared_imports({"t.py": made_up}, declared) == {"made_up_package_xyz": "t.py"}
    skipped = "import pytest\nmade_up_package_xyz = pytest.importorskip('made_up_package_xyz')\n"
    assert undeclared_imports({"t.py": skipped}, declared) == {}
    # A package that is installed but not declared (a transitive dependency) is reported too.
    assert "yaml" in undeclared_imports({"t.py": "import yaml\n"}, declared - {"pyyaml"})
    # An import under `except ImportError` is optional; outside it, it is not.
    guarded = "try:\n    import made_up_package_xyz\nexcept ImportError:\n    pass\n"
    assert undeclared_imports({"t.py": guarded}, declared) == {}
    assert "made_up_package_xyz" in undeclared_imports({"t.py": guarded.replace("ImportError", "KeyError")}, declared)
