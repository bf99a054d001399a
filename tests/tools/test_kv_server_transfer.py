"""examples/kv_offload_server.py --transfer-engine: the server, a real process, registers its pool with a real
engine on 127.0.0.1 (Mooncake's Transfer Engine over TCP with the P2P handshake, or a NIXL agent over UCX), and
this process, the peer, reads and writes the server's pages with its own engine, addressing them only by the
pieces ``GET /transfer`` answers; byte-identical to what the server's ``PUT``/``GET /pages`` hold.

The server runs with ``--transfer-hold-last`` (its testing aid): the engine's registration of the pool's last
chunk waits for SIGUSR1, so the pages past it are refused (409) for as long as the test looks, without a
timing assumption; SIGUSR1 then lets the pool become ready. An engine that cannot load here skips with the
import error, as tests/engines does."""

from __future__ import annotations

import base64
import json
import signal
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import layouts

from ..conftest import needs_mlock
from ..engines.conftest import Buffer, mooncake_engine, needs_mooncake, needs_nixl, nixl_agent
from . import test_kv_server
from .test_kv_server import PAGE_BYTES, READY_TIMEOUT, Server, random_page, run_example, server

example = test_kv_server.example  # its fixture: the example server, imported as a module
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

MiB = 1 << 20
SIZE, CHUNK = 64 * MiB, 4 * MiB  # 128 pages of 512 KiB; 16 registrations, each holding 16 pages' K or V slices
NUM_PAGES, PER_CHUNK = SIZE // PAGE_BYTES, CHUNK // (PAGE_BYTES // 2)
HELD = NUM_PAGES - PER_CHUNK  # pages [HELD, NUM_PAGES) wait for the held registration (V's last chunk)

# The peer's engine moves one piece: (local address, remote address, nbytes) -> moved; made from /transfer's answer.
Mover = Callable[[int, int, int], bool]


