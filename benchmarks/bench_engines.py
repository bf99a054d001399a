"""The real transfer engines' read throughput of a pinpool pool's pages against the same engine reading a plain
buffer of the same size, for ``bench_registrars.py --engines``.

Each engine runs as two peers in this process: a *server* that holds the memory (the pool, registered through
its registrar, and a plain buffer registered by hand, as servers do today) and a *reader* that pulls it into a
buffer of its own. Two transports:

- ``tcp`` (this repository's CI and dev VMs): Mooncake's Transfer Engine over TCP on loopback (P2P handshake),
  and NIXL's UCX backend with UCX's own choice of transport (on a host without a NIC: ``tcp/lo`` and ``cma``).
- ``rdma`` (a host with a NIC in /sys/class/infiniband): Mooncake with protocol ``rdma`` (``device`` names the
  NICs, empty: every one it discovers), and NIXL's UCX restricted to ``UCX_TLS=rc`` unless you set it, so the
  two agents in one process go through the NIC (loopback on the HCA) rather than shared memory. Both engines'
  registrations are then ``ibv_reg_mr``: pinned pages (the registrars are told so).

Both sides of a ratio are read alike: the same reader buffer, the bytes cut into 64 MiB reads (the pool's
additionally cut at its registration boundaries by ``pool.transfer_pieces``), Mooncake one synchronous read
per piece, NIXL one request of every piece (as a server batches a page run). One warm-up read of each is
discarded (it faults the reader's buffer and sets up connections); then reps alternate plain, pool and
pool, plain. The plain buffer is faulted and, where this process may, mlock'ed (as the pool's pages are).
Benchmark code: pinpool's public API only."""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import time
import uuid
from typing import Any

import pinpool
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar, TransferRegistrar

PIECE = 64 << 20  # one descriptor per 64 MiB, alike for both sides
ENGINES = ("mooncake", "nixl")
TRANSPORTS = ("tcp", "rdma")


def address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class Mooncake:
    """Two Mooncake Transfer Engines: ``server`` serves memory, ``reader`` reads it."""

    def __init__(self, transport: str, host: str, device: str) -> None:
        # A pooled TCP connection the peer closed is reused and fails (tests/engines/conftest.py): one per read.
        os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "0")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise SystemExit(f"--engines mooncake: the engine cannot load here: {exc}") from exc
        self.protocol = transport

        def engine() -> Any:
            te = TransferEngine()
            rc = te.initialize(host, "P2PHANDSHAKE", self.protocol, device)
            if rc != 0:
                raise SystemExit(
                    f"mooncake: TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', {self.protocol!r}, {device!r}) "
                    f"returned {rc}"
                )
            return te

        self.server, self.reader = engine(), engine()
        self.peer = f"{host}:{self.server.get_rpc_port()}"
        self.label = f"Mooncake {self.protocol}"

    def registrar(self) -> TransferRegistrar:
        return MooncakeRegistrar(self.server, protocol=self.protocol)

    def serve(self, ptr: int, nbytes: int) -> object:
        rc = self.server.register_memory(ptr, nbytes)
        if rc != 0:
            raise SystemExit(f"mooncake: register_memory of the plain buffer returned {rc}")
        return ptr

    def unserve(self, handle: object) -> None:
        rc = self.server.unregister_memory(handle)
        if rc != 0:
            raise SystemExit(f"mooncake: unregister_memory of the plain buffer returned {rc}")

    def attach(self, ptr: int, nbytes: int) -> object:
        rc = self.reader.register_memory(ptr, nbytes)
        if rc != 0:
            raise SystemExit(f"mooncake: register_memory of the reader's buffer returned {rc}")
        return ptr

    def detach(self, handle: object) -> None:
        self.reader.unregister_memory(handle)

    def connect(self) -> None:
        """Mooncake's reader asks the server's segment at each read: nothing to load."""

    def disconnect(self) -> None:
        """Nothing loaded (see connect)."""

    def read(self, local: int, pieces: list[tuple[int, int]]) -> None:
        done = 0
        for remote, nbytes in pieces:
            rc = self.reader.transfer_sync_read(self.peer, local + done, remote, nbytes)
            if rc != 0:
                raise SystemExit(f"mooncake: transfer_sync_read of {nbytes} bytes at {remote:#x} returned {rc}")
            done += nbytes


