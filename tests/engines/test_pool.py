"""A pool registered with a real engine: the pieces ``pool.transfer_pieces`` gives a peer engine read and
write byte for byte, for every layout family pinpool has, page runs that cross chunk (and so registration)
boundaries included; the same bytes read as one descriptor across a boundary are refused, which is what the
pieces are for; and once the pool closes the engine holds none of it."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import pinpool
from pinpool import layouts
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar, TransferPiece, TransferRegistrar

from ..conftest import needs_mlock
from ..layout_zoo import LAYOUTS, layout_id
from .conftest import Buffer, KiB, MiB, MooncakeEngine, NixlAgent, bytes_at, needs_mooncake, needs_nixl, pattern

pytestmark = needs_mlock


def small_pool(layout: layouts.Layout, registrar: TransferRegistrar, **options: Any) -> pinpool.PinnedPool:
    """About 16 chunks of at least 256 KiB each, aligned to the layout's copy pages and the OS page: many
    registrations, a pool of a few MiB (at most 16, the reader's buffer)."""
    grains = [spec.granularity for spec in layout.buffers(1) if spec.granularity]
    unit = math.lcm(4 * KiB, *grains)
    chunk = unit * -(-256 * KiB // unit)
    size = min(16 * chunk, 14 * MiB)
    return pinpool.PinnedPool(
        layout=layout, size=size, runtime="mlock", chunk_bytes=chunk, registrars=[registrar], registry=None, **options
    )


def page_runs_to_try(pool: pinpool.PinnedPool) -> list[range]:
    """Every page; a run around each chunk boundary the first buffer has; the last page alone."""
    n, first_run = pool.num_pages, pool.transfer_pieces(pool.plan.transfers[0].name, pages=range(0, 1))[0]
    runs = [range(0, n), range(n - 1, n)]
    page_bytes = pool.plan.page_bytes
    per_page = max(1, first_run.nbytes)  # bytes one page has in the first span
    for chunk in pool.plan.chunks[1:4]:
        page = (chunk.offset - first_run.offset) // per_page
        if 0 < page < n - 1 and page_bytes:
            runs.append(range(page - 1, min(n, page + 2)))
    return runs


class Peer:
    """The other engine, by what the tests need of it: move one range, say whether the engine refused."""

    def __init__(self, read: Callable[[int, int, int], bool], write: Callable[[int, int, int], bool]) -> None:
        self.read, self.write = read, write


@contextmanager
def mooncake_peer(pair: tuple[MooncakeEngine, MooncakeEngine], local: Buffer) -> Iterator[Peer]:
    server, reader = pair
    yield Peer(
        lambda lo, remote, n: reader.read(server.segment, lo, remote, n) == 0,
        lambda lo, remote, n: reader.write(server.segment, lo, remote, n) == 0,
    )


@contextmanager
def nixl_peer(pair: tuple[NixlAgent, NixlAgent], local: Buffer) -> Iterator[Peer]:
    server, reader = pair
    peer = reader.learn(server.agent.get_agent_metadata(), server.name)  # after the pool registered
    yield Peer(
        lambda lo, remote, n: reader.transfer("READ", peer, lo, remote, n) == "DONE",
        lambda lo, remote, n: reader.transfer("WRITE", peer, lo, remote, n) == "DONE",
    )


def check_pieces(pool: pinpool.PinnedPool, name: str, pages: range, pieces: tuple[TransferPiece, ...]) -> None:
    """The pieces are the run's bytes in every buffer, in order, each inside its registration."""
    assert sum(p.nbytes for p in pieces) == len(pages) * pool.plan.page_bytes
    for piece in pieces:
        registration = piece.registration
        assert registration.registrar == name
        assert registration.offset <= piece.offset < piece.end <= registration.end
        assert piece.address == pool.data_ptr + piece.offset


def exercise(pool: pinpool.PinnedPool, registrar: TransferRegistrar, peer: Peer, local: Buffer) -> None:
    held = pool.transfer_registrations(registrar)
    (plan,) = [plan for plan in pool.plan.transfers if plan.name == registrar.name]
    assert len(held) == len(plan.registrations) >= 2
    for registration in held:  # the pool's bytes: a pattern that tells every offset apart
        seed = registration.offset % 251
        ctypes.memmove(registration.address, pattern(registration.nbytes, seed), registration.nbytes)
    crossed = False
    for pages in page_runs_to_try(pool):
        pieces = pool.transfer_pieces(registrar, pages=pages)
        check_pieces(pool, registrar.name, pages, pieces)
        spans = pool.transfer_pieces(registrar.name, pages=pages)  # by name: the same pieces
        assert spans == pieces
        crossed |= len({p.registration.offset for p in pieces}) > 1
        for piece in pieces:  # the reader's buffer mirrors the pool: piece at its own offset
            assert peer.read(local.address + piece.offset, piece.address, piece.nbytes), piece
            assert local[piece.offset : piece.end] == bytes_at(piece.address, piece.nbytes), piece
    assert crossed, "no page run crossed a registration boundary: the test proves nothing about cutting"
    # Written back through the engine: a new pattern over every page's bytes lands where the pieces say.
    pieces = pool.transfer_pieces(registrar, pages=range(0, pool.num_pages))
    for piece in pieces:
        local.map[piece.offset : piece.end] = pattern(piece.nbytes, seed=(piece.offset + 7) % 251)
        assert peer.write(local.address + piece.offset, piece.address, piece.nbytes), piece
        assert bytes_at(piece.address, piece.nbytes) == local[piece.offset : piece.end], piece
    # The pieces matter: two neighbours' bytes as one descriptor straddle their registrations and are refused.
    first, second = held[0], held[1]
    assert second.offset == first.end  # neighbours: the 8 KiB below are half in each
    start = first.end - 4 * KiB
    assert not peer.read(local.address, pool.data_ptr + start, 8 * KiB)


@needs_mooncake
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_mooncake_reads_and_writes_a_pools_pieces(
    layout: layouts.Layout, mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer
) -> None:
    engine = mooncake_pair[0].engine
    registrar = MooncakeRegistrar(engine, protocol="tcp")
    pool = small_pool(layout, registrar)
    with pool, mooncake_peer(mooncake_pair, reader_buffer) as peer:
        held = pool.transfer_registrations(registrar)
        exercise(pool, registrar, peer, reader_buffer)
    # Closed: the engine holds nothing of it (its answer to every registration's base: not registered), and
    # the peer is refused.
    assert [engine.unregister_memory(r.address) for r in held] == [-3] * len(held)
    assert mooncake_pair[1].read(mooncake_pair[0].segment, reader_buffer.address, held[0].address, 4 * KiB) == -1


# Every layout through Mooncake above; through NIXL one of each family (./dev test's time: the cut is
# pinpool's, the same for every engine).
FAMILIES = list({type(layout).__name__: layout for layout in reversed(LAYOUTS)}.values())


@needs_nixl
@pytest.mark.parametrize("layout", FAMILIES, ids=layout_id)
def test_nixl_reads_and_writes_a_pools_pieces(
    layout: layouts.Layout, nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer
) -> None:
    server, reader = nixl_pair
    registrar = NixlRegistrar(server.agent)
    pool = small_pool(layout, registrar)
    with pool:
        with nixl_peer(nixl_pair, nixl_reader_buffer) as peer:
            held = pool.transfer_registrations(registrar)
            exercise(pool, registrar, peer, nixl_reader_buffer)
    # Closed: the agent holds none of it, and a peer that learns its metadata now cannot address it.
    for r in held:
        with pytest.raises(Exception, match="NIXL_ERR_NOT_FOUND"):
            server.agent.deregister_memory(server.agent.get_reg_descs([(r.address, r.nbytes, 0, "")], "DRAM"))
    peer = reader.learn(server.agent.get_agent_metadata(), server.name)
    assert reader.transfer("READ", peer, nixl_reader_buffer.address, held[0].address, 4 * KiB) == "nixlNotFoundError"


@needs_mooncake
@needs_nixl
def test_one_pool_two_engines(
    mooncake_pair: tuple[MooncakeEngine, MooncakeEngine], reader_buffer: Buffer,
    nixl_pair: tuple[NixlAgent, NixlAgent], nixl_reader_buffer: Buffer,
) -> None:  # fmt: skip
    """Both registrars on one pool: each engine serves the pool's pages, each cut at its own registrations."""
    mooncake = MooncakeRegistrar(mooncake_pair[0].engine, protocol="tcp", preferred_bytes=MiB)
    nixl = NixlRegistrar(nixl_pair[0].agent)
    layout = layouts.MHA("page_first", 2, 16, 4, 32, torch.bfloat16)
    pool = pinpool.PinnedPool(
        layout=layout, size=8 * MiB, runtime="mlock", chunk_bytes=256 * KiB, registrars=[mooncake, nixl], registry=None
    )
    with pool:
        assert len(pool.transfer_registrations(mooncake)) < len(pool.transfer_registrations(nixl))  # joined to 1 MiB
        with mooncake_peer(mooncake_pair, reader_buffer) as peer:
            exercise(pool, mooncake, peer, reader_buffer)
        with nixl_peer(nixl_pair, nixl_reader_buffer) as peer:
            exercise(pool, nixl, peer, nixl_reader_buffer)
