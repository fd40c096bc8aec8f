"""The fit loop's private state the strategy reads (NOTE [ The fit loop's private state ] in strategy/fit_loop.py).

Every function of the module runs against the installed Lightning in tests/cli/test_resume.py and
tests/replay/test_block_major.py; here, the check that stops a run at setup where a Lightning lacks that state.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from lightning.pytorch import Trainer

from lightning_blockwise.strategy.fit_loop import PRIVATE_NAMES, check_fit_loop


def test_the_installed_lightning_has_the_state_read() -> None:
    check_fit_loop(Trainer(logger=False, enable_checkpointing=False).fit_loop)


def test_a_fit_loop_without_it_is_refused_naming_what_is_missing() -> None:
    """Control: a fit loop without one of the names (as a Lightning that renamed it) stops the run, saying the fix."""
    fit_loop = SimpleNamespace(**{name: None for name in PRIVATE_NAMES if name != "_data_fetcher"})
    with pytest.raises(RuntimeError, match=r"\['_data_fetcher'\].*`lightning-blockwise versions` prints the range"):
        check_fit_loop(fit_loop)
