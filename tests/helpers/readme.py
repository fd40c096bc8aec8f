"""tools/readme_commands.py (a script, not a package module), loaded once for the tests that read the README."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_spec = importlib.util.spec_from_file_location("readme_commands", ROOT / "tools" / "readme_commands.py")
assert _spec is not None and _spec.loader is not None
readme_commands = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_commands)

__all__ = ["ROOT", "readme_commands"]
