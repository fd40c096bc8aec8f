"""Nothing opens a network connection at run time: the demo through the CLI, and ``plan``, with sockets refused."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from lightning_blockwise.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


@pytest.fixture
def attempts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every connection (and name lookup) tried; each fails as it would on a machine without a network.

    The test asserts the list stays empty as well: a caller that catches the error and goes on (a Hub
    look-up with a local fallback) would otherwise pass unnoticed.
    """
    tried: list[str] = []

    def refuse(*args: Any, **kwargs: Any) -> None:
        tried.append(repr(args[1:] if args and isinstance(args[0], socket.socket) else args))
        raise OSError(f"test_no_network: a connection was tried: {tried[-1]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    # LightningCLI warns when given `args` while `sys.argv` holds pytest's own arguments.
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])
    return tried


def test_refused_connections_are_seen(attempts: list[str]) -> None:
    # Control arm: the patches catch a connection attempt.
    with pytest.raises(OSError, match="a connection was tried"):
        socket.create_connection(("huggingface.co", 443), timeout=1)
    assert attempts == ["(('huggingface.co', 443),)"]


def test_demo_fit_runs_offline(attempts: list[str], tmp_path: Path) -> None:
    main(
        [
            "fit",
            "--config",
            str(DEMO_CONFIG),
            f"--trainer.default_root_dir={tmp_path}",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.batch_size=2",
        ]
    )
    assert attempts == []
    # The run went to its end: the demo saves its adapter last.
    (adapter,) = tmp_path.rglob("adapter_model.safetensors")
    assert (adapter.parents[1] / "config.yaml").is_file()


def test_plan_runs_offline(attempts: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
    )
    config.save_pretrained(tmp_path)
    main(["plan", str(tmp_path), "--seq-len", "16", "--gpu-memory", "8GiB", "--json"])
    assert attempts == []
    assert json.loads(capsys.readouterr().out)["num_layers"] == 4
