"""The GPU gate's check that a GPU test could set up: run on the CPU too, where those tests are skipped."""

from __future__ import annotations

from typing import Any

#: Names pytest provides without a fixture definition.
_BUILT_IN = {"request"}


def unresolved_fixtures(item: Any) -> list[str]:
    """The fixtures ``item`` asks for that no conftest, plugin or parametrization defines.

    A skipped test never sets up its fixtures, so on the CPU a GPU test whose fixture was lost (a conftest it relied
    on moved away) would be skipped quietly and fail only on a GPU. Pytest resolves the names at collection already:
    its ``_fixtureinfo`` (pytest 8-9) holds every name the test needs and the definitions it found for them.

    Args:
        item: A collected pytest test function.
    """
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return sorted(name for name in info.names_closure if name not in info.name2fixturedefs and name not in _BUILT_IN)
