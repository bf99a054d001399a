"""An elastic pool of every layout, with real mlock and a transfer registrar: each segment grown is whole copy
pages pinned by the runtime and held by the registrar (every usable page's bytes, in every buffer, inside one
registration of each), pages not grown are refused to a transfer, a shrink gives back only its segment's bytes
(they read zero; the floor's and the other segment's keep theirs), and the exit leaves nothing."""

from __future__ import annotations

import ctypes
import math

import pytest

import pinpool
from pinpool import layouts
from pinpool._plan import PoolOptions, plan_pool, reservation_grids
from pinpool._ranges import PINNED_RANGES
from pinpool.registrars import TransferPiece
from pinpool.testing import FakeRegistrar, assert_released, host_facts, locked_bytes

from ..conftest import needs_mlock
from ..core.test_reservation import MLOCK_LIKE
from ..layout_zoo import LAYOUTS, layout_id

pytestmark = needs_mlock

KiB = 1 << 10


def pieces(pool: pinpool.PinnedPool, registrar: FakeRegistrar, run: range) -> tuple[TransferPiece, ...]:
    """The run's pieces, each inside one registration of the registrar's and pinned by the runtime's chunks."""
    found = pool.transfer_pieces(registrar, pages=run)
    assert sum(p.nbytes for p in found) == len(run) * pool.plan.page_bytes
    chunks = pool.registrations
    for piece in found:
        assert piece.registration.offset <= piece.offset < piece.end <= piece.registration.end
        covered = sum(
            min(c.end, piece.end) - max(c.offset, piece.offset)
            for c in chunks
            if c.offset < piece.end and piece.offset < c.end
        )
        assert covered == piece.nbytes, f"{piece} is not all pinned"
    return found


def fill(found: tuple[TransferPiece, ...], value: int) -> None:
    for piece in found:
        ctypes.memset(piece.address, value, piece.nbytes)


def count(found: tuple[TransferPiece, ...], value: int) -> int:
    return sum(ctypes.string_at(p.address, p.nbytes).count(value) for p in found)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_every_layout_grows_and_shrinks_in_whole_copy_pages(layout: layouts.Layout) -> None:
    grains = [spec.granularity for spec in layout.buffers(1) if spec.granularity]
    chunk = math.lcm(4 * KiB, *grains) * 4
    one_page = math.lcm(*grains) if isinstance(layout, layouts.Raw) else 1  # a raw page is a byte
    probe = plan_pool(
        PoolOptions.create(layout=layout, num_pages=one_page, chunk_bytes=chunk), host_facts(), MLOCK_LIKE
    )
    quantum = math.lcm(*(grid.quantum for grid in reservation_grids(probe)))  # pages of whole chunks everywhere
    page_bytes = probe.page_bytes
    registrar = FakeRegistrar(preferred_bytes=2 * chunk)  # runs of chunks, never across a segment
    before, claims = locked_bytes(), PINNED_RANGES.snapshot()
    pool = pinpool.PinnedPool(
        layout=layout, num_pages=quantum, reserve=5 * quantum * page_bytes, grow_step=quantum * page_bytes,
        chunk_bytes=chunk, runtime="mlock", registrars=[registrar], registry=None,
    )  # fmt: skip
    with pool:
        (floor,) = pool.pinned_runs
        assert floor.start == 0 and 0 < floor.stop < pool.reserved_pages
        first = pool.grow_sync(pages=1).pages
        second = pool.grow_sync(pages=1).pages
        assert first[0].start == floor.stop and second[0].start == first[-1].stop
        assert pool.pinned_runs == (range(0, second[-1].stop),)
        assert locked_bytes() - before == pool.pinned_bytes == sum(c.nbytes for c in pool.registrations)
        assert sum(registrar.registered.values()) == pool.pinned_bytes  # the registrar holds what is pinned
        floor_bytes, first_bytes, second_bytes = (pieces(pool, registrar, r) for r in (floor, *first, *second))
        fill(floor_bytes, 1), fill(first_bytes, 2), fill(second_bytes, 3)
        if second[-1].stop < pool.reserved_pages:
            with pytest.raises(pinpool.PoolStateError, match="not registered with 'fake-engine' now"):
                pool.transfer_pieces(registrar, pages=range(second[-1].stop, second[-1].stop + 1))
        shrunk = pool.shrink_sync(pages=list(first))
        assert shrunk.released == first and shrunk.unreturned == ()
        assert pool.pinned_runs == (floor, *second)
        assert count(first_bytes, 0) == sum(p.nbytes for p in first_bytes)  # given back: reads zero
        assert count(floor_bytes, 1) == sum(p.nbytes for p in floor_bytes)
        assert count(second_bytes, 3) == sum(p.nbytes for p in second_bytes)
        assert locked_bytes() - before == pool.pinned_bytes == sum(registrar.registered.values())
        with pytest.raises(pinpool.PoolStateError, match="not registered with 'fake-engine' now"):
            pool.transfer_pieces(registrar, pages=first[0])
    assert registrar.registered == {}
    assert_released(pool, claims_before=claims, locked_before=before)
