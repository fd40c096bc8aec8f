"""One host copy per machine: the owner's arena mapped read-only by other processes, one owner per key, no leak.

The other processes come from a forkserver that imports this module once: a fresh interpreter per
process would import the package (about 9 s of CPU on CI's two cores) each time. Forkserver children
inherit nothing of the pytest process, so they hold no mapping they were not handed.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_blockwise.residency import fd_socket, shared_arena, sharing
from lightning_blockwise.residency.arena import MEMFD_NAME, HostArena
from lightning_blockwise.residency.shared_arena import claim, shmem_bytes

MIB = 1024**2

# Long enough for a loaded CI machine, short enough that a broken test fails rather than hangs.
WAIT_S = 60.0


def _key() -> str:
    """A key no other test run on the machine uses at the same time."""
    return f"test-shared-arena-{uuid.uuid4().hex}"


def _pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy()).hexdigest()


def _mapping(tensor: torch.Tensor) -> tuple[str, str]:
    """The permissions and the path of this process's mapping that holds ``tensor``'s first byte."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            if start <= address < end:
                return fields[1], fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds address {address:#x}")


def _receive(connection: Connection) -> Any:
    assert connection.poll(WAIT_S), "the other process sent nothing"
    return connection.recv()


# The processes the tests start. Each reports through `results`; `stop` tells it to leave.


def _own(key: str, nbytes: int, seed: int, stop: Event, results: Connection) -> None:
    with claim(key) as arena_claim:
        arena = HostArena([nbytes], pin=False)
        arena.storage.copy_(_pattern(nbytes, seed))
        arena_claim.publish(arena, {"seed": seed})
        results.send(arena_claim.owner)
        stop.wait(WAIT_S)


def _attach(key: str, write: bool, stop: Event, results: Connection) -> None:
    arena, meta = claim(key).attach(pin=False, timeout=WAIT_S)
    results.send((_sha(arena.storage), _mapping(arena.storage), meta))
    if write:
        arena.storage[0] ^= 0xFF  # the pages are mapped read-only: this faults
        results.send("wrote")
    stop.wait(WAIT_S)
    results.send(_sha(arena.storage))


def _claim(key: str, begin: Barrier, stop: Event, results: Connection) -> None:
    begin.wait(WAIT_S)
    with claim(key) as arena_claim:
        results.send(arena_claim.owner)
        stop.wait(WAIT_S)


Start = Callable[..., tuple[BaseProcess, Connection]]


@pytest.fixture(scope="module")
def forkserver() -> Iterator[ForkServerContext]:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    yield context
    # Stop the server this module started, so that no process of ours outlives the tests.
    multiprocessing.forkserver._forkserver._stop()


@pytest.fixture
def start(forkserver: ForkServerContext) -> Iterator[Start]:
    """Start ``target(*args, results)`` in a process; every process is killed (if still alive) and reaped."""
    processes: list[BaseProcess] = []

    def run(target: Callable[..., None], *args: Any) -> tuple[BaseProcess, Connection]:
        receiver, sender = forkserver.Pipe(duplex=False)
        process = forkserver.Process(target=target, args=(*args, sender))
        process.start()
        sender.close()
        processes.append(process)
        return process, receiver

    yield run
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join(WAIT_S)
        assert process.exitcode is not None


def test_arena_bytes_live_in_a_memfd_of_sealed_size() -> None:
    arena = HostArena([1000, 3, 512], pin=False)
    assert arena.fd is not None and not arena.read_only
    assert _mapping(arena.storage) == ("rw-s", f"/memfd:{MEMFD_NAME} (deleted)")
    # Control: ordinary process memory reads differently.
    assert _mapping(torch.empty(64 * MIB, dtype=torch.uint8))[0] == "rw-p"
    # A process handed the fd cannot shrink the pages under the others' reads.
    with pytest.raises(PermissionError):
        os.ftruncate(arena.fd, 0)


def test_views_outlive_the_arena_object() -> None:
    arena = HostArena([4096], pin=False)
    arena.storage.copy_(_pattern(4096, seed=1))
    view = arena.slabs[0][100:200]
    del arena  # closes the fd; the mapping stays with the views
    assert torch.equal(view, _pattern(4096, seed=1)[100:200])


def test_arena_without_memfd_cannot_be_published(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(os, "memfd_create")
    arena = HostArena([1000, 3], pin=False)
    assert arena.fd is None and [slab.numel() for slab in arena.slabs] == [1000, 3]
    assert _mapping(arena.storage)[0] == "rw-p"
    with claim(_key()) as arena_claim, pytest.raises(ValueError, match="cannot be shared"):
        arena_claim.publish(arena, {})


def test_a_peer_maps_the_owners_pages_read_only(forkserver: ForkServerContext, start: Start) -> None:
    key, nbytes = _key(), 4 * MIB
    with claim(key) as arena_claim:
        assert arena_claim.owner
        arena = HostArena([nbytes], pin=False)
        arena.storage.copy_(_pattern(nbytes, seed=2))
        published = _sha(arena.storage)
        arena_claim.publish(arena, {"seed": 2})
        stop = forkserver.Event()
        _, from_reader = start(_attach, key, False, stop)
        writer, from_writer = start(_attach, key, True, stop)
        sha, (permissions, path), meta = _receive(from_reader)
        assert sha == published and meta == {"seed": 2}
        assert permissions == "r--s" and path == f"/memfd:{MEMFD_NAME} (deleted)"
        # The writer dies of SIGSEGV at its write, and the bytes stay as published.
        assert _receive(from_writer)[0] == published
        writer.join(WAIT_S)
        assert writer.exitcode == -signal.SIGSEGV
        assert _sha(arena.storage) == published
        # Control: the reader reads the owner's pages, not a copy: a change shows, and the hashes see it.
        arena.storage[0] ^= 0xFF
        stop.set()
        changed = _receive(from_reader)
        assert changed == _sha(arena.storage) != published


def test_exactly_one_process_owns_a_key(forkserver: ForkServerContext, start: Start) -> None:
    same, begin, stop = _key(), forkserver.Barrier(4), forkserver.Event()
    racers = [start(_claim, key, begin, stop) for key in (same, same, _key(), _key())]
    owners = [_receive(results) for _, results in racers]
    stop.set()
    assert sorted(owners[:2]) == [False, True]
    assert owners[2:] == [True, True]  # control: two keys, two owners


def test_a_peer_keeps_its_mapping_when_the_owner_exits(forkserver: ForkServerContext, start: Start) -> None:
    key, nbytes, stop = _key(), 4 * MIB, forkserver.Event()
    owner, from_owner = start(_own, key, nbytes, 3, stop)
    assert _receive(from_owner) is True
    peer = claim(key)
    assert not peer.owner  # control for the claim below: the owner still holds the key
    attached = peer.attach(pin=False, timeout=WAIT_S)
    assert attached is not None
    arena, meta = attached
    assert meta == {"seed": 3} and arena.read_only and [slab.numel() for slab in arena.slabs] == [nbytes]
    stop.set()
    owner.join(WAIT_S)
    assert owner.exitcode == 0
    assert torch.equal(arena.storage, _pattern(nbytes, seed=3))
    with claim(key) as later:
        assert later.owner  # nothing serves the key any more: a later process loads its own copy


def test_sigkill_leaves_no_shared_memory_behind(forkserver: ForkServerContext, start: Start) -> None:
    key, nbytes, stop = _key(), 64 * MIB, forkserver.Event()
    baseline = shmem_bytes()
    owner, from_owner = start(_own, key, nbytes, 4, stop)
    assert _receive(from_owner) is True
    peer, from_peer = start(_attach, key, False, stop)
    assert _receive(from_peer)[0] == _sha(_pattern(nbytes, seed=4))
    alive = shmem_bytes() - baseline
    for process in (owner, peer):
        os.kill(process.pid, signal.SIGKILL)
        process.join(WAIT_S)
        assert process.exitcode == -signal.SIGKILL
    deadline = time.monotonic() + 5.0
    while (after := shmem_bytes() - baseline) >= nbytes // 4 and time.monotonic() < deadline:
        time.sleep(0.05)  # other processes on the machine may hold shared memory for a moment
    # Control: with both alive the pages were counted, once (the peer maps them, it holds no copy). The
    # margins of a quarter of the arena absorb what other processes on the machine do to `Shmem` meanwhile.
    assert nbytes * 3 // 4 < alive < nbytes * 5 // 4, (
        f"Shmem grew by {alive / MIB:.1f} MiB for one {nbytes // MIB} MiB arena"
    )
    assert after < nbytes // 4, f"Shmem is still {after / MIB:.1f} MiB above its baseline after SIGKILL"


def test_a_peer_times_out_when_the_owner_never_publishes() -> None:
    key = _key()
    with claim(key) as owner, claim(key) as peer:
        assert owner.owner and not peer.owner
        began = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"process {os.getpid()}, has not published .*{key}.* within 0.3 s"):
            peer.attach(pin=False, timeout=0.3)
        assert time.monotonic() - began >= 0.3