class Nixl:
    """Two NIXL agents (UCX backend): ``server`` serves memory, ``reader`` reads it."""

    def __init__(self, transport: str) -> None:
        if transport == "rdma":  # read when UCX's context is created: before the first agent
            os.environ.setdefault("UCX_TLS", "rc")
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise SystemExit(f"--engines nixl: NIXL cannot load here: {exc}") from exc

        def agent(role: str) -> Any:
            return nixl_agent(f"bench-{role}-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))

        self.pins = transport == "rdma"  # UCX's ucp_mem_map over rc is ibv_reg_mr; over tcp/shm it pins nothing
        self.server, self.reader = agent("server"), agent("reader")
        self.peer = ""
        self.label = f"NIXL UCX ({os.environ.get('UCX_TLS', 'UCX_TLS unset: UCX chooses')})"

    def registrar(self) -> TransferRegistrar:
        return NixlRegistrar(self.server, backends=["UCX"], pins_pages=self.pins)

    def serve(self, ptr: int, nbytes: int) -> object:
        return self.server.register_memory([(ptr, nbytes, 0, "")], "DRAM")

    def unserve(self, handle: object) -> None:
        self.server.deregister_memory(handle)

    def attach(self, ptr: int, nbytes: int) -> object:
        return self.reader.register_memory([(ptr, nbytes, 0, "")], "DRAM")

    def detach(self, handle: object) -> None:
        self.reader.deregister_memory(handle)

    def connect(self) -> None:
        """A NIXL peer addresses only what the metadata it loaded lists: loaded once both buffers are served."""
        name = self.reader.add_remote_agent(self.server.get_agent_metadata())
        self.peer = name.decode() if isinstance(name, bytes) else str(name)

    def disconnect(self) -> None:
        self.reader.remove_remote_agent(self.peer)

    def read(self, local: int, pieces: list[tuple[int, int]]) -> None:
        offsets, done = [], 0
        for _, nbytes in pieces:
            offsets.append(local + done)
            done += nbytes
        mine = self.reader.get_xfer_descs([(lo, n, 0) for lo, (_, n) in zip(offsets, pieces, strict=True)], "DRAM")
        theirs = self.reader.get_xfer_descs([(remote, n, 0) for remote, n in pieces], "DRAM")
        handle = self.reader.initialize_xfer("READ", mine, theirs, self.peer)
        try:
            state = self.reader.transfer(handle)
            while state == "PROC":  # UCX moves the bytes on its progress thread: wait for its answer
                state = self.reader.check_xfer_state(handle)
            if state != "DONE":
                raise SystemExit(f"nixl: a READ of {len(pieces)} descriptors ended {state!r}")
        finally:
            self.reader.release_xfer_handle(handle)


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except FileNotFoundError:
        return []


def read_throughput(
    engine: str, size: int, reps: int, *, runtime: str, transport: str, host: str, device: str
) -> dict[str, Any]:
    """One engine's read rate of a pool's pages through its pieces, and of a plain buffer of the same size."""
    if transport == "rdma" and not rdma_devices():
        # Checked here, not left to the engines: Mooncake 0.3.13 given "rdma" on a host without a NIC logs
        # "Found 0 HCAs" and serves over TCP, so its figures would be TCP's under an RDMA label.
        raise SystemExit("--transport rdma: no RDMA device in /sys/class/infiniband; use --transport tcp")
    pair: Mooncake | Nixl = Mooncake(transport, host, device) if engine == "mooncake" else Nixl(transport)
    local, plain = mmap.mmap(-1, size), mmap.mmap(-1, size)
    local_ptr, plain_ptr = address(local), address(plain)
    ctypes.memset(plain_ptr, 0x5A, size)  # faulted before it is served, as the pool's pages are
    # ... and locked as the pool's are, where this process may: over UCX's shared-memory path (cma) a locked
    # buffer reads about 1.2x faster than a faulted, unlocked one here, which would credit pinning to pinpool.
    libc = ctypes.CDLL(None, use_errno=True)
    plain_locked = libc.mlock(ctypes.c_void_p(plain_ptr), ctypes.c_size_t(size)) == 0
    attached, served = pair.attach(local_ptr, size), pair.serve(plain_ptr, size)
    plain_pieces = [(plain_ptr + off, min(PIECE, size - off)) for off in range(0, size, PIECE)]
    rates: dict[str, list[float]] = {"plain buffer": [], "pinpool pool": []}

    def rate(pieces: list[tuple[int, int]]) -> float:
        started = time.perf_counter()
        pair.read(local_ptr, pieces)
        return size / (time.perf_counter() - started)

    registrar = pair.registrar()
    with pinpool.PinnedPool(size=size, runtime=runtime, registry=None, registrars=[registrar]) as pool:
        pool_pieces = [
            (p.address, p.nbytes)
            for off in range(0, size, PIECE)
            for p in pool.transfer_pieces(registrar, offset=off, nbytes=min(PIECE, size - off))
        ]
        registrations = len(pool.transfer_registrations(registrar))
        ctypes.memset(pool.data_ptr, 0x5A, size)  # the same bytes on both sides, written by this process
        pair.connect()
        try:
            rate(plain_pieces), rate(pool_pieces)  # warm-up, discarded
            for rep in range(reps):  # ABBA: neither side always reads first (a rep's first read runs colder)
                for name in ("plain buffer", "pinpool pool")[:: 1 if rep % 2 == 0 else -1]:
                    rates[name].append(rate(plain_pieces if name == "plain buffer" else pool_pieces))
        finally:
            pair.disconnect()
    pair.unserve(served)
    pair.detach(attached)
    if plain_locked:
        libc.munlock(ctypes.c_void_p(plain_ptr), ctypes.c_size_t(size))
    local.close()
    plain.close()
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {"engine": pair.label, "transport": transport, "rdma_devices": rdma_devices(),
            "plain_locked": plain_locked, "median_bytes_per_second": median, "runs": rates,
            "pieces": {"plain buffer": len(plain_pieces), "pinpool pool": len(pool_pieces)},
            "pool_registrations": registrations,
            "ratio": median["pinpool pool"] / median["plain buffer"]}  # fmt: skip
