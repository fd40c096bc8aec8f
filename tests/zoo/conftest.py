"""The zoo's base: one tiny random-init Llama saved as a Hugging Face checkpoint, which each client loads as NF4."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.models import save_checkpoint


@pytest.fixture(scope="session")
def zoo_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved ``CONFIGS["llama"]`` checkpoint (attention dropout 0.1), which clients load with `from_pretrained`."""
    return save_checkpoint("llama", tmp_path_factory.mktemp("zoo_base"))
