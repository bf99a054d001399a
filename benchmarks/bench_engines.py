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

Three sides, read alike: a plain buffer registered whole (as servers do today), a plain buffer registered
in the pool's registrations (the same cuts without pinpool: an engine may read a few large registrations at
another rate than one huge one, and this tells that apart from pinpool's own cost), and the pool. The same
reader buffer; the bytes cut into 64 MiB reads (and at registration boundaries: ``pool.transfer_pieces``);
Mooncake one synchronous read per piece, NIXL one request of every piece (as a server batches a page run).
One warm-up read of each is discarded; then each rep reads all three, each case first in turn. The plain
buffers are faulted, written and, where this process may, mlock'ed (as the pool's pages are).
Benchmark code: pinpool's public API only."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import statistics
import time
import uuid
from typing import Any

import pinpool
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar, TransferRegistrar

PIECE = 64 << 20  # one descriptor per 64 MiB, alike for every side
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
        """Nothing to load: Mooncake's reader fetches the server's segment (its registrations) at its first read,
        which comes after every registration here, and keeps it."""

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


class Plain:
    """A plain buffer as servers register theirs by hand: faulted, written, mlock'ed where this process may (the
    pool's pages are; over UCX's shared-memory path a locked buffer reads about 1.2x faster than an unlocked
    one here, which would credit pinning to pinpool), and served as the given ``(offset, nbytes)`` spans."""

    LIBC = ctypes.CDLL(None, use_errno=True)

    def __init__(self, pair: Mooncake | Nixl, size: int, spans: list[tuple[int, int]]) -> None:
        self.pair, self.size = pair, size
        self.map = mmap.mmap(-1, size)
        self.ptr = address(self.map)
        ctypes.memset(self.ptr, 0x5A, size)
        self.locked = self.LIBC.mlock(ctypes.c_void_p(self.ptr), ctypes.c_size_t(size)) == 0
        self.served = [pair.serve(self.ptr + offset, nbytes) for offset, nbytes in spans]
        self.pieces = cut(self.ptr, size, [offset for offset, _ in spans])

    def close(self) -> None:
        for handle in self.served:
            self.pair.unserve(handle)
        if self.locked:
            self.LIBC.munlock(ctypes.c_void_p(self.ptr), ctypes.c_size_t(self.size))
        self.map.close()


def cut(base: int, size: int, starts: list[int]) -> list[tuple[int, int]]:
    """``size`` bytes at ``base`` in PIECE reads, each also cut where a registration starts."""
    bounds = sorted({*range(0, size, PIECE), *starts, size})
    return [(base + lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]


CASES = ("plain buffer", "plain, the pool's registrations", "pinpool pool")


def read_throughput(
    engine: str, size: int, reps: int, *, runtime: str, transport: str, host: str, device: str
) -> dict[str, Any]:
    """One engine's read rate of a pool's pages through its pieces; of a plain buffer of the same size registered
    whole; and of one registered in the pool's registrations (the same cuts, without pinpool)."""
    if transport == "rdma" and not rdma_devices():
        # Checked here, not left to the engines: Mooncake 0.3.13 given "rdma" on a host without a NIC logs
        # "Found 0 HCAs" and serves over TCP, so its figures would be TCP's under an RDMA label.
        raise SystemExit("--transport rdma: no RDMA device in /sys/class/infiniband; use --transport tcp")
    pair: Mooncake | Nixl = Mooncake(transport, host, device) if engine == "mooncake" else Nixl(transport)
    local = mmap.mmap(-1, size)
    local_ptr = address(local)
    attached = pair.attach(local_ptr, size)
    whole = Plain(pair, size, [(0, size)])
    rates: dict[str, list[float]] = {name: [] for name in CASES}

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
        held = [(r.offset, r.nbytes) for r in pool.transfer_registrations(registrar)]
        ctypes.memset(pool.data_ptr, 0x5A, size)  # the same bytes on every side, written by this process
        split = Plain(pair, size, held)
        pieces = dict(zip(CASES, (whole.pieces, split.pieces, pool_pieces), strict=True))
        pair.connect()
        try:
            for name in CASES:  # warm-up, discarded: faults the reader's buffer, sets up connections
                rate(pieces[name])
            for rep in range(reps):  # each case first in turn: a rep's first read may run colder
                for name in CASES[rep % 3 :] + CASES[: rep % 3]:
                    rates[name].append(rate(pieces[name]))
        finally:
            pair.disconnect()
            split.close()
    whole.close()
    pair.detach(attached)
    local.close()
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {"engine": pair.label, "transport": transport, "rdma_devices": rdma_devices(),
            "plain_locked": whole.locked and split.locked, "median_bytes_per_second": median, "runs": rates,
            "pieces": {name: len(p) for name, p in pieces.items()}, "pool_registrations": len(held),
            "ratio": median["pinpool pool"] / median["plain buffer"],
            "ratio_same_registrations": median["pinpool pool"] / median["plain, the pool's registrations"]}  # fmt: skip
