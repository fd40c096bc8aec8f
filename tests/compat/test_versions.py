"""The tested dependency range: read from the package's metadata, checked at the strategy's setup."""

from __future__ import annotations

import warnings
from importlib import metadata

import pytest

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat import versions
from tests.helpers.models import CausalLMModule, build_model, fit


def _fake_installed(monkeypatch: pytest.MonkeyPatch, **fake: str) -> None:
    real = metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda name: fake.get(name) or real(name))


def test_a_version_past_the_upper_bound_is_untested(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, transformers="5.25.0")
    [outside] = versions.untested(["transformers>=5.17,<5.25", "peft>=0.21,<0.22"])
    assert (outside.name, outside.installed, outside.tested) == ("transformers", "5.25.0", ">=5.17,<5.25")
    message = versions.untested_message([outside])
    assert "transformers 5.25.0 (tested: >=5.17,<5.25)" in message
    assert 'pip install "transformers>=5.17,<5.25"' in message and "ParityCheck" in message


@pytest.mark.parametrize("installed", ["5.17.0", "5.24.3"])
def test_versions_inside_the_range_are_tested(monkeypatch: pytest.MonkeyPatch, installed: str) -> None:
    _fake_installed(monkeypatch, transformers=installed)
    assert versions.untested(["transformers>=5.17,<5.25"]) == []


def test_a_local_build_tag_and_a_prerelease_of_a_tested_minor_count_as_tested(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, torch="2.13.0+cpu")
    assert versions.untested(["torch>=2.11,<2.14"]) == []
    _fake_installed(monkeypatch, torch="2.12.0a0+git1234")
    assert versions.untested(["torch>=2.11,<2.14"]) == []
    _fake_installed(monkeypatch, torch="2.11.0a0+git1234")  # a pre-release of the floor itself
    assert versions.untested(["torch>=2.11,<2.14"]) == []
    _fake_installed(monkeypatch, torch="2.14.0a0+git1234")  # of the first untested release: not tested
    assert [d.name for d in versions.untested(["torch>=2.11,<2.14"])] == ["torch"]
    _fake_installed(monkeypatch, torch="2.10.0+cu126")
    assert [d.name for d in versions.untested(["torch>=2.11,<2.14"])] == ["torch"]


def test_the_test_extra_is_not_a_run_time_dependency() -> None:
    names = [d.name for d in versions.dependencies(["torch>=2.11,<2.14", 'pytest>=8,<10; extra == "test"'])]
    assert names == ["torch"]


def test_the_installed_package_states_a_bounded_range_for_every_dependency() -> None:
    found = versions.dependencies()
    assert {"torch", "transformers", "peft", "bitsandbytes", "lightning"} <= {d.name for d in found}
    for dependency in found:
        assert dependency.tested.startswith(">=") and ",<" in dependency.tested, dependency


def test_the_strategy_warns_about_an_untested_version_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_installed(monkeypatch, transformers="99.0.0")
    with pytest.warns(UserWarning, match=r"transformers 99\.0\.0 \(tested: >="):
        fit(CausalLMModule(lambda: build_model("llama")), BlockwiseStrategy(), max_steps=1)


def test_control_no_warning_with_the_installed_versions() -> None:
    """Control: the machine running the tests has a tested set, so the check stays quiet."""
    assert versions.untested() == [], versions.untested_message(versions.untested())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(CausalLMModule(lambda: build_model("llama")), BlockwiseStrategy(), max_steps=1)
    assert not [w for w in caught if "outside the versions it was tested" in str(w.message)]


def test_versions_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """`lightning-blockwise versions --help` exited 1 with a usage line; now argparse's help, exit 0."""
    with pytest.raises(SystemExit) as exit_info:
        versions.versions_command(["--help"])
    assert exit_info.value.code == 0
    assert "--check" in capsys.readouterr().out
    # Control arm: a wrong argument is still refused, with argparse's usage and exit 2.
    with pytest.raises(SystemExit) as exit_info:
        versions.versions_command(["--chek"])
    assert exit_info.value.code == 2
    assert "usage: lightning-blockwise versions [-h] [--check]" in capsys.readouterr().err