class PeerEngine:
    """This process's engine towards the server's: ``connect(answer)`` gives its read and write."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.answer: dict[str, Any] | None = None  # the last /transfer answer (NIXL: the agent to forget)
        self.local = Buffer(SIZE)  # mirrors the pool: a piece lands at its pool offset
        if kind == "mooncake":
            self.engine: Any = mooncake_engine()
            assert self.engine.engine.register_memory(self.local.address, SIZE) == 0
        else:
            self.engine = nixl_agent("peer")
            self.handle = self.engine.agent.register_memory([(self.local.address, SIZE, 0, "")], "DRAM")

    def connect(self, answer: dict[str, Any]) -> tuple[Mover, Mover]:
        if self.kind == "mooncake":
            segment = answer["segment"]
            return (lambda lo, re, n: self.engine.read(segment, lo, re, n) == 0,
                    lambda lo, re, n: self.engine.write(segment, lo, re, n) == 0)  # fmt: skip
        # The metadata lists what the server's agent holds now: loaded again each time (learn drops the old).
        name = self.engine.learn(base64.b64decode(answer["metadata"]), answer["agent"])
        return (lambda lo, re, n: self.engine.transfer("READ", name, lo, re, n) == "DONE",
                lambda lo, re, n: self.engine.transfer("WRITE", name, lo, re, n) == "DONE")  # fmt: skip

    def close(self) -> None:
        if self.kind == "mooncake":
            assert self.engine.engine.unregister_memory(self.local.address) == 0
        else:
            if self.answer is not None:
                self.engine.forget(self.answer["agent"])
            self.engine.agent.deregister_memory(self.handle)


@pytest.fixture
def peer(request: pytest.FixtureRequest) -> Iterator[PeerEngine]:
    engine = PeerEngine(request.param)
    yield engine
    engine.close()


def transfer(srv: Server, first: int, count: int) -> dict[str, Any]:
    got = srv.client.get("/transfer", params={"first": first, "count": count})
    assert got.status_code == 200, got.text
    return dict(got.json())


def split_page(page: bytes, answer: dict[str, Any]) -> list[bytes]:
    """A page as GET /pages answers it, cut into its slice of each run (in run order)."""
    parts, start = [], 0
    for run in answer["runs"]:
        parts.append(page[start : start + run["page_bytes"]])
        start += run["page_bytes"]
    return parts


def page_of(local: Buffer, answer: dict[str, Any], page: int) -> bytes:
    """Page ``page`` as GET /pages answers it, from the pieces that landed at their pool offsets in ``local``."""
    k = page - answer["first"]
    return b"".join(local[r["offset"] + k * r["page_bytes"] : r["offset"] + (k + 1) * r["page_bytes"]]
                    for r in answer["runs"])  # fmt: skip


def read_pages(peer: PeerEngine, srv: Server, first: int, count: int) -> dict[str, Any]:
    """The peer reads pages ``[first, first + count)`` piece by piece; each piece lies in one registration."""
    answer = peer.answer = transfer(srv, first, count)
    assert answer["engine"] == peer.kind and answer["first"] == first and answer["count"] == count
    assert sum(r["page_bytes"] for r in answer["runs"]) == PAGE_BYTES
    assert sum(p["nbytes"] for p in answer["pieces"]) == count * PAGE_BYTES
    read, _ = peer.connect(answer)
    for piece in answer["pieces"]:
        registration = piece["registration"]
        assert registration["offset"] <= piece["offset"]
        assert piece["offset"] + piece["nbytes"] <= registration["offset"] + registration["nbytes"]
        assert piece["address"] - piece["offset"] == registration["address"] - registration["offset"]
        local = peer.local.address + piece["offset"]
        assert read(local, piece["address"], piece["nbytes"]), piece
    return answer


def poll_status(srv: Server, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """/readyz's body once ``until`` holds for it (polled: the pool's progress is the event)."""
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        status = dict(srv.client.get("/readyz").json())
        if until(status):
            return status
        time.sleep(0.01)
    raise AssertionError(f"/readyz never reached the state waited for: {status}")


def serve_pages_through(peer: PeerEngine) -> None:
    with server("--size", "64MiB", "--max-chunk-bytes", "4MiB", "--runtime", "mlock",
                "--transfer-engine", peer.kind, "--transfer-hold-last") as srv:  # fmt: skip
        srv.wait_port()
        # Everything but the held registration: the pool pins on, usable up to the held chunk's pages.
        status = poll_status(srv, lambda s: s["pinned_pages"] >= HELD)
        assert status["state"] == "pinning" and status["pinned_pages"] == HELD, status

        data = {i: random_page(200 + i) for i in range(12, 20)}
        for i, page in data.items():
            assert srv.client.put(f"/pages/{i}", content=page).status_code == 200
        answer = read_pages(peer, srv, 12, 8)  # pages 16.. lie in the next registration, in K and in V
        assert len(answer["pieces"]) == 4 and len({p["registration"]["offset"] for p in answer["pieces"]}) == 4
        for i, page in data.items():
            assert page_of(peer.local, answer, i) == page, i

        # The peer writes page 40 through its engine; the server's GET /pages answers those bytes.
        answer = transfer(srv, 40, 1)
        _, write = peer.connect(answer)
        new = random_page(40)
        for piece, part in zip(answer["pieces"], split_page(new, answer), strict=True):  # a piece per run
            peer.local.map[piece["offset"] : piece["offset"] + piece["nbytes"]] = part
            assert write(peer.local.address + piece["offset"], piece["address"], piece["nbytes"]), piece
        assert srv.client.get("/pages/40").content == new

        # Pages whose registration is held are refused, with how far the pool is usable; bad asks are 400/404.
        for first, count in [(HELD, 1), (HELD - 2, 4), (NUM_PAGES - 1, 1)]:
            refused = srv.client.get("/transfer", params={"first": first, "count": count})
            assert refused.status_code == 409, refused.text
            assert refused.json()["pinned_pages"] == HELD and "not pinned yet" in refused.json()["error"]
        for params in [{"first": "x"}, {"first": -1}, {"first": 0, "count": 0}, {}]:
            assert srv.client.get("/transfer", params=params).status_code == 400, params
        assert srv.client.get("/transfer", params={"first": NUM_PAGES - 1, "count": 2}).status_code == 404

        # Released, the last registration is made and the pool is ready: the last pages are the peer's too.
        last = random_page(NUM_PAGES - 1)
        srv.proc.send_signal(signal.SIGUSR1)
        assert poll_status(srv, lambda s: s["state"] != "pinning")["state"] == "ready"
        assert srv.client.put(f"/pages/{NUM_PAGES - 1}", content=last).status_code == 200
        answer = read_pages(peer, srv, HELD - 1, PER_CHUNK + 1)
        assert page_of(peer.local, answer, NUM_PAGES - 1) == last
        assert page_of(peer.local, answer, HELD - 1) == srv.client.get(f"/pages/{HELD - 1}").content

        rc, _ = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.output
        assert srv.logged_vmlck() == 0, srv.output
        said = [line for line in srv.lines if line.startswith("kv_offload_server: transfer engine")]
        assert len(said) == 2 and said[0].startswith(f"kv_offload_server: transfer engine: {peer.kind} on 127.0.0.1, ")
        assert said[1] == f"kv_offload_server: transfer engine {peer.kind} closed", srv.output
        assert srv.lines.index(said[1]) > srv.lines.index("kv_offload_server: shutdown VmLck=0")  # after the pool


@needs_mlock
@needs_mooncake
@pytest.mark.parametrize("peer", ["mooncake"], indirect=True)
def test_mooncake_peer_reads_and_writes_the_servers_pages(peer: PeerEngine) -> None:
    serve_pages_through(peer)


@needs_mlock
@needs_nixl
@pytest.mark.parametrize("peer", ["nixl"], indirect=True)
def test_nixl_peer_reads_and_writes_the_servers_pages(peer: PeerEngine) -> None:
    serve_pages_through(peer)


@needs_mooncake
@pytest.mark.parametrize("peer", ["mooncake"], indirect=True)
def test_a_failed_pool_still_serves_its_usable_pages_to_a_peer(peer: PeerEngine) -> None:
    """The example's fake-fail runtime fails the pool's third chunk: the server drains, and so does /transfer:
    pages below pinned_pages stay registered with the engine and are answered, the others are refused (503)."""
    with server("--size", "2GiB", "--runtime", "fake-fail", "--transfer-engine", "mooncake") as srv:
        srv.wait_port()
        status = poll_status(srv, lambda s: s["state"] != "pinning")
        assert status["state"] == "failed" and 0 < status["pinned_pages"] < status["num_pages"], status
        answer = peer.answer = transfer(srv, 0, 1)
        read, _ = peer.connect(answer)
        landed = peer.local.address
        for piece in answer["pieces"]:  # one page: each piece lands after the previous one
            assert read(landed, piece["address"], piece["nbytes"]), piece
            landed += piece["nbytes"]
        assert peer.local[0:PAGE_BYTES] == srv.client.get("/pages/0").content
        refused = srv.client.get("/transfer", params={"first": status["pinned_pages"]})
        assert refused.status_code == 503 and "pinning failed" in refused.json()["error"], refused.text
        rc, _ = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.output


@pytest.mark.anyio
async def test_a_server_without_an_engine_answers_404(example: ModuleType) -> None:
    """/transfer says how to get an engine (it answers before the pool is asked anything: never entered here)."""
    layout = layouts.MHA("page_first", layer_num=2, page_size=4, head_num=2, head_dim=8, dtype=torch.bfloat16)
    pool = pinpool.PinnedPool(
        layout=layout, size=layout.page_bytes * 8, runtime=pinpool.testing.FakeRuntime(), registry=None
    )
    app = example.create_app(pool, CollectorRegistry(), torch.device("cpu"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as client:
        got = await client.get("/transfer", params={"first": 0})
    assert got.status_code == 404 and "--transfer-engine mooncake" in json.loads(got.content)["error"]


def test_hold_last_without_an_engine_is_one_line_and_exit_2() -> None:
    done = run_example("--transfer-hold-last", "--size", "8MiB", "--runtime", "mlock")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--transfer-hold-last holds a --transfer-engine registration" in done.stderr, done.stderr
