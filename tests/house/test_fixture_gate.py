"""The GPU gate's fixture check (tests/helpers/gpu_gate.py), on stand-ins for collected tests."""

from __future__ import annotations

from types import SimpleNamespace

from tests.helpers.gpu_gate import unresolved_fixtures


def _item(names: list[str], defined: list[str]) -> SimpleNamespace:
    info = SimpleNamespace(names_closure=names, name2fixturedefs={name: [object()] for name in defined})
    return SimpleNamespace(_fixtureinfo=info)


def test_a_lost_fixture_is_named() -> None:
    assert unresolved_fixtures(_item(["tmp_path", "qwen2_checkpoint", "request"], ["tmp_path"])) == ["qwen2_checkpoint"]


def test_a_test_whose_fixtures_are_defined_passes() -> None:
    """Control: every name defined (``request`` is pytest's own), nothing named."""
    assert (
        unresolved_fixtures(_item(["tmp_path", "qwen2_checkpoint", "request"], ["tmp_path", "qwen2_checkpoint"])) == []
    )
    assert unresolved_fixtures(SimpleNamespace()) == []  # not a test function: nothing to check
