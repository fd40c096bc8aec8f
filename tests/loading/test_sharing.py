"""`load_blockwise(share=True)`: processes loading the same checkpoint the same way keep one host copy.

NOTE [ One host copy per machine ] in residency/shared_arena.py. Each arm runs two processes
(`tests/helpers/share_worker.py`): the first loads and holds its model; the second loads while it does.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig, get_peft_model

from lightning_blockwise import BlockwiseStrategy, load_blockwise
from lightning_blockwise.architectures import find_decoder_stack
from lightning_blockwise.loading.files import load_config
from lightning_blockwise.loading.packing import bind_shared_block
from lightning_blockwise.loading.policy import resolve_quantization
from lightning_blockwise.loading.sharing import share_key
from lightning_blockwise.residency import shared_arena
from lightning_blockwise.residency.fd_socket import socket_address
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import CausalLMModule, loader, padded_batches, save_checkpoint, trainer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def _two_loads(checkpoint: Path, arms: dict[Path, tuple[str, ...]]) -> dict[Path, tuple[dict, dict]]:
    """Per arm (its directory: its flags), a first process that loads and holds, then a second that loads meanwhile.

    The arms run side by side: each process is mostly ~10 s of imports, and CI has two cores while the test waits.
    """
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, "-m", "tests.helpers.share_worker", str(checkpoint)]
    firsts = {}
    for directory, flags in arms.items():
        directory.mkdir(parents=True, exist_ok=True)
        hold = ["--hold", str(directory / "release")]
        firsts[directory] = subprocess.Popen(
            [*command, str(directory / "first.json"), *hold, *flags], cwd=ROOT, env=env
        )
    try:
        deadline = time.monotonic() + 300  # a hang's bound, for processes that start side by side on a loaded CI
        while not all((directory / "first.json").exists() for directory in arms):
            assert all(first.poll() is None for first in firsts.values()), "a first load failed"
            assert time.monotonic() < deadline, "a first load hung"
            time.sleep(0.05)
        seconds = [
            subprocess.Popen([*command, str(directory / "second.json"), *flags], cwd=ROOT, env=env)
            for directory, flags in arms.items()
        ]
        assert [second.wait(timeout=300) for second in seconds] == [0] * len(arms)
    finally:
        for directory in arms:
            (directory / "release").touch()
        assert [first.wait(timeout=60) for first in firsts.values()] == [0] * len(arms)
    return {d: (json.loads((d / "first.json").read_text()), json.loads((d / "second.json").read_text())) for d in arms}


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")
def test_a_second_load_maps_the_first_ones_copy(checkpoint: Path, tmp_path: Path) -> None:
    """The second process maps the first one's arena read-only: same bytes, same logits; control: no sharing."""
    loads = _two_loads(checkpoint, {tmp_path / "shared": (), tmp_path / "own": ("--no-share",)})
    first, second = loads[tmp_path / "shared"]
    assert first["serving"] and not first["read_only"]
    assert second["read_only"] and not second["serving"]
    assert first["arena"] == second["arena"] and first["logits"] == second["logits"]
    # Control: with share=False each process has a copy of its own (and the same bytes).
    own_first, own_second = loads[tmp_path / "own"]
    assert not own_first["serving"] and not own_second["read_only"]
    assert own_second["arena"] == second["arena"] and own_second["logits"] == second["logits"]


