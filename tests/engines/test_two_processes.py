"""Two processes, two real engines on 127.0.0.1: process A (serve_pool.py, a child) opens a pool registered with
Mooncake's Transfer Engine or a NIXL agent and fills its pages; this process, B, reads and writes those pages
through its own engine, byte-identical, addressing them only by the pieces A's pool gives. Also while A pins
in the background (B reads only the pages A reports usable; A refuses pieces of the others), and after A's
pool closes (B's reads are refused, A's engine holds nothing of the pool)."""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from .. import preloaded
from ..conftest import needs_mlock
from .conftest import Buffer, MooncakeEngine, NixlAgent, needs_mooncake, needs_nixl

pytestmark = needs_mlock

SERVE = str(Path(__file__).with_name("serve_pool.py"))
ANSWER_SECONDS = 120  # a guard against a hung child, not a measurement: A answers in milliseconds


class ProcessA:
    """The child serving a pool, spoken to one JSON line each way."""

    def __init__(self, child: Any) -> None:
        self.child = child
        self.stdin: IO[str] = child.stdin
        self.stdout: IO[str] = child.stdout

    def read(self) -> dict[str, Any]:
        while True:
            ready, _, _ = select.select([self.stdout], [], [], ANSWER_SECONDS)
            assert ready, f"process A said nothing for {ANSWER_SECONDS} s"
            line = self.stdout.readline()
            assert line, f"process A exited ({self.child.poll()}) without answering"
            if line.startswith("A> "):  # NIXL's own log lines share A's stdout
                return dict(json.loads(line[3:]))

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        self.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.stdin.flush()
        return self.read()

    def pieces(self, pages: range) -> list[tuple[int, int, int, str]]:
        answer = self.ask("pieces", start=pages.start, stop=pages.stop)
        assert "pieces" in answer, answer
        return [tuple(p) for p in answer["pieces"]]  # type: ignore[misc]


