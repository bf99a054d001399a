"""An elastic pool's reservation (DESIGN-elastic.md): a floor and segments of whole pages whose slices of every
page run are chunked on their buffer's grid, no chunk crossing a segment; each segment's Schedule; and the
ConfigErrors naming the sizes that would do. Made-up grids (hypothesis) and real layouts through plan_pool."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pinpool import ConfigError, layouts
from pinpool._plan import (
    BACKGROUND_MAX_CALL_SECONDS,
    BACKGROUND_PIN_NICE,
    PageRun,
    PoolOptions,
    PrefixTracker,
    RunGrid,
    plan_pool,
    plan_reservation,
    reservation_grids,
    segment_schedule,
)
from pinpool._types import Capabilities, RegistrarLimits
from pinpool.testing import host_facts

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4 * KiB
MLOCK_LIKE = Capabilities(locks_on_fault=True, finds_pinned=True)


def _grids(buffers: list[tuple[int, int, int | None]], num_pages: int) -> tuple[list[RunGrid], list[int]]:
    """Buffers given as (page_runs, bytes per page per run, granularity), placed on OS pages one after another,
    as the placement does; their grids and each buffer's end."""
    grids, ends, offset = [], [], 0
    for index, (runs, page_bytes, granularity) in enumerate(buffers):
        length = num_pages * page_bytes
        for k in range(runs):
            run = PageRun(offset + k * length, offset + (k + 1) * length, page_bytes)
            grids.append(RunGrid(run, f"b{index}", offset, granularity, PAGE))
        ends.append(offset + runs * length)
        offset = -(-(offset + runs * length) // PAGE) * PAGE
    return grids, ends


buffer_st = st.tuples(
    st.integers(1, 3),  # page runs
    st.sampled_from([256, 512, 1000, 1536, 4096, 6144, 12288]),  # bytes of one page in one run
    st.sampled_from([None, 256, 512]),  # granularity (dividing the page's slice or not: the grid decides)
)


@settings(max_examples=80, deadline=None)
@given(
    buffers=st.lists(buffer_st, min_size=1, max_size=3),
    quanta=st.integers(2, 6),
    extra=st.integers(0, 2),
    floor_quanta=st.integers(0, 2),
    step=st.integers(1, 700),
    limit_units=st.integers(1, 8),
)
def test_segments_tile_the_reservation_in_whole_chunks_on_every_grid(
    buffers: list[tuple[int, int, int | None]], quanta: int, extra: int, floor_quanta: int, step: int,
    limit_units: int,
) -> None:  # fmt: skip
    probe, _ = _grids(buffers, 1)
    quantum = math.lcm(*(g.quantum for g in probe))
    num_pages = quanta * quantum + extra  # extra pages: off the grid when a buffer has several runs
    grids, ends = _grids(buffers, num_pages)
    assume(sum(g.run.end - g.run.start for g in grids) <= 2000 * max(g.unit for g in grids))  # a few thousand chunks
    floor = min(floor_quanta, quanta - 1) * quantum
    limit = limit_units * max(g.unit for g in grids)
    off_grid = [g for g in grids if (g.run.start - g.origin) % g.unit]
    if off_grid:
        with pytest.raises(ConfigError, match=rf"reserve a multiple of {quantum} pages"):
            plan_reservation(grids, num_pages, floor_pages=floor, step_pages=step, chunk_limit=limit)
        return
    reservation = plan_reservation(grids, num_pages, floor_pages=floor, step_pages=step, chunk_limit=limit)
    assert reservation.quantum == quantum and reservation.step_pages % quantum == 0
    assert step <= reservation.step_pages < step + quantum
    segments = reservation.segments
    assert segments[0].pages.start == 0 and segments[-1].pages.stop == num_pages
    assert all(a.pages.stop == b.pages.start for a, b in itertools.pairwise(segments))
    assert [s.index for s in segments] == list(range(len(segments)))
    assert [s.floor for s in segments] == [bool(floor) and i == 0 for i in range(len(segments))]
    if floor:
        assert segments[0].pages == range(floor)
    growable = segments[1:] if floor else segments
    assert all(len(s.pages) == reservation.step_pages for s in growable[:-1])
    assert 0 < len(growable[-1].pages) <= reservation.step_pages
    every = [c for s in segments for c in s.chunks]
    assert all(list(s.chunks) == sorted(s.chunks) for s in segments)
    by_offset = sorted(every)
    assert all(a.end <= b.offset for a, b in itertools.pairwise(by_offset))  # disjoint
    assert sum(c.nbytes for c in every) == sum(g.run.end - g.run.start for g in grids)
    for segment in segments:
        assert segment.slices == tuple(g.slice(segment.pages) for g in grids)
        assert segment.nbytes == segment.chunks.nbytes
        for chunk in segment.chunks:
            (grid, (_start, end)), = [
                (g, s) for g, s in zip(grids, segment.slices, strict=True) if s[0] <= chunk.offset < s[1]
            ]  # fmt: skip
            assert chunk.end <= end, "a chunk crosses a segment's slice"
            assert 0 < chunk.nbytes <= limit
            assert (chunk.offset - grid.origin) % grid.unit == 0
            assert (chunk.end - grid.origin) % grid.unit == 0 or chunk.end in ends, "a cut off the buffer's grid"
            for offset in (chunk.offset, chunk.end - 1):
                assert reservation.segment_of(offset) == segment.index
        for page in (segment.pages.start, segment.pages.stop - 1):
            assert reservation.segment_at_page(page) == segment.index
        assert reservation.segments_in(segment.pages) == range(segment.index, segment.index + 1)


def test_sizes_off_the_grid_are_refused_with_the_sizes_that_would_do() -> None:
    grids, _ = _grids([(2, 512, None)], 100)  # 512 B pages in 4 KiB units: 8 pages a quantum; 100 is not
    with pytest.raises(ConfigError, match=r"reserve a multiple of 8 pages \(e\.g\. 96 or 104\)"):
        plan_reservation(grids, 100, floor_pages=8, step_pages=8, chunk_limit=MiB)
    grids, _ = _grids([(2, 512, None)], 104)
    with pytest.raises(ConfigError, match=r"give size= a multiple of 8 pages \(e\.g\. 8 or 16\)"):
        plan_reservation(grids, 104, floor_pages=12, step_pages=8, chunk_limit=MiB)
    with pytest.raises(ConfigError, match=r"nothing is left to grow; give reserve= more than size="):
        plan_reservation(grids, 104, floor_pages=104, step_pages=8, chunk_limit=MiB)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match=r"grow step pages .* must be an int >= 1"):
            plan_reservation(grids, 104, floor_pages=8, step_pages=bad, chunk_limit=MiB)  # type: ignore[arg-type]
    reservation = plan_reservation(grids, 104, floor_pages=8, step_pages=1, chunk_limit=MiB)
    assert reservation.step_pages == 8  # rounded up to whole chunks, not refused
    with pytest.raises(ConfigError, match=r"page 104 is outside the reservation \(pages \[0, 104\)\)"):
        reservation.segment_at_page(104)
    with pytest.raises(ConfigError, match=r"byte 106496 of the pool is in no page run"):
        reservation.segment_of(2 * 104 * 512)


