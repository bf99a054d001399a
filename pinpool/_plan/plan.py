"""The plan: pure arithmetic over options, :class:`HostFacts` and :class:`Capabilities` deciding chunks,
workers, pipeline order, spans and lookahead before anything is mapped (property-tested on made-up hosts):
a :class:`Schedule` the pipeline reads, whose :class:`PoolPlan` (what users act on) is ``pool.plan``."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .._errors import ConfigError
from .._types import Capabilities, RegistrarLimits
from .._units import bytes_text, format_bytes, hugetlb_page_size
from ..layouts._spec import BufferSpec, positive_int
from .calls import RetryGrid, RetrySplitter, duty_cycle
from .chunks import ChunkPlan, ChunkTable, Order, Span, SpanTable
from .options import CHUNK_ENV, DEFAULT_CHUNK_GIB
from .prefix import PageRun, page_runs, pin_order
from .preflight import Placement, place
from .transfers import TransferPlan, bound_by_registrars, plan_transfer

if TYPE_CHECKING:
    from .facts import HostFacts
    from .options import PoolOptions
    from .segments import Reservation


def plan_chunks(
    nbytes: int, *, granularity: int | None, limit: int, page_size: int, start: int = 0,
    shared_boundary_pages: bool = False,
) -> ChunkPlan:  # fmt: skip
    """Split ``nbytes`` into contiguous chunks of at most ``limit`` on multiples of ``granularity`` and of
    ``page_size``, counted from ``start`` (the address modulo the page). Where none falls on a page, a
    ``ConfigError`` unless ``shared_boundary_pages``: then chunks share pages (docs/concepts.md, pinpool.pin)."""
    _check_chunk_arguments(nbytes, granularity, limit, page_size)
    unit = math.lcm(granularity or 1, page_size)
    misalignment = start % page_size
    aligned = _aligned_boundary(granularity or 1, page_size, misalignment, unit)
    origin = aligned if aligned is not None else (0 if shared_boundary_pages else None)
    whole = ChunkPlan(nbytes, granularity, page_size, limit, unit, nbytes, ChunkTable([(0, nbytes, 1)]), origin)
    if granularity is None and nbytes <= limit:
        return whole
    if unit > limit:
        raise _unit_over_limit(granularity, page_size, unit, limit)
    if nbytes <= limit:
        # Fits one call: still cut in chunk_bytes steps, unless they fall inside pages nobody may share.
        if misalignment and not shared_boundary_pages:
            return whole
        first = 0
    elif origin is None:
        raise _no_aligned_boundary(granularity or 1, misalignment)
    else:
        first = origin
    chunk_bytes = (limit // unit) * unit
    # An unaligned start: the first chunk is cut short to reach an aligned boundary (first <= unit <= limit).
    head = first + (limit - first) // unit * unit if first else 0
    # Runs, never listed: a plan of 2**35 chunks is three runs (a short head, full chunks, a tail).
    full, tail = divmod(nbytes - head, chunk_bytes)
    chunks = ChunkTable(
        [(0, head, 1 if head else 0), (head, chunk_bytes, full), (head + full * chunk_bytes, tail, 1 if tail else 0)]
    )
    shared = bool(misalignment) and not first and len(chunks) > 1  # boundaries inside OS pages
    return ChunkPlan(nbytes, granularity, page_size, limit, unit, min(chunk_bytes, nbytes), chunks, origin, shared)


def _check_chunk_arguments(nbytes: int, granularity: int | None, limit: int, page_size: int) -> None:
    for what, value in (("buffer size", nbytes), ("page size", page_size), ("chunk limit", limit)):
        if not positive_int(value):
            raise ConfigError(f"{what} {value!r} must be a positive integer number of bytes")
    if granularity is not None and not positive_int(granularity):
        raise ConfigError(
            f"registration granularity {granularity!r} must be a positive integer number of bytes "
            "(the byte size of one copy page); use None for no alignment constraint"
        )


def _unit_over_limit(granularity: int | None, page_size: int, unit: int, limit: int) -> ConfigError:
    what = (
        f"lcm(granularity {granularity} B, OS page {page_size} B) = {format_bytes(unit)}"
        if granularity is not None
        else f"the OS page ({page_size} B)"
    )
    return ConfigError(
        f"{what} is larger than the chunk limit {format_bytes(limit)} ({limit} B): no chunk could hold "
        f"one aligned unit; raise chunk_bytes= or {CHUNK_ENV} to at least {unit} bytes ({format_bytes(unit)}), "
        "or max_chunk_bytes= where that sets the limit"
    )


def _aligned_boundary(granularity: int, page_size: int, misalignment: int, unit: int) -> int | None:
    """The smallest B > 0 with B % granularity == 0 and (misalignment + B) % page_size == 0; 0 if
    aligned; None if there is none (solvable iff gcd(granularity, page) divides the misalignment)."""
    if misalignment == 0:
        return 0
    step = math.gcd(granularity, page_size)
    if misalignment % step:
        return None
    period = page_size // step  # > 1 here: step divides the misalignment, which the page does not
    k = (-(misalignment // step) * pow(granularity // step, -1, period)) % period  # in [1, period)
    boundary = k * granularity
    assert 0 < boundary <= unit and (misalignment + boundary) % page_size == 0
    return boundary


def _no_aligned_boundary(granularity: int, misalignment: int) -> ConfigError:
    return ConfigError(
        f"a buffer starting {misalignment} B into an OS page can never be split at a multiple of its "
        f"granularity ({granularity} B) that is also a page boundary, and this runtime does not track "
        "registrations by exact byte range (Capabilities.exact_ranges), so two chunks may not share a page; "
        "allocate it page-aligned (pinpool.empty(...), or let PinnedPool allocate), "
        "or give chunk_bytes >= its size for a single registration"
    )


# -- the pool plan ------------------------------------------------------------------------------

MAX_DEFAULT_WORKERS = 8
MAX_DEFAULT_POPULATE_WORKERS = 16
MAX_TRANSFER_WORKERS = 8
TRANSFER_CHUNKS = 16  # with registrars, the default plan splits a pool into about this many chunks,
MIN_TRANSFER_CHUNK_BYTES = 64 << 20  # none smaller than this
MIN_PARALLEL_CHUNK_BYTES = 1 << 30  # the default limit's split for workers: smaller chunks only add calls
CHUNKS_PER_WORKER = 4
MAX_SPAN_BYTES = 512 << 20  # what one populate call holds mmap_lock for, at most
LOOKAHEAD_CHUNKS = 64  # per populate worker, when chunks are smaller than a span
MIN_SPAN_BYTES = 16 << 20
# Below ~256 MiB a worker saves little and costs a thread start and GIL contention.
MIN_BYTES_PER_DEFAULT_WORKER = 256 << 20


def pool_cpus(cpu_budget: int, *, background: bool) -> int:
    """The CPUs default worker counts are sized to: a background pool leaves its server one CPU."""
    return max(1, cpu_budget - 1) if background else max(1, cpu_budget)


def default_populate_workers(cpus: int) -> int:
    return max(1, min(MAX_DEFAULT_POPULATE_WORKERS, cpus))


def span_bytes_for(chunk_bytes: int, populate_workers: int, align: int) -> int:
    """Each populate worker gets a share of a chunk, within [MIN_SPAN_BYTES, MAX_SPAN_BYTES], aligned."""
    share = -(-chunk_bytes // max(1, populate_workers))
    span = min(MAX_SPAN_BYTES, max(MIN_SPAN_BYTES, share))
    return -(-span // align) * align


def parallel_limit(options: PoolOptions, nbytes: int, workers: int) -> int:
    """The default chunk limit split so ``workers`` get CHUNKS_PER_WORKER chunks each, not below 1 GiB.
    Explicit limits ask for exact or fewest calls (on ROCm each registration is a device alias of its own)."""
    if workers <= 1 or options.chunk_bytes is not None or options.max_chunk_bytes is not None:
        return options.chunk_limit
    share = -(-nbytes // (workers * CHUNKS_PER_WORKER))
    return min(options.chunk_limit, max(MIN_PARALLEL_CHUNK_BYTES, share))


@dataclass(frozen=True)
class BufferPlan:
    """Where one layout buffer sits in the pool's mapping, and how it is chunked."""

    spec: BufferSpec
    offset: int  # bytes from the start of the mapping
    plan: ChunkPlan | None  # None for a zero-byte buffer: nothing to register
    chunks: ChunkTable  # its chunks, offsets relative to the mapping