def test_a_peer_takes_over_when_the_owner_leaves_before_publishing() -> None:
    key = _key()
    with claim(key) as owner, claim(key) as peer, claim(key) as late:
        threading.Timer(0.2, owner.release).start()  # e.g. loading raised in the owner
        assert peer.attach(pin=False, timeout=WAIT_S) is None and peer.owner
        arena = HostArena([1000, 24], pin=False)
        arena.storage.copy_(_pattern(arena.nbytes, seed=5))
        peer.publish(arena, {"seed": 5})
        attached = late.attach(pin=False, timeout=WAIT_S)
        assert attached is not None and not late.owner
        assert torch.equal(attached[0].storage, arena.storage)


def test_a_second_owner_lost_before_publishing_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    others = []

    def another_peer_takes_over() -> bool:
        others.append(claim(key))  # another waiting peer bound the address first...
        threading.Timer(0.2, others[-1].release).start()  # ...and its loading fails too
        return False

    with claim(key) as first, claim(key) as peer:
        monkeypatch.setattr(peer, "_take_over", another_peer_takes_over)
        threading.Timer(0.2, first.release).start()
        with pytest.raises(RuntimeError, match=r"two processes that owned the host copy .* exited before publishing"):
            peer.attach(pin=False, timeout=WAIT_S)
    assert len(others) == 1 and others[0].owner