LAYOUTS = [
    layouts.MHA("page_first", 2, 4, 2, 16, torch.float16, v_head_dim=8),
    layouts.MHA("layer_first", 2, 4, 2, 16, torch.float16),
    layouts.Mamba(2, (3, 4), ((5,), (0, 2), (2, 2)), torch.bfloat16),
    layouts.PagedBytes("layer_first", 3, 1000),
    layouts.Raw(),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("registrar", [None, RegistrarLimits(preferred_bytes=64 * KiB, parallel=False)])
def test_each_segment_is_a_schedule_one_engine_session_pins_whole(
    layout: layouts.Layout, registrar: RegistrarLimits | None
) -> None:
    probe = reservation_grids(plan_pool(PoolOptions.create(layout=layout, num_pages=1), host_facts(), MLOCK_LIKE))
    quantum = math.lcm(*(g.quantum for g in probe))
    num_pages, chunk_bytes = 6 * quantum, max(64 * KiB, max(g.unit for g in probe))
    options = PoolOptions.create(layout=layout, num_pages=num_pages, chunk_bytes=chunk_bytes)
    transfers = [] if registrar is None else [("engine", registrar)]
    schedule = plan_pool(options, host_facts(), MLOCK_LIKE, transfers=transfers)
    reservation = plan_reservation(
        reservation_grids(schedule), num_pages, floor_pages=quantum, step_pages=2 * quantum - 1,
        chunk_limit=schedule.chunk_limit,
    )  # fmt: skip
    assert [s.pages for s in reservation.segments] == [
        range(0, quantum), range(quantum, 3 * quantum), range(3 * quantum, 5 * quantum), range(5 * quantum, num_pages)
    ]  # fmt: skip
    assert sum(s.nbytes for s in reservation.segments) == schedule.nbytes
    for segment in reservation.segments:
        part = segment_schedule(schedule, reservation, segment.index)
        assert part.num_pages == len(segment.pages) and part.nbytes == segment.nbytes
        assert part.chunks == segment.chunks and sorted(part.pin_chunks) == list(segment.chunks)
        assert part.chunk_bytes <= chunk_bytes and part.chunk_limit == schedule.chunk_limit
        assert part.buffers == schedule.buffers and part.mapping_bytes == schedule.mapping_bytes
        if part.spans:
            assert part.spans.nbytes == segment.nbytes and 1 <= part.populate_workers <= len(part.spans)
        assert 1 <= part.register_workers <= len(part.chunks) and part.threads >= 1
        # The session's prefix reads the segment's pages: all of them once every chunk is pinned, none before.
        prefix = PrefixTracker(part.page_runs, part.num_pages)
        assert prefix.pages == 0
        for chunk in part.pin_chunks:
            prefix.cover(chunk.offset, chunk.end)
        assert prefix.pages == len(segment.pages)
        if registrar is None:
            assert part.transfers == () and part.transfer_workers == 0
            continue
        (plan,) = part.transfers
        assert plan.registrations.nbytes == segment.nbytes and part.transfer_workers == 1
        edges = {c.offset for c in segment.chunks} | {c.end for c in segment.chunks}
        for registration in plan.registrations:  # runs of whole chunks of this segment: never straddling
            assert registration.offset in edges and registration.end in edges
            assert reservation.segment_of(registration.offset) == segment.index
            assert reservation.segment_of(registration.end - 1) == segment.index


def test_layouts_that_cannot_grow_in_pages_are_refused() -> None:
    per_buffer = plan_pool(PoolOptions.create(size=4 * MiB, chunk_bytes="buffer"), host_facts(), MLOCK_LIKE)
    with pytest.raises(ConfigError, match=r"registered in one call that is never cut \(chunk_bytes='buffer'\)"):
        reservation_grids(per_buffer)
    schedule = plan_pool(PoolOptions.create(size=4 * MiB), host_facts(), MLOCK_LIKE)
    unordered = PageRun(0, 4 * MiB, None)
    with pytest.raises(ConfigError, match=r"does not keep its pages in page order"):
        reservation_grids(dataclasses.replace(schedule, page_runs=(unordered,)))


@pytest.mark.parametrize(
    ("given", "grows_with"),
    [
        ({}, (BACKGROUND_MAX_CALL_SECONDS, None, BACKGROUND_PIN_NICE)),  # "auto": a background pool's
        ({"pin_nice": 0}, (BACKGROUND_MAX_CALL_SECONDS, None, 0)),
        ({"pin_nice": None, "max_call_seconds": None}, (None, None, 0)),
        ({"max_call_seconds": 0.2, "pin_nice": 3}, (0.2, None, 3)),
        ({"max_chunk_bytes": 1 << 20}, (BACKGROUND_MAX_CALL_SECONDS, "max_chunk_bytes", BACKGROUND_PIN_NICE)),
    ],
)
def test_a_grow_pins_with_the_options_given_and_auto_as_a_background_pool(given: dict, grows_with: tuple) -> None:
    # The floor of a foreground pool pins with no budget at nice 0 either way; only "auto" becomes the background's.
    options = PoolOptions.create(size=1 << 20, reserve=8 << 20, **given)
    grow = options.growing()
    assert (grow.max_call_seconds, grow.budget_yields_to, grow.pin_nice) == grows_with
    assert grow.background and not options.background