@contextmanager
def process_a(engine: str, mode: str) -> Iterator[tuple[ProcessA, dict[str, Any]]]:
    child = preloaded.spawn(
        [sys.executable, SERVE, engine, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    with child:
        a = ProcessA(child)
        opened = a.read()
        assert opened["event"] == "open", opened
        yield a, opened
        a.stdin.write(json.dumps({"op": "exit"}) + "\n")
        a.stdin.close()
        assert child.wait(ANSWER_SECONDS) == 0


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Peer:
    """B's engine towards A: read or write one piece, True if the engine moved it."""

    def __init__(self, read: Callable[[int, int, int], bool], write: Callable[[int, int, int], bool]) -> None:
        self.read, self.write = read, write


def mooncake_peer(reader: MooncakeEngine, segment: str) -> Peer:
    return Peer(
        lambda local, remote, n: reader.read(segment, local, remote, n) == 0,
        lambda local, remote, n: reader.write(segment, local, remote, n) == 0,
    )


def agent_name(metadata: bytes) -> str:
    field = metadata.split(b"|Agent", 1)[1]  # nixlSerDes: "Agent", the name's length (8 bytes), the name
    return field[8 : 8 + int.from_bytes(field[:8], "little")].decode()


@contextmanager
def nixl_process_a(reader: NixlAgent, mode: str) -> Iterator[tuple[ProcessA, dict[str, Any]]]:
    """Process A serving with NIXL; B's agent forgets it once it exited."""
    with process_a("nixl", mode) as (a, opened):
        try:
            yield a, opened
        finally:
            reader.forget(agent_name(bytes.fromhex(opened["peer"])))


def nixl_peer(reader: NixlAgent, metadata_hex: str) -> Peer:
    metadata = bytes.fromhex(metadata_hex)
    name = agent_name(metadata)
    reader.learn(metadata, name)
    return Peer(
        lambda local, remote, n: reader.transfer("READ", name, local, remote, n) == "DONE",
        lambda local, remote, n: reader.transfer("WRITE", name, local, remote, n) == "DONE",
    )


def read_pages(a: ProcessA, peer: Peer, local: Buffer, pages: range) -> int:
    """B reads ``pages`` piece by piece into ``local`` (each piece at its pool offset): byte-identical to A's
    bytes (their digests). Returns how many pieces, so a caller can see a page run crossed registrations."""
    pieces = a.pieces(pages)
    for offset, address, nbytes, theirs in pieces:
        assert peer.read(local.address + offset, address, nbytes), (offset, nbytes)
        assert digest(local[offset : offset + nbytes]) == theirs, (offset, nbytes)
    return len(pieces)


def write_pages(a: ProcessA, peer: Peer, local: Buffer, pages: range) -> None:
    """B writes new bytes over ``pages``; A's memory then holds exactly them."""
    for offset, address, nbytes, _ in a.pieces(pages):
        local.map[offset : offset + nbytes] = os.urandom(nbytes)
        assert peer.write(local.address + offset, address, nbytes), (offset, nbytes)
    for offset, _, nbytes, theirs in a.pieces(pages):
        assert digest(local[offset : offset + nbytes]) == theirs, (offset, nbytes)


def serve_and_check(a: ProcessA, opened: dict[str, Any], connect: Callable[[str], Peer], local: Buffer) -> None:
    n = opened["num_pages"]
    ready = a.ask("ready")
    assert ready["pages"] == n
    peer = connect(ready["peer"])
    assert read_pages(a, peer, local, range(0, n)) == 24  # one piece per 1 MiB registration
    per_chunk = (1 << 20) // opened["page_bytes"]
    crossing = range(per_chunk - 3, 2 * per_chunk + 3)  # three registrations
    assert read_pages(a, peer, local, crossing) == 3
    write_pages(a, peer, local, crossing)
    write_pages(a, peer, local, range(n - 1, n))


def close_and_check(a: ProcessA, refused: Callable[[str, int], bool]) -> None:
    """A closes its pool: its engine then holds none of the pool's registrations, and B is refused."""
    first = a.pieces(range(0, 1))[0]
    closed = a.ask("close")
    assert closed["state"] == "closed" and closed["had"] == 24
    assert closed["held"] == []  # A's engine answered "not registered" for every registration the pool had
    assert refused(closed["peer"], first[1])


@needs_mooncake
def test_mooncake_serves_a_pool_to_another_process(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    reader = mooncake_pair[1]
    with process_a("mooncake", "foreground") as (a, opened):
        serve_and_check(a, opened, lambda segment: mooncake_peer(reader, segment), reader_buffer)
        local = reader_buffer.address
        close_and_check(a, lambda segment, address: reader.read(segment, local, address, 4096) == -1)


@needs_nixl
def test_nixl_serves_a_pool_to_another_process(
    nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer
) -> None:
    reader = nixl_pair[1]

    def refused(metadata_hex: str, address: int) -> bool:
        # B learns A's metadata as it is after the close: it lists no registration, so B cannot address any.
        return not nixl_peer(reader, metadata_hex).read(nixl_reader_buffer.address, address, 4096)

    with nixl_process_a(reader, "foreground") as (a, opened):
        serve_and_check(a, opened, lambda metadata: nixl_peer(reader, metadata), nixl_reader_buffer)
        close_and_check(a, refused)


def background_check(a: ProcessA, opened: dict[str, Any], connect: Callable[[str], Peer], local: Buffer) -> None:
    """A's last registration waits at its registrar's gate: B reads the pages A reports usable, is refused
    pieces of the others, and reads everything once A lets the registration through."""
    n, per_chunk = opened["num_pages"], (1 << 20) // opened["page_bytes"]
    assert a.ask("wait", fraction=0.5)["pages"] >= n // 2
    ready = a.ask("ready")
    usable = ready["pages"]
    assert n // 2 <= usable <= n - per_chunk  # the last chunk's pages wait for its registration
    peer = connect(ready["peer"])
    assert read_pages(a, peer, local, range(0, usable)) == -(-usable // per_chunk)  # one piece per registration
    # The held registration's pages: refused, whatever else landed meanwhile (pages past `usable` may have).
    refused = a.ask("pieces", start=n - 1, stop=n)
    assert refused.get("error") == "PoolStateError", refused
    assert f"bytes [{(n - per_chunk) * opened['page_bytes']}, " in refused["message"]
    assert a.ask("release") == {"released": True}
    assert a.ask("wait", fraction=1.0)["pages"] == n
    ready = a.ask("ready")
    peer = connect(ready["peer"])  # NIXL: A's metadata now lists the second half too
    assert read_pages(a, peer, local, range(0, n)) == 24
    write_pages(a, peer, local, range(usable - 2, usable + 2))


@needs_mooncake
def test_mooncake_serves_a_pool_pinning_in_the_background(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    reader = mooncake_pair[1]
    with process_a("mooncake", "background") as (a, opened):
        background_check(a, opened, lambda segment: mooncake_peer(reader, segment), reader_buffer)
        local = reader_buffer.address
        close_and_check(a, lambda segment, address: reader.read(segment, local, address, 4096) == -1)


@needs_nixl
def test_nixl_serves_a_pool_pinning_in_the_background(
    nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer
) -> None:
    reader = nixl_pair[1]
    with nixl_process_a(reader, "background") as (a, opened):
        background_check(a, opened, lambda metadata: nixl_peer(reader, metadata), nixl_reader_buffer)
        local = nixl_reader_buffer.address
        close_and_check(a, lambda metadata, address: not nixl_peer(reader, metadata).read(local, address, 4096))


@needs_mooncake
def test_mooncake_reads_fail_cleanly_once_process_a_is_gone(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    reader = mooncake_pair[1]
    with process_a("mooncake", "foreground") as (a, _):
        segment = a.ask("ready")["peer"]
        _, address, nbytes, _ = a.pieces(range(0, 1))[0]
        assert mooncake_peer(reader, segment).read(reader_buffer.address, address, nbytes)
    # A exited (its pool closed at exit): its port is closed, B's engine answers -1, and B goes on.
    assert reader.read(segment, reader_buffer.address, address, nbytes) == -1