def test_misuse_is_refused() -> None:
    with pytest.raises(ValueError, match="`key` is empty"):
        claim("")
    key = _key()
    with claim(key) as owner, claim(key) as peer:
        with pytest.raises(RuntimeError, match=r"owns .* `publish` it"):
            owner.attach(pin=False, timeout=1.0)
        with pytest.raises(RuntimeError, match="does not hold the claim"):
            peer.publish(HostArena([16], pin=False), {})
        with pytest.raises(ValueError, match=r"timeout=0\): the wait for the owner must be positive"):
            peer.attach(pin=False, timeout=0)
        with pytest.raises(ValueError, match="`meta` must be JSON"):
            owner.publish(HostArena([16], pin=False), {"sizes": object()})
    with pytest.raises(RuntimeError, match="was released; claim the key again"):
        owner.publish(HostArena([16], pin=False), {})


class _FakeCudart:
    """Stands in for CUDA's runtime: records each registration's flags and answers ``error``."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        if self.error == 0:
            self.registered[pointer] = flags
        return self.error

    def cudaHostUnregister(self, pointer: int) -> int:
        del self.registered[pointer]
        return 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="stands in for CUDA; the GPU runs pin for real")
def test_a_peer_pins_its_mapping_read_only(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = _FakeCudart(error=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    owner = HostArena([4096], pin=True)
    peer = HostArena.from_shared(owner.fd, [4096], pin=True)
    assert owner.pinned and peer.pinned
    # The owner registers its writable pages plainly (control), the peer its read-only ones read-only.
    assert cudart.registered == {owner.storage.data_ptr(): 0, peer.storage.data_ptr(): 0x08}
    del owner, peer
    assert cudart.registered == {}  # both unregistered with their arenas
    failing = _FakeCudart(error=801)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: failing)
    monkeypatch.setattr(torch.cuda, "CudaError", lambda code: f"operation not supported ({code})")
    shared = HostArena([4096], pin=False)
    with pytest.raises(RuntimeError, match=r"flags 0x8\) failed: operation not supported \(801\).*ReadOnlySupported"):
        HostArena.from_shared(shared.fd, [4096], pin=True)


def test_from_shared_refuses_other_sizes() -> None:
    arena = HostArena([1000], pin=False)
    with pytest.raises(ValueError, match=r"holds 1024 bytes, but slabs of \[2000\] take 2048"):
        HostArena.from_shared(arena.fd, [2000], pin=False)


def test_socket_address_is_abstract_and_per_user() -> None:
    address = shared_arena.socket_address("a base")
    assert address.startswith(f"\0lightning-blockwise/{os.getuid()}/") and len(address.rsplit("/", 1)[1]) == 32
    assert address != shared_arena.socket_address("another base")


# NOTE [ Addresses no other user can take ] (fd_socket.py): the tests below need one user; those after them
# a second one, which only root can become (they skip otherwise).

NOBODY = 65534


def _squat(address: str, listening: bool) -> socket.socket:
    """Bind ``address`` as a squatter would: listening, or bound only (``connect`` is then refused)."""
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(address)
    if listening:
        squatter.listen(1)
    return squatter


def test_the_address_cannot_be_computed_from_the_key_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    address = shared_arena.socket_address(key)
    # The secret lies in a file of the user's own, readable by no one else, in a directory no one else enters.
    directory = fd_socket.secret_directory()
    for path, mode in ((directory, 0o700), (directory / "share-secret", 0o600)):
        info = path.lstat()
        assert info.st_uid == os.getuid() and info.st_mode & 0o777 == mode, (path, oct(info.st_mode))
    # Stable for the user (every process of the user meets at it)...
    assert shared_arena.socket_address(key) == address
    # ...but not what the key alone gives (the address before the secret, the control), nor what another secret does.
    assert address.rsplit("/", 1)[1] != hashlib.sha256(key.encode()).hexdigest()[:32]
    monkeypatch.setitem(fd_socket._SECRETS, os.getuid(), b"another user's guess of the secret")
    assert shared_arena.socket_address(key) != address


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "share-secret"
    assert fd_socket._read_or_make_secret(secret) == fd_socket._read_or_make_secret(secret)  # control: made once
    secret.chmod(0o644)
    with pytest.raises(RuntimeError, match=r"others can read it \(mode 644\); remove it"):
        fd_socket._read_or_make_secret(secret)


def test_a_squatted_address_falls_back_within_the_bound(caplog: pytest.LogCaptureFixture) -> None:
    """Bound and not listening, the address is unreachable: the claim loads its own copy after the bound."""
    key = _key()
    with _squat(shared_arena.socket_address(key), listening=False), claim(key) as peer:
        assert not peer.owner
        began = time.monotonic()
        assert peer.attach(pin=False, timeout=WAIT_S, reach_timeout=0.5) is None
        waited = time.monotonic() - began
        assert not peer.owner  # it loads a copy of its own and serves none
    assert 0.5 <= waited < 5.0, waited
    assert "no process of this user answers" in caplog.text and "no process answers on it" in caplog.text
    assert shared_arena.REACH_TIMEOUT_S == 10.0


def test_attach_or_own_falls_back_to_an_unshared_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    monkeypatch.setattr(shared_arena, "REACH_TIMEOUT_S", 0.2)
    with _squat(shared_arena.socket_address(key), listening=False):
        assert sharing.attach_or_own(key, pin=False) == (None, None)  # not shared: the caller checks RAM


def test_a_slow_owner_is_waited_for_past_the_bound() -> None:
    """Control: the bound is on reaching an owner, not on its loading; one that answers late still serves."""
    key = _key()
    with claim(key) as owner, claim(key) as peer:
        arena = HostArena([4096], pin=False)
        arena.storage.copy_(_pattern(4096, seed=3))
        threading.Timer(0.6, owner.publish, args=(arena, {})).start()
        attached = peer.attach(pin=False, timeout=WAIT_S, reach_timeout=0.2)
        assert attached is not None and torch.equal(attached[0].storage, arena.storage)


def test_an_owner_counts_its_live_peers(forkserver: ForkServerContext, start: Start) -> None:
    key = _key()
    stop = forkserver.Event()
    with claim(key) as owner:
        arena = HostArena([4096], pin=False)
        owner.publish(arena, {})
        assert owner.peers() == []
        process, results = start(_attach, key, False, stop)
        _receive(results)
        assert owner.peers() == [process.pid]
        stop.set()
        _receive(results)
        process.join(WAIT_S)
        assert owner.peers() == []


def _as_nobody(work: Callable[[], object]) -> object:
    """Run ``work`` in a forked child that became user 65534; what it returned (or the error it raised)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(reader)
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result: object = work()
        except BaseException as error:
            result = error
        with os.fdopen(writer, "wb") as pipe:
            pickle.dump(result, pipe)
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        result = pickle.load(pipe)
    os.waitpid(pid, 0)
    return result


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="becoming a second user needs root")