@dataclass(frozen=True)
class SourceRanges:
    """What :func:`pinpool.pin` registers of a strided view or ``ranges=``: sorted, disjoint ranges from
    the first one's start (``first`` bytes into the tensor); ``run``: its pages, the gaps its holes."""

    ranges: tuple[tuple[int, int], ...]
    extent: int
    run: PageRun
    first: int


@dataclass(frozen=True)
class PoolPlan:
    """What users act on of what was decided before anything is mapped: ``pool.plan`` (bytes; offsets from
    the pool's start). Each field is in docs/quickstart.md, "What a pool tells you"."""

    nbytes: int  # the bytes the pool holds (all buffers)
    num_pages: int
    page_bytes: int  # one layout page, across all buffers
    chunks: ChunkTable  # one registration call each, contiguous, covering the pool
    chunk_bytes: int  # the largest chunk
    chunk_limit: int  # the per-call limit (chunk_bytes= or PINPOOL_REGISTER_CHUNK_GB or 256 GiB)
    granularity: int | None  # the buffers' common granularity, None when none or several
    order: Order
    populate: bool
    huge_pages: bool | str
    numa_node: int | None
    register_workers: int
    populate_workers: int
    unpin_workers: int
    threads: int  # worker threads pinning starts (each takes either role; with registrars, theirs too)
    transfers: tuple[TransferPlan, ...] = field(default=(), kw_only=True)  # each registrar's registrations
    # An elastic pool's (reserve=): the floor and segments the pages above it grow and shrink in; None: fixed.
    reservation: Reservation | None = field(default=None, kw_only=True)


