"""The real transfer engines on loopback: Mooncake's Transfer Engine (TCP transport, peer-to-peer handshake)
and NIXL agents (UCX), two of each in this process, and helpers that move bytes between them.

An engine that cannot load here (no ``libibverbs.so.1``, the package not installed) skips its tests with the
import error's text; nothing here is a stand-in. Mooncake's engines live for the session (one takes about a second
to tear down), NIXL's agents for a module (UCX's progress thread keeps a CPU busy while one lives); tests leave
nothing registered (each unregisters what it registered, and checks it)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import signal
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

HOST = "127.0.0.1"
KiB, MiB = 1 << 10, 1 << 20
READER_BYTES = 32 * MiB  # a reader's buffer mirrors a served pool (pieces land at their pool offsets): larger

# Mooncake 0.3.13.post1's TCP transport pools its connections to a peer; a transfer the peer refuses (these
# tests make many: straddles, closed pools) leaves a connection the peer closed in the pool, and a later,
# valid transfer on it fails (rc -1), one in two or three after a refusal here. A connection per transfer
# keeps every answer the peer's own. Read when an engine starts; child processes inherit it.
os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "0")


_FATAL = (signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT)


@contextmanager
def keeping_fatal_handlers() -> Iterator[None]:
    """Mooncake's extension installs its own SIGSEGV, SIGBUS and SIGFPE handlers when it loads (glog's),
    over faulthandler's, in whatever process imports it: here every pytest worker, whose forked children
    (crash tests expect a SIGBUS death) inherit them. Each C handler is put back as it was."""
    libc = ctypes.CDLL(None, use_errno=True)
    saved = {sig: ctypes.create_string_buffer(256) for sig in _FATAL}  # struct sigaction: 152 bytes on x86_64
    for sig, old in saved.items():
        assert libc.sigaction(sig, None, old) == 0, ctypes.get_errno()
    try:
        yield
    finally:
        for sig, old in saved.items():
            assert libc.sigaction(sig, old, None) == 0, ctypes.get_errno()


def _import_error(module: str) -> str | None:
    try:
        with keeping_fatal_handlers():
            __import__(module)
    except ImportError as exc:  # libibverbs.so.1 missing, or the engine not installed: skip, with why
        return f"{module} cannot load here: {exc}"
    return None


MOONCAKE_MISSING = _import_error("mooncake.engine")
NIXL_MISSING = _import_error("nixl_cu12._api")
needs_mooncake = pytest.mark.skipif(MOONCAKE_MISSING is not None, reason=MOONCAKE_MISSING or "")
needs_nixl = pytest.mark.skipif(NIXL_MISSING is not None, reason=NIXL_MISSING or "")


class Buffer:
    """Anonymous mmap'd memory (page-aligned, as a server's host pool is) and its address."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.nbytes = nbytes
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))

    def fill(self, seed: int) -> None:
        self.map[:] = pattern(self.nbytes, seed)

    def __getitem__(self, span: slice) -> bytes:
        return self.map[span]


