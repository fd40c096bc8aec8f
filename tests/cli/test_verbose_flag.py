"""`lightning-blockwise fit --verbose` brings every message back (NOTE [ --verbose on the Trainer's commands ]).

`validate` and `test` keep Lightning's own `--verbose`; LIGHTNING_BLOCKWISE_VERBOSE=1 serves every command.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest

from lightning_blockwise.cli import main
from lightning_blockwise.compat import quiet_logs
from lightning_blockwise.compat.quiet_logs import VERBOSE_ENV

DEMO = ["--config", "configs/demo.yaml", "--print_config"]


@pytest.fixture(autouse=True)
def _quiet_again(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts quiet; monkeypatch puts the variable back, and the filters with it after the test."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    quiet_logs.quiet_outside_libraries()
    yield
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    quiet_logs.quiet_outside_libraries()


def _bitsandbytes_filtered() -> bool:
    return quiet_logs._FILTER in logging.getLogger(quiet_logs._BITSANDBYTES_CPU_LOGGER).filters


@pytest.mark.parametrize("command", ["fit", "predict"])
def test_verbose_on_fit_and_predict_is_ours(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, *DEMO, "--verbose"])
    assert exit_.value.code in (None, 0), capsys.readouterr().err
    assert os.environ.get(VERBOSE_ENV) == "1"
    assert not _bitsandbytes_filtered()
    # The flag did not reach LightningCLI's parser (which has no `--verbose` for these commands).
    assert "verbose" not in capsys.readouterr().out


def test_control_without_the_flag_it_stays_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", *DEMO])
    assert VERBOSE_ENV not in os.environ
    assert _bitsandbytes_filtered()


def test_control_lightning_refuses_a_verbose_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    """Why the flag is taken out before LightningCLI parses: `fit` has no `--verbose` of Lightning's."""
    from lightning_blockwise.cli.trainer_cli import run_trainer_cli

    with pytest.raises(SystemExit) as exit_:
        run_trainer_cli(["fit", *DEMO, "--verbose"])
    assert exit_.value.code not in (None, 0)


def test_validate_keeps_lightnings_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["validate", *DEMO, "--verbose=false"])
    assert exit_.value.code in (None, 0), capsys.readouterr().err
    assert VERBOSE_ENV not in os.environ
    assert "verbose: false" in capsys.readouterr().out