@dataclass(frozen=True)
class Schedule(PoolPlan):
    """The plan and how the pipeline carries it out; users see only :attr:`public`: no API to the schedule."""

    page_size: int  # the page chunks are aligned to: the OS page, or the hugetlb page with huge_pages="hugetlb..."
    align: int  # buffer placement alignment: the OS page, or the huge page with huge_pages
    source_start: int  # the memory's start modulo the OS page (non-zero only for a caller's tensor)
    buffers: tuple[BufferPlan, ...]
    mapping_bytes: int  # bytes to map: every buffer, each start aligned to ``align``
    cpu_budget: int  # the host's CPU budget the default worker counts were sized from (HostFacts.cpu_budget)
    cpu_quota: float | None  # the CPU quota in CPUs that bounded it, None without one
    duty_cycle: float  # the share of their time pin workers spend in calls (1: no rest; see _plan/calls.py)
    span_bytes: int  # 0 without pre-faulting
    spans: Sequence[Span]  # pin_chunks cut into populate calls (a SpanTable), or () without pre-faulting
    lookahead_bytes: int
    pin_chunks: ChunkTable  # the chunks in pin order: the page prefix grows early (_plan/prefix.py)
    page_runs: tuple[PageRun, ...]
    registrations_reason: str
    transfer_workers: int = 0  # threads that only make transfer registrars' calls (the last of ``threads``)

    @functools.cached_property
    def public(self) -> PoolPlan:
        """The :class:`PoolPlan` users read: ``pool.plan``."""
        return PoolPlan(**{field.name: getattr(self, field.name) for field in dataclasses.fields(PoolPlan)})


