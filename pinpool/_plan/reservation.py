"""An elastic pool's reservation (DESIGN-elastic.md): its largest size, mapped once, cut into a floor (pinned
at entry, kept until exit) and segments that grow and shrink whole, one engine session each. A segment is
layout pages ``[a, b)``: its slice of every page run, each chunked on its buffer's grid like every other
chunk, so no chunk (and no registrar's registration) crosses a segment. Pure arithmetic over a Schedule."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Sequence

from .._errors import ConfigError
from .._units import format_bytes
from .chunks import ChunkTable, Order, SpanTable
from .options import PoolOptions
from .plan import LOOKAHEAD_CHUNKS, MAX_TRANSFER_WORKERS, Schedule, plan_chunks
from .prefix import PageRun, pin_order
from .segments import Reservation, RunGrid, Segment
from .transfers import plan_transfer


def reservation_grids(schedule: Schedule) -> tuple[RunGrid, ...]:
    """Each page run of ``schedule`` with its buffer's grid; :class:`ConfigError` where a buffer cannot grow in
    pages (pages out of page order, one registration per buffer, holes of pin())."""
    buffers = [b for b in schedule.buffers if b.plan is not None]
    offsets = [b.offset for b in buffers]
    grids: list[RunGrid] = []
    for run in sorted(schedule.page_runs, key=lambda r: r.start):
        buffer = buffers[bisect.bisect_right(offsets, run.start) - 1]
        plan, name = buffer.plan, buffer.spec.name
        assert plan is not None
        if run.page_bytes is None or run.holes:
            raise ConfigError(
                f"buffer {name!r} does not keep its pages in page order (its layout gives no page runs), so an "
                "elastic pool could not make some pages usable without all: drop reserve= (a fixed or background "
                "pool), or use a layout whose buffers have page_runs"
            )
        if plan.origin is None:
            raise ConfigError(
                f"buffer {name!r} is registered in one call that is never cut (chunk_bytes='buffer'), and an "
                "elastic pool pins and releases whole chunks of some pages: drop chunk_bytes='buffer', or reserve="
            )
        grids.append(RunGrid(run, name, buffer.offset + plan.origin, plan.granularity, plan.page_size))
    return tuple(grids)


def plan_reservation(
    grids: Sequence[RunGrid], num_pages: int, *, floor_pages: int, step_pages: int, chunk_limit: int
) -> Reservation:
    """Cut ``num_pages`` into a floor and segments of ``step_pages`` rounded up to whole quanta, each run's slice
    of each chunked within ``chunk_limit``; :class:`ConfigError` naming the nearest sizes that would do."""
    for what, value, least in (("reserved pages", num_pages, 1), ("floor pages", floor_pages, 0),
                               ("grow step pages", step_pages, 1)):  # fmt: skip
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ConfigError(f"{what} {value!r} must be an int >= {least}")
    if floor_pages >= num_pages:
        raise ConfigError(
            f"reserve= holds {num_pages} pages and size= pins {floor_pages} at entry: nothing is left to grow; "
            "give reserve= more than size=, or drop reserve= for a fixed pool"
        )
    if not grids:
        raise ConfigError("an elastic pool needs at least one buffer with pages: give a layout with bytes")
    grids = tuple(sorted(grids, key=lambda grid: grid.run.start))
    quantum = math.lcm(*(grid.quantum for grid in grids))
    for grid in grids:
        if (grid.run.start - grid.origin) % grid.unit:
            raise ConfigError(
                f"reserve= of {num_pages} pages: buffer {grid.buffer!r}'s page run at byte {grid.run.start} does "
                f"not start on a whole chunk boundary (multiples of {format_bytes(grid.unit)}), so its first "
                f"pages would share a chunk with another run's last ones; reserve a multiple of {quantum} pages "
                f"(e.g. {_nearest(num_pages, quantum)})"
            )
    if floor_pages % quantum:
        raise ConfigError(
            f"size= pins {floor_pages} pages, but an elastic pool's floor must end on a whole chunk in every buffer: "
            f"give size= a multiple of {quantum} pages (e.g. {_nearest(floor_pages, quantum)})"
        )
    step = -(-step_pages // quantum) * quantum  # grow_step= is rounded up to whole chunks, never refused
    bounds = [0, *([floor_pages] if floor_pages else []), *range(floor_pages + step, num_pages, step), num_pages]
    segments = tuple(
        _segment(index, range(lo, hi), grids, chunk_limit, floor=bool(floor_pages) and index == 0)
        for index, (lo, hi) in enumerate(itertools.pairwise(bounds))
    )
    return Reservation(num_pages, floor_pages, step, quantum, grids, segments)


def _nearest(pages: int, quantum: int) -> str:
    down, up = pages // quantum * quantum, -(-pages // quantum) * quantum
    return f"{up}" if down == 0 else f"{down} or {up}"


def _segment(index: int, pages: range, grids: Sequence[RunGrid], limit: int, *, floor: bool) -> Segment:
    slices = tuple(grid.slice(pages) for grid in grids)
    chunks = ChunkTable.concat(
        plan_chunks(end - start, granularity=grid.granularity, limit=limit, page_size=grid.page_size)
        .chunks.shifted(start)
        for grid, (start, end) in zip(grids, slices, strict=True)
    )  # fmt: skip
    return Segment(index, pages, slices, chunks, floor)


def segment_schedule(schedule: Schedule, reservation: Reservation, index: int) -> Schedule:
    """The Schedule one engine session pins segment ``index`` with: the reservation's, over the segment's chunks
    (its buffers, hence the retry grid, stay the reservation's; every count clipped to the segment)."""
    segment = reservation.segments[index]
    slices = zip(reservation.grids, segment.slices, strict=True)
    runs = tuple(PageRun(start, end, grid.page_bytes) for grid, (start, end) in slices)
    chunks = segment.chunks
    chunk_bytes = max((chunk.nbytes for chunk in chunks), default=0)
    pin_chunks = pin_order(chunks, runs)
    spans = SpanTable(pin_chunks, schedule.span_bytes) if schedule.span_bytes else ()
    populate_workers = min(schedule.populate_workers, len(spans))
    register_workers = max(1, min(schedule.register_workers, len(chunks)))
    transfers = tuple(
        plan_transfer(t.name, t.limits, chunks, schedule.page_size,
                      workers=register_workers if t.limits.parallel else 1)
        for t in schedule.transfers
    )  # fmt: skip
    transfer_workers = min(MAX_TRANSFER_WORKERS, sum(t.workers for t in transfers))
    pair = (populate_workers, register_workers)
    pinning = sum(pair) if schedule.order is Order.POPULATE_FIRST else max(pair)
    span_bytes = schedule.span_bytes
    return dataclasses.replace(
        schedule, nbytes=segment.nbytes, num_pages=len(segment.pages), chunks=chunks, chunk_bytes=chunk_bytes,
        register_workers=register_workers, populate_workers=populate_workers,
        unpin_workers=max(1, min(schedule.unpin_workers, len(chunks))), threads=pinning + transfer_workers,
        transfers=transfers, transfer_workers=transfer_workers, spans=spans, pin_chunks=pin_chunks, page_runs=runs,
        lookahead_bytes=max(2 * chunk_bytes, populate_workers * min(span_bytes, chunk_bytes * LOOKAHEAD_CHUNKS)),
        registrations_reason=f"{len(chunks)} registrations: pages [{segment.pages.start}, {segment.pages.stop}) "
        f"of the reservation, each run's slice chunked within {format_bytes(schedule.chunk_limit)}",
    )  # fmt: skip


def pool_reservation(options: PoolOptions, schedule: Schedule) -> Reservation:
    """The reservation of an elastic pool whose ``schedule`` was planned from ``options.reservation()``: size=
    (or num_pages=) is the floor, grow_step= the segments."""
    page_bytes = options.layout.page_bytes
    floor = options.num_pages if options.num_pages is not None else options.size // page_bytes
    step = max(1, options.grow_step // page_bytes)
    return plan_reservation(
        reservation_grids(schedule), schedule.num_pages, floor_pages=floor, step_pages=step,
        chunk_limit=schedule.chunk_limit,
    )  # fmt: skip