@needs_root
def test_another_user_can_neither_read_the_secret_nor_compute_the_address() -> None:
    key = _key()
    address = shared_arena.socket_address(key)
    path = fd_socket.secret_directory() / "share-secret"
    assert isinstance(_as_nobody(path.read_bytes), PermissionError)
    theirs = _as_nobody(lambda: shared_arena.socket_address(key))
    assert isinstance(theirs, str) and theirs != address and f"/{NOBODY}/" in theirs


@needs_root
@pytest.mark.parametrize("listening", [False, True], ids=["bound", "listening"])
def test_another_users_squat_falls_back_within_the_bound(listening: bool, caplog: pytest.LogCaptureFixture) -> None:
    key = _key()
    address = shared_arena.socket_address(key)  # as seen in /proc/net/unix while an owner of ours lived
    ready, release = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the squatter
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        squatter = _squat(address, listening)
        os.write(ready[1], b"1")
        os.read(release[0], 1)
        squatter.close()
        os._exit(0)
    try:
        assert os.read(ready[0], 1) == b"1"
        with claim(key) as peer:
            assert not peer.owner
            began = time.monotonic()
            assert peer.attach(pin=False, timeout=WAIT_S, reach_timeout=0.5) is None and not peer.owner
            assert time.monotonic() - began < 5.0
    finally:
        os.write(release[1], b"1")
        os.waitpid(pid, 0)
    held = f"process {pid} of user {NOBODY} holds it" if listening else "no process answers on it"
    assert held in caplog.text