def plan_pool(
    options: PoolOptions, host: HostFacts, caps: Capabilities, *, source_start: int = 0,
    placement: Placement | None = None, ranges: SourceRanges | None = None,
    transfers: Sequence[tuple[str, RegistrarLimits]] = (),
) -> Schedule:  # fmt: skip
    """Plan a pool (:class:`ConfigError` for what cannot be). ``placement``: the caller's, checked (else
    placed here); ``ranges``: each becomes a buffer, so no chunk crosses a gap between ranges; ``transfers``:
    each registrar's name and limits (chunks within every ``max_bytes``, registrations runs of chunks)."""
    asked, options = options, bound_by_registrars(options, transfers)
    where = placement or place(options, host)
    populate = _resolve_populate(options, host, caps)
    order = _order(populate, options.huge_pages, caps)
    # Boundaries on whole hugetlb pages (faulted, pinned and freed whole; no retry could split one).
    page_size = hugetlb_page_size(options.huge_pages) or host.page_size
    placed = list(zip(where.specs, where.offsets, strict=True))
    if ranges is not None:
        placed = _range_buffers(placed, ranges, source_start, page_size, caps)
    total = sum(spec.nbytes for spec, _ in placed)
    wanted_register, wanted_populate = _wanted_workers(options, host, caps, total, populate)
    limit = options.chunk_limit
    workers = max(wanted_register, wanted_populate)
    split_limit = parallel = parallel_limit(options, total, workers)
    if transfers and options.chunk_bytes is None and options.max_chunk_bytes is None:
        # Registrars register a chunk once it is pinned: with enough chunks only the last one's call is not hidden.
        split_limit = min(split_limit, max(MIN_TRANSFER_CHUNK_BYTES, -(-total // TRANSFER_CHUNKS)))
    buffers = tuple(
        _buffer_plan(spec, offset, options, caps, page_size, source_start, split_limit) for spec, offset in placed
    )
    chunks = ChunkTable.concat(b.chunks for b in buffers)
    chunk_bytes = max((b.plan.chunk_bytes for b in buffers if b.plan), default=0)
    if options.per_buffer and options.max_chunk_bytes is None:
        limit = chunk_bytes  # no limit was asked for: the largest call is the buffer
    span_bytes = span_bytes_for(chunk_bytes, wanted_populate, where.align) if populate else 0
    runs = page_runs([(b.offset, b.spec.nbytes, b.spec.page_runs) for b in buffers], where.num_pages)
    runs = runs if ranges is None else (ranges.run,)
    pin_chunks = pin_order(chunks, runs)
    # Spans index the chunks in the order they are pinned: the pipeline faults them in that order.
    spans: Sequence[Span] = SpanTable(pin_chunks, span_bytes) if populate else ()
    populate_workers = min(wanted_populate, len(spans))
    register_workers = max(1, min(wanted_register, len(chunks)))
    # Faulting first, registration is the serial bottleneck and gets threads of its own; else the roles share them.
    pair = (populate_workers, register_workers)
    # With tiny chunks faulting runs a few batches of chunks ahead, not a span each (more slows every chunk).
    lookahead_bytes = max(2 * chunk_bytes, populate_workers * min(span_bytes, chunk_bytes * LOOKAHEAD_CHUNKS))
    quota_cpus = None if host.cpu_quota is None else host.cpu_quota.cpus
    # Threads of their own, so an engine registers chunk k while chunk k+1 pins: as many as register chunks
    # (one for an engine that takes one call at a time), so registering keeps up with pinning.
    plans = tuple(
        plan_transfer(name, limits, chunks, page_size, workers=register_workers if limits.parallel else 1)
        for name, limits in transfers
    )  # fmt: skip
    transfer_workers = min(MAX_TRANSFER_WORKERS, sum(plan.workers for plan in plans))
    return Schedule(
        nbytes=total, num_pages=where.num_pages, page_bytes=options.layout.page_bytes, chunks=chunks,
        chunk_bytes=chunk_bytes, chunk_limit=limit, granularity=_common_granularity(buffers), order=order,
        populate=populate, huge_pages=options.huge_pages, numa_node=options.numa_node,
        register_workers=register_workers, populate_workers=populate_workers,
        unpin_workers=_unpin_workers(options, host, len(chunks)),
        threads=(sum(pair) if order is Order.POPULATE_FIRST else max(pair)) + transfer_workers,
        transfers=plans,
        transfer_workers=transfer_workers,
        page_size=page_size, align=where.align, source_start=source_start, buffers=buffers,
        mapping_bytes=where.mapping_bytes if ranges is None else max(page_size, ranges.extent),
        cpu_budget=host.cpu_budget, cpu_quota=quota_cpus,
        duty_cycle=duty_cycle(quota_cpus, background=options.background and options.populate_workers is None),
        span_bytes=span_bytes, spans=spans, lookahead_bytes=lookahead_bytes, pin_chunks=pin_chunks, page_runs=runs,
        registrations_reason=_registrations_why(
            asked, options, transfers, parallel, split_limit, len(chunks), limit, workers
        ),
    )  # fmt: skip


def _registrations_why(
    asked: PoolOptions,
    options: PoolOptions,
    transfers: Sequence[tuple[str, RegistrarLimits]],
    parallel: int,
    split_limit: int,
    chunks: int,
    limit: int,
    workers: int,
) -> str:
    """Why the pool has ``chunks`` registrations: the runtime's reasons, or the registrars' where they decided."""
    if transfers and options.chunk_limit < asked.chunk_limit:
        name = min((limits.max_bytes, name) for name, limits in transfers if limits.max_bytes)[1]
        return (
            f"{chunks} registrations: chunks within the largest registration registrar {name!r} accepts "
            f"({format_bytes(options.chunk_limit)})"
        )
    if split_limit < parallel:
        return (
            f"{chunks} registrations: split to <= {format_bytes(split_limit)} (about {TRANSFER_CHUNKS} chunks, none "
            f"below {format_bytes(MIN_TRANSFER_CHUNK_BYTES)}) so registrars register chunks while later ones pin"
        )
    return _registrations_reason(options, chunks, limit, split_limit, workers)


def _resolve_populate(options: PoolOptions, host: HostFacts, caps: Capabilities) -> bool:
    if options.populate is None:
        return caps.populates or host.populate_write
    if options.populate and not caps.populates and not host.populate_write:
        raise ConfigError(
            "populate=True needs MADV_POPULATE_WRITE (Linux 5.14 or newer), which this kernel rejects; "
            "use populate=False (registration then faults the pages itself)"
        )
    return options.populate


def _order(populate: bool, huge_pages: bool | str, caps: Capabilities) -> Order:
    if not populate:
        return Order.REGISTER_ONLY
    # On huge pages the kernel's on-fault locking is far slower than faulting first (docs/concepts.md, Three orders).
    return Order.REGISTER_FIRST if caps.locks_on_fault and not huge_pages else Order.POPULATE_FIRST


def _wanted_workers(
    options: PoolOptions, host: HostFacts, caps: Capabilities, total: int, populate: bool
) -> tuple[int, int]:
    """Register and populate workers asked for, or sized to the pool and the CPUs, before the work caps them."""
    by_size = max(1, total // MIN_BYTES_PER_DEFAULT_WORKER)
    # The CPU budget, not the affinity: workers beyond a quota only make the kernel stall the whole cgroup sooner.
    cpus = pool_cpus(host.cpu_budget, background=options.background)
    # One where registration is serial (the CUDA driver's lock).
    default_register = 1 if caps.serial_registration else max(1, min(MAX_DEFAULT_WORKERS, cpus))
    register = options.register_workers or min(by_size, default_register)
    if not populate:
        return register, 0
    return register, options.populate_workers or min(by_size, default_populate_workers(cpus))


def _buffer_plan(
    spec: BufferSpec, offset: int, options: PoolOptions, caps: Capabilities, page_size: int, source_start: int,
    split_limit: int,
) -> BufferPlan:  # fmt: skip
    if not spec.nbytes:
        return BufferPlan(spec, offset, None, ChunkTable())
    if options.per_buffer:
        plan = _one_call(spec, page_size, options.max_chunk_bytes)
    else:
        # The split for workers applies only where an aligned unit fits in it.
        unit = math.lcm(spec.granularity or 1, page_size)
        limit = split_limit if split_limit >= unit else options.chunk_limit
        plan = plan_chunks(
            spec.nbytes, granularity=spec.granularity, limit=limit, page_size=page_size,
            start=(source_start + offset) % page_size,
            shared_boundary_pages=caps.exact_ranges,  # only changes plans no page-aligned boundary fits
        )  # fmt: skip
    return BufferPlan(spec, offset, plan, plan.chunks.shifted(offset))


def _common_granularity(buffers: Sequence[BufferPlan]) -> int | None:
    granularities = {b.spec.granularity for b in buffers if b.plan}
    return granularities.pop() if len(granularities) == 1 else None


def _unpin_workers(options: PoolOptions, host: HostFacts, chunks: int) -> int:
    # Unregistering scales across threads, for CUDA too (docs/concepts.md, Default worker count).
    default = max(1, min(MAX_DEFAULT_WORKERS, host.cpu_budget))
    return max(1, min(options.unpin_workers or default, chunks))


def retry_splitter(plan: Schedule, min_chunk_bytes: int) -> RetrySplitter:
    """The cuts allowed in ``plan``'s buffers: each buffer's own grid (``ChunkPlan.origin``)."""
    grids = tuple(
        RetryGrid(b.offset, b.offset + b.spec.nbytes, b.plan.unit, b.offset + b.plan.origin)
        for b in plan.buffers
        if b.plan is not None and b.plan.origin is not None  # no aligned cut exists: never split
    )
    return RetrySplitter(grids, min_chunk_bytes)


def _registrations_reason(options: PoolOptions, count: int, limit: int, split_limit: int, workers: int) -> str:
    if options.per_buffer:
        why = 'one per buffer (chunk_bytes="buffer"), never cut'
    elif options.chunk_bytes is not None:
        why = f"chunk_bytes={format_bytes(limit)}: every call exactly that size, a buffer's last one shorter"
    elif options.max_chunk_bytes is not None:
        why = f"max_chunk_bytes={format_bytes(limit)}: as few calls as the limit and the alignment allow"
    elif split_limit < limit:
        why = (
            f"the default limit {format_bytes(limit)} split to {format_bytes(split_limit)} so {workers} workers "
            f"get {CHUNKS_PER_WORKER} chunks each (give max_chunk_bytes= for fewer calls)"
        )
    else:
        why = f"the default limit {format_bytes(limit)} ({CHUNK_ENV}, else {DEFAULT_CHUNK_GIB} GiB)"
    if options.max_call_seconds is not None and not options.per_buffer and not options.budget_yields_to:
        why += f"; the stall budget ({options.max_call_seconds:g} s) cuts calls further as they go"
    elif options.budget_yields_to:
        why += f'; the "auto" stall budget yields to {options.budget_yields_to} for registrations'
    return f"{count} registration{'s' if count != 1 else ''}: {why}"


def _range_buffers(
    placed: list[tuple[BufferSpec, int]], ranges: SourceRanges, source_start: int, page_size: int, caps: Capabilities
) -> list[tuple[BufferSpec, int]]:
    """The ranges of pin()'s one buffer as buffers of their own, ``data[i]``."""
    ((spec, base),) = placed
    for (offset, nbytes), (after, _) in itertools.pairwise(ranges.ranges):
        last_page = (source_start + offset + nbytes - 1) // page_size
        if not caps.exact_ranges and last_page == (source_start + after) // page_size:
            raise ConfigError(
                f"pin(): the ranges ending at byte {ranges.first + offset + nbytes} and starting at byte "
                f"{ranges.first + after} of the tensor share an OS page of {page_size} B, and this runtime does not "
                "track registrations by exact byte range (Capabilities.exact_ranges), so two registrations may not "
                "share a page; round the ranges out to whole pages, or use a runtime that does (cuda, mlock)"
            )
    return [
        (BufferSpec(f"{spec.name}[{i}]", (nbytes,), torch.uint8, spec.granularity, None), base + offset)
        for i, (offset, nbytes) in enumerate(ranges.ranges)
    ]


def _one_call(spec: BufferSpec, page_size: int, bound: int | None) -> ChunkPlan:
    """``chunk_bytes="buffer"``: one registration with no grid (``origin=None``): never cut."""
    if bound is not None and spec.nbytes > bound:
        raise ConfigError(
            f'chunk_bytes="buffer": buffer {spec.name!r} holds {bytes_text(spec.nbytes)}, more than '
            f"max_chunk_bytes={bytes_text(bound)}, and one registration per buffer cannot be cut; raise "
            'max_chunk_bytes=, or let pinpool chunk the buffer (drop chunk_bytes="buffer")'
        )
    unit = math.lcm(spec.granularity or 1, page_size)
    whole = ChunkTable([(0, spec.nbytes, 1)])
    return ChunkPlan(spec.nbytes, spec.granularity, page_size, spec.nbytes, unit, spec.nbytes, whole, origin=None)