def pattern(nbytes: int, seed: int) -> bytes:
    """Bytes no two offsets (within 251 bytes) or seeds repeat: a misplaced or stale byte shows."""
    one = bytes((i * 7 + seed) % 251 for i in range(251))
    return (one * (nbytes // 251 + 1))[:nbytes]


def bytes_at(address: int, nbytes: int) -> bytes:
    return ctypes.string_at(address, nbytes)


# -- Mooncake ------------------------------------------------------------------------------------------------


@dataclass
class MooncakeEngine:
    """An initialized TransferEngine (TCP, P2P handshake) and the segment name peers address it by."""

    engine: Any

    @property
    def segment(self) -> str:
        return f"{HOST}:{self.engine.get_rpc_port()}"

    def read(self, peer: str, local: int, remote: int, nbytes: int) -> int:
        """``nbytes`` from ``remote`` in ``peer``'s memory to ``local``: Mooncake's rc (0, or -1 rejected)."""
        return int(self.engine.transfer_sync_read(peer, local, remote, nbytes))

    def write(self, peer: str, local: int, remote: int, nbytes: int) -> int:
        return int(self.engine.transfer_sync_write(peer, local, remote, nbytes))


def mooncake_engine() -> MooncakeEngine:
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    with keeping_fatal_handlers():
        rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    assert rc == 0, f"TransferEngine.initialize({HOST!r}, 'P2PHANDSHAKE', 'tcp', '') returned {rc}"
    return MooncakeEngine(engine)


@pytest.fixture(scope="session")
def mooncake_pair() -> tuple[MooncakeEngine, MooncakeEngine]:
    """Two engines in this process: the first serves memory, the second reads and writes it."""
    if MOONCAKE_MISSING:
        pytest.skip(MOONCAKE_MISSING)
    return mooncake_engine(), mooncake_engine()


@pytest.fixture
def reader_buffer(mooncake_pair: tuple[MooncakeEngine, MooncakeEngine]) -> Iterator[Buffer]:
    """32 MiB the reading engine moves bytes through, registered with it by hand (as a peer's own pool is)."""
    reader = mooncake_pair[1].engine
    buf = Buffer(READER_BYTES)
    assert reader.register_memory(buf.address, buf.nbytes) == 0
    yield buf
    assert reader.unregister_memory(buf.address) == 0


# -- NIXL ----------------------------------------------------------------------------------------------------


@dataclass
class NixlAgent:
    """A NIXL agent (UCX backend) and, for a reader, the transfers it starts towards its peer."""

    agent: Any
    peers: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return str(self.agent.name)

    def learn(self, metadata: bytes, peer: str) -> str:
        """Load ``peer``'s metadata as it is now: after it registers more or lets go, a peer addresses only what
        the metadata it loaded lists. A second add_remote_agent merges into what was loaded (a let-go range
        stays addressable), so what was loaded of ``peer`` is dropped first."""
        if peer in self.peers:
            self.agent.remove_remote_agent(peer)
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        assert name == peer, f"the metadata is {name!r}'s, not {peer!r}'s"
        self.peers.add(name)
        return name

    def forget(self, peer: str) -> None:
        """Drop what was loaded of ``peer`` (a process that exits): UCX would otherwise keep reconnecting to it."""
        if peer in self.peers:
            self.peers.discard(peer)
            self.agent.remove_remote_agent(peer)

    def transfer(self, op: str, peer: str, local: int, remote: int, nbytes: int) -> str:
        """One READ or WRITE of ``nbytes``: "DONE", or the error as its NIXL class name (a straddling or
        unregistered remote range is refused when the transfer is made: nixlNotFoundError)."""
        return self.transfers(op, peer, [(local, remote, nbytes)])

    def transfers(self, op: str, peer: str, pieces: list[tuple[int, int, int]]) -> str:
        """One request of several descriptors ``(local, remote, nbytes)``, as a server batches a page run."""
        agent = self.agent
        local = agent.get_xfer_descs([(lo, n, 0) for lo, _, n in pieces], "DRAM")
        remote = agent.get_xfer_descs([(ro, n, 0) for _, ro, n in pieces], "DRAM")
        try:
            handle = agent.initialize_xfer(op, local, remote, peer)
        except Exception as exc:
            return type(exc).__name__
        try:
            state = agent.transfer(handle)
            while state == "PROC":  # UCX moves the bytes on its progress thread; this waits for its answer
                state = agent.check_xfer_state(handle)
            return str(state)
        finally:
            agent.release_xfer_handle(handle)


def nixl_agent(role: str) -> NixlAgent:
    from nixl_cu12._api import nixl_agent as make_agent
    from nixl_cu12._api import nixl_agent_config

    return NixlAgent(make_agent(f"pinpool-{role}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"])))


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[tuple[NixlAgent, NixlAgent]]:
    """Two agents in this process: the first serves memory, the second reads and writes it. Let go after the
    module: UCX's progress thread keeps a CPU busy for as long as an agent lives (the rest of ./dev test's)."""
    if NIXL_MISSING:
        pytest.skip(NIXL_MISSING)
    pair = [nixl_agent("server"), nixl_agent("reader")]
    yield pair[0], pair[1]
    pair.clear()
    gc.collect()


@pytest.fixture
def nixl_reader_buffer(nixl_pair: tuple[NixlAgent, NixlAgent]) -> Iterator[Buffer]:
    """32 MiB registered with the reading agent by hand (NIXL transfers only between registered memory)."""
    reader = nixl_pair[1].agent
    buf = Buffer(READER_BYTES)
    handle = reader.register_memory([(buf.address, buf.nbytes, 0, "")], "DRAM")
    yield buf
    reader.deregister_memory(handle)