@needs_root
def test_an_owner_serves_no_other_user() -> None:
    """The owner's uid check: a process of another user that connects gets no fd (control: one of ours does)."""
    key = _key()
    with claim(key) as owner:
        arena = HostArena([4096], pin=False)
        owner.publish(arena, {})
        address = owner.address

        def connect_and_receive() -> object:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.settimeout(WAIT_S)
                connection.connect(address)
                received = fd_socket.receive(connection)
                return None if received is None else received[0]

        assert _as_nobody(connect_and_receive) is None
        assert connect_and_receive() == {"sizes": [4096], "meta": {}}


def _fake_owner(key: str, message: bytes, fd: int) -> socket.socket:
    """A process of this user on ``key``'s address that serves ``message`` with ``fd``, as an owner serves."""
    listener = fd_socket.listen(shared_arena.socket_address(key))
    assert listener is not None
    threading.Thread(target=fd_socket.serve, args=(listener, fd, message, lambda pid: None), daemon=True).start()
    return listener


@pytest.mark.parametrize(
    ("message", "why"),
    [
        (fd_socket._LENGTH.pack(5) + b"{bad}", r"its header is not JSON \(Expecting property name"),
        (fd_socket.encode({"size": 4096}), r"its header \"{'size': 4096}\" holds no `sizes` list and `meta`"),
    ],
    ids=["not JSON", "another header"],
)
def test_a_same_user_process_that_sends_no_host_copy_is_refused(
    message: bytes, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 41 item 10: a bad header gave a raw `JSONDecodeError`; now the claim names the process and loads its own.

    Control: the same fake owner serving a real header and memfd is attached to.
    """
    key = _key()
    arena = HostArena([4096], pin=False)
    arena.storage.copy_(_pattern(4096, seed=7))
    listener = _fake_owner(key, message, arena.fd)
    try:
        with claim(key) as peer:
            assert not peer.owner
            assert peer.attach(pin=False, timeout=WAIT_S) is None and not peer.owner
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    assert re.search(rf"process {os.getpid()} of this user answers on its address, but {why}", caplog.text)
    assert "Loading a copy of this process's own" in caplog.text

    key = _key()
    listener = _fake_owner(key, fd_socket.encode({"sizes": [4096], "meta": {"seed": 7}}), arena.fd)
    try:
        with claim(key) as peer:
            attached = peer.attach(pin=False, timeout=WAIT_S)
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    assert attached is not None and attached[1] == {"seed": 7} and torch.equal(attached[0].storage, arena.storage)