def test_a_block_that_differs_from_the_shared_copy_is_refused(checkpoint: Path) -> None:
    """`bind_shared_block` compares every block's bytes with the shared slab; one flipped byte is refused."""
    model = load_blockwise(checkpoint, compute_dtype=torch.float32, device="cpu", progress=False, share=False)
    copy = host_copy_of(model)
    assert copy is not None
    layers = find_decoder_stack(model, allow_unvalidated=True).layers
    same = copy.arena.slabs[1].clone()
    assert bind_shared_block(layers, copy.layer_ranges[1], same).nbytes == same.numel()  # equal bytes: bound
    other = same.clone()
    other[len(other) // 2] ^= 1
    with pytest.raises(RuntimeError, match="differs from the host copy another process shares"):
        bind_shared_block(layers, copy.layer_ranges[1], other)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")
def test_concurrent_jobs_share_a_packed_copy_when_they_opt_in(checkpoint: Path, tmp_path: Path) -> None:
    """`BlockwiseStrategy(share_host_copy=True)`: two independent jobs packing the same base keep one host copy.

    Control: with the default (`None`), jobs of one process each share nothing with another job.
    """
    loads = _two_loads(checkpoint, {tmp_path / "opt_in": ("--pack", "true"), tmp_path / "default": ("--pack", "none")})
    first, second = loads[tmp_path / "opt_in"]
    assert first["serving"] and second["read_only"] and not second["serving"]
    assert first["losses"] == second["losses"]
    own_first, own_second = loads[tmp_path / "default"]
    assert not own_first["serving"] and not own_second["read_only"]
    assert own_second["losses"] == second["losses"]


def _lora_module(path: Path, share: bool) -> CausalLMModule:
    model = load_blockwise(path, compute_dtype=torch.float32, device="cpu", progress=False, share=share)
    return CausalLMModule(lambda: get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))


def _arena_sha(model: torch.nn.Module) -> str:
    copy = host_copy_of(model)
    assert copy is not None
    return hashlib.sha256(copy.arena.storage.numpy().tobytes()).hexdigest()


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")
def test_an_owner_with_peers_refuses_to_write_the_shared_copy(
    checkpoint: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`validate(ckpt_path=<full state of another base>)` in an owner is refused while a peer maps its copy.

    Control: once the peer has exited, the same call loads the other base into the copy (the owner stops serving).
    """
    other = save_checkpoint("llama", tmp_path_factory.mktemp("other"), seed=1)
    donor = _lora_module(other, share=False)
    trainer(BlockwiseStrategy(save_frozen_base=True), max_steps=1).fit(donor, loader(padded_batches(2)))
    donor.trainer.save_checkpoint(tmp_path / "full.ckpt")
    donor_sha = _arena_sha(donor.model.get_base_model())

    owner = _lora_module(checkpoint, share=True)
    base = owner.model.get_base_model()
    copy = host_copy_of(base)
    assert copy is not None and copy.serving is not None
    before = _arena_sha(base)
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    hold = tmp_path / "release"
    command = [sys.executable, "-m", "tests.helpers.share_worker", str(checkpoint), str(tmp_path / "peer.json")]
    peer = subprocess.Popen([*command, "--hold", str(hold)], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "peer.json").exists():
            assert peer.poll() is None and time.monotonic() < deadline, "the peer's load failed or hung"
            time.sleep(0.05)
        assert json.loads((tmp_path / "peer.json").read_text())["read_only"]
        assert copy.serving.peers() == [peer.pid]
        validate = trainer(BlockwiseStrategy(), limit_val_batches=1)
        refused = rf"shares that copy with 1 other process\(es\) \(pids \[{peer.pid}\]\)"
        with pytest.raises(MisconfigurationException, match=refused):
            validate.validate(owner, loader(padded_batches(1)), ckpt_path=tmp_path / "full.ckpt")
        assert _arena_sha(base) == before and copy.serving is not None
    finally:
        hold.touch()
        assert peer.wait(timeout=60) == 0
    trainer(BlockwiseStrategy(), limit_val_batches=1).validate(
        owner, loader(padded_batches(1)), ckpt_path=tmp_path / "full.ckpt"
    )
    assert copy.serving is None  # it no longer holds the base its key names
    assert _arena_sha(base) == donor_sha != before


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="host copies are shared on Linux only")
def test_a_load_whose_address_is_squatted_loads_its_own_copy(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A squatted address (bound, never answering) costs the bound, not the share timeout: the load is unshared."""
    monkeypatch.setattr(shared_arena, "REACH_TIMEOUT_S", 0.5)
    bnb_config, pre_quantized = resolve_quantization(load_config(checkpoint), None, torch.float32, True)
    key = share_key(checkpoint, 1, bnb_config, torch.float32, pre_quantized)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as squatter:
        squatter.bind(socket_address(key))
        began = time.monotonic()
        model = load_blockwise(checkpoint, compute_dtype=torch.float32, device="cpu", progress=False)
        assert time.monotonic() - began < 60
    copy = host_copy_of(model)
    assert copy is not None and copy.serving is None and not copy.arena.read_only
    assert "no process of this user answers" in caplog.text
