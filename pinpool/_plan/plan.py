"""Planning policy: pure arithmetic that decides everything about a pool before anything is mapped.

:func:`plan_chunks` splits one buffer into registration calls; the worker policy
(:func:`default_register_workers` and friends, :func:`span_bytes_for`, :func:`parallel_limit`)
sizes the threads and the populate spans; :func:`plan_pool` takes a pool's options, the host's
facts and the runtime's capabilities and decides the rest: pages, buffers and where they sit in
the mapping (:mod:`pinpool._plan.placement`), the chunk table, workers per role, the pipeline order,
populate spans and lookahead. Nothing here touches memory, a runtime or the host: host facts
arrive as a value (:class:`pinpool._host.facts.HostFacts`), the runtime as its declared
:class:`~pinpool.runtimes.Capabilities`, and the host checks a plan depends on are the
pre-flight's (:mod:`pinpool._plan.preflight`), so every rule is property-tested with hand-made hosts.

The values it plans with (chunks, spans, their lazy tables, orders) are :mod:`pinpool._plan.chunks`;
where chunks may be cut later (retries, the stall budget) is :mod:`pinpool._plan.cutter`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._errors import ConfigError
from .._types import Capabilities
from .._units import format_bytes, hugetlb_page_size
from ..layouts import BufferSpec
from .chunks import ChunkPlan, ChunkTable, Order, Span, SpanTable
from .duty import duty_cycle
from .options import CHUNK_ENV, DEFAULT_CHUNK_GIB
from .placement import Placement, place
from .prefix import PageRun, page_runs, pin_order
from .preflight import bytes_text, placement_checks, raise_first

if TYPE_CHECKING:
    from .._host.facts import HostFacts
    from .options import PoolOptions


def plan_chunks(
    nbytes: int,
    *,
    granularity: int | None,
    limit: int,
    page_size: int,
    start: int = 0,
    shared_boundary_pages: bool = False,
) -> ChunkPlan:
    """Split ``nbytes`` into registration chunks.

    Rules: boundaries are multiples of ``granularity`` (so no copy page straddles two
    registrations) and of ``page_size`` (so no OS page belongs to two chunks, which would let
    unlocking one chunk unlock its neighbour's page); no chunk exceeds ``limit``; chunks are
    contiguous and cover ``[0, nbytes)`` exactly. Without a granularity, the whole buffer is
    one registration unless it exceeds ``limit``, then it is split at page boundaries.

    ``start`` is the buffer's address modulo ``page_size`` (non-zero only for memory pinpool
    did not allocate): boundaries are then page-aligned in absolute terms, so the first chunk
    ends at the first multiple of the granularity that falls on a page boundary.

    Where no multiple of the granularity falls on a page boundary (torch's allocator returns
    memory 64 B into a page, and a KV granularity is usually a multiple of the page), there
    is no such plan: ``ConfigError``, unless ``shared_boundary_pages`` says the runtime
    tracks registrations by exact byte range (CUDA; mlock through its shared-page counts).
    Then the buffer is planned as if it were page-aligned, boundaries on multiples of
    lcm(granularity, page) from its start, and each boundary's OS page is shared by the
    two chunks around it (no byte is in two chunks; the copy-page rule, the one batched
    copies need, still holds). Page-aligned memory never gets such a plan.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"buffer size {nbytes!r} must be a positive integer number of bytes")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"page_size={page_size!r} must be a positive integer")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ConfigError(f"chunk limit {limit!r} must be a positive integer number of bytes")
    if granularity is not None:
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0:
            raise ConfigError(
                f"registration granularity {granularity!r} must be a positive integer number of bytes "
                "(the byte size of one copy page); use None for no alignment constraint"
            )
        unit = math.lcm(granularity, page_size)
    else:
        unit = page_size
    misalignment = start % page_size
    # The grid later cuts (a retry's halves, the stall budget's pieces) sit on: the first
    # page-aligned multiple of the granularity, else the buffer's start where neighbours may
    # share a page, else none (see ChunkPlan.origin).
    aligned = _aligned_boundary(granularity or 1, page_size, misalignment, unit)
    origin = aligned if aligned is not None else (0 if shared_boundary_pages else None)
    if granularity is None and nbytes <= limit:
        return ChunkPlan(nbytes, None, page_size, limit, unit, nbytes, ChunkTable([(0, nbytes, 1)]), origin)
    if unit > limit:
        what = (
            f"lcm(granularity {granularity} B, OS page {page_size} B) = {format_bytes(unit)}"
            if granularity is not None
            else f"the OS page ({page_size} B)"
        )
        raise ConfigError(
            f"{what} is larger than the chunk limit {format_bytes(limit)} ({limit} B): no chunk could hold "
            f"one aligned unit; raise chunk_bytes= or {CHUNK_ENV} to at least {unit} bytes ({format_bytes(unit)}), "
            "or max_chunk_bytes= where that sets the limit"
        )
    chunk_bytes = (limit // unit) * unit
    if nbytes <= limit:
        # A buffer that fits one call needs no boundary at all, aligned or not. Page-aligned
        # memory (or where pages may be shared) is still cut into chunk_bytes steps from its
        # start, as the reference does; unaligned memory whose pages may not be shared is not
        # cut, since those steps would fall inside OS pages.
        if misalignment and not shared_boundary_pages:
            return ChunkPlan(nbytes, granularity, page_size, limit, unit, nbytes, ChunkTable([(0, nbytes, 1)]), origin)
        first = 0
    elif origin is None:
        raise _no_aligned_boundary(granularity or 1, misalignment)
    else:
        first = origin
    if first:  # an unaligned start: the first chunk is cut short to reach an aligned boundary
        head = first + (limit - first) // unit * unit  # first <= unit <= limit
    else:
        head = 0
    # Chunks start at 0, then at head + k * chunk_bytes (head = 0: no short head chunk); the
    # last ends at nbytes. Computed as runs, never listed: a plan of 2**35 chunks is three runs.
    full, tail = divmod(nbytes - head, chunk_bytes)
    chunks = ChunkTable(
        [(0, head, 1 if head else 0), (head, chunk_bytes, full), (head + full * chunk_bytes, tail, 1 if tail else 0)]
    )
    shared = bool(misalignment) and not first and len(chunks) > 1  # boundaries inside OS pages
    return ChunkPlan(nbytes, granularity, page_size, limit, unit, min(chunk_bytes, nbytes), chunks, origin, shared)


def _aligned_boundary(granularity: int, page_size: int, misalignment: int, unit: int) -> int | None:
    """The smallest B > 0 with B % granularity == 0 and (misalignment + B) % page_size == 0; 0 if
    aligned; None if there is none."""
    if misalignment == 0:
        return 0
    # B = k * granularity with k * granularity = -misalignment (mod page): solvable iff
    # gcd(granularity, page) divides the misalignment; k is then unique modulo page / gcd.
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
# With several workers, chunks are split further so each worker gets a few of them (and the
# pipeline has chunks to overlap), but never below this: smaller chunks only add calls, and
# the reference plans stay as they are.
MIN_PARALLEL_CHUNK_BYTES = 1 << 30
CHUNKS_PER_WORKER = 4
# One populate call faults at most this much, so mmap_lock is never held long (a registration
# or munmap elsewhere in the process waits for it), and every populate worker has spans to take.
MAX_SPAN_BYTES = 512 << 20
LOOKAHEAD_CHUNKS = 64  # per populate worker, when chunks are smaller than a span
MIN_SPAN_BYTES = 16 << 20
# Default worker counts shrink for small pools: below ~256 MiB a worker saves little time and
# costs a thread start and contention for the GIL.
MIN_BYTES_PER_DEFAULT_WORKER = 256 << 20


def pool_cpus(cpu_budget: int, *, background: bool) -> int:
    """The CPUs a pool's default worker counts are sized to. A background pool pins while its
    process serves, so it leaves the serving threads one CPU of the budget (at least one worker
    remains); a pool entered before its body runs has nothing else to run for and takes it all."""
    return max(1, cpu_budget - 1) if background else max(1, cpu_budget)


def default_register_workers(caps: Capabilities, cpus: int) -> int:
    """A runtime that serialises registration (the CUDA driver's lock) gets one; mlock (and the
    fake) scale with cores, up to a bound."""
    if caps.serial_registration:
        return 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))


def default_populate_workers(cpus: int) -> int:
    """Page faulting scales across cores."""
    return max(1, min(MAX_DEFAULT_POPULATE_WORKERS, cpus))


def default_unpin_workers(cpus: int) -> int:
    """Unregistering scales across threads for CUDA too (Mooncake: 500 GB in 1.5 s on threads, 11.8 s in one)."""
    return max(1, min(MAX_DEFAULT_WORKERS, cpus))


def span_bytes_for(chunk_bytes: int, populate_workers: int, align: int) -> int:
    """Each populate worker gets a share of a chunk, within [MIN_SPAN_BYTES, MAX_SPAN_BYTES], aligned."""
    share = -(-chunk_bytes // max(1, populate_workers))
    span = min(MAX_SPAN_BYTES, max(MIN_SPAN_BYTES, share))
    return -(-span // align) * align


def parallel_limit(limit: int, nbytes: int, workers: int) -> int:
    """The default chunk limit split so ``workers`` get CHUNKS_PER_WORKER chunks each, not below 1 GiB."""
    if workers <= 1:
        return limit
    share = -(-nbytes // (workers * CHUNKS_PER_WORKER))
    return min(limit, max(MIN_PARALLEL_CHUNK_BYTES, share))


@dataclass(frozen=True)
class BufferPlan:
    """Where one layout buffer sits in the pool's mapping, and how it is chunked."""

    spec: BufferSpec
    offset: int  # bytes from the start of the mapping
    plan: ChunkPlan | None  # None for a zero-byte buffer: nothing to register
    chunks: ChunkTable  # its chunks, offsets relative to the mapping


@dataclass(frozen=True)
class SourceRanges:
    """The byte ranges of a caller's tensor that :func:`pinpool.pin` registers instead of all of
    it: the rows of a strided view, or ``ranges=``. ``ranges``: sorted, disjoint, non-empty
    ``(offset, nbytes)`` from the first range's start (where the pool's memory starts: a group of
    ranges is claimed, and unregistered, by its first byte); ``extent``: the last range's end;
    ``run``: where the tensor's pages (rows along its first dimension) lie, the bytes between
    the ranges as its holes; ``first``: the first range's offset from the tensor's start."""

    ranges: tuple[tuple[int, int], ...]
    extent: int
    run: PageRun
    first: int


@dataclass(frozen=True)
class PoolPlan:
    """Everything decided about a pool before anything is mapped or pinned (see :func:`plan_pool`).

    Sizes and offsets are bytes; chunk and span offsets are relative to the pool's start.
    """

    nbytes: int  # the bytes the pool holds (all buffers)
    num_pages: int
    page_bytes: int  # one layout page
    chunk_limit: int  # the per-call limit (chunk_bytes= or PINPOOL_REGISTER_CHUNK_GB or 256 GiB)
    chunk_bytes: int  # the largest chunk
    granularity: int | None  # the buffers' common granularity, None when none or several
    populate: bool
    huge_pages: bool | str
    numa_node: int | None
    page_size: int  # the page chunks are aligned to: the OS page, or the hugetlb page with huge_pages="hugetlb..."
    align: int  # buffer placement alignment: the OS page, or the huge page with huge_pages
    source_start: int  # the memory's start modulo the OS page (non-zero only for a caller's tensor)
    buffers: tuple[BufferPlan, ...]
    mapping_bytes: int  # bytes to map: every buffer, each start aligned to ``align``
    chunks: ChunkTable
    order: Order
    register_workers: int
    populate_workers: int
    unpin_workers: int
    threads: int  # worker threads pinning starts (each takes either role)
    cpu_budget: int  # the host's CPU budget the default worker counts were sized from (HostFacts.cpu_budget)
    cpu_quota: float | None  # the CPU quota in CPUs that bounded it, None without one
    duty_cycle: float  # the share of their time pin workers spend in calls (1: no rest; see _plan/duty.py)
    span_bytes: int  # 0 without pre-faulting
    spans: Sequence[Span]  # pin_chunks cut into populate calls (a SpanTable), or () without pre-faulting
    lookahead_bytes: int
    # The chunks in the order they are pinned: offset order, interleaved across page runs so
    # the pinned page prefix grows from the start (see _plan/prefix.py); and those runs.
    pin_chunks: ChunkTable
    page_runs: tuple[PageRun, ...]
    # How many registration calls the plan makes (len(chunks)), and why that many, in words.
    registrations: int
    registrations_reason: str


def plan_pool(
    options: PoolOptions, host: HostFacts, caps: Capabilities, *, source_start: int = 0,
    placement: Placement | None = None, ranges: SourceRanges | None = None,
) -> PoolPlan:  # fmt: skip
    """Plan a pool: a pure function of its options, the host's facts and the runtime's abilities.

    ``source_start`` is the memory's start modulo the OS page: 0 for memory pinpool maps
    (page-aligned), a caller's tensor's ``data_ptr() % page_size`` for :func:`pinpool.pin`.
    ``placement``: the pool's placement on this host, made and checked already by the caller's
    pre-flight (so it is computed and checked once); without it, it is made and checked here.
    ``ranges``: pin() of a strided view or of ranges= (one layout buffer): each range is laid out
    as a buffer of its own, chunked on its own grid, so no chunk crosses a gap between ranges.
    Raises :class:`ConfigError` for anything the host cannot do (NUMA node, THP, hugetlb pages,
    MADV_POPULATE_WRITE, a size beyond the address space) or the options cannot satisfy.
    """
    if placement is None:
        placement = place(options, host)
        raise_first(placement_checks(options, host, placement))
    where = placement
    populate = options.populate
    if populate is None:
        populate = caps.populates or host.populate_write
    elif populate and not caps.populates and not host.populate_write:
        raise ConfigError(
            "populate=True needs MADV_POPULATE_WRITE (Linux 5.14 or newer), which this kernel rejects; "
            "use populate=False (registration then faults the pages itself)"
        )
    huge_pages = options.huge_pages
    # Lock-on-fault then fault is one pass over 4 KiB pages, but on huge pages the kernel's
    # on-fault locking is several times slower than faulting first and locking after
    # (measured: 2.5 vs 21 GB/s on THP), so huge pages are faulted first.
    if not populate:
        order = Order.REGISTER_ONLY
    elif caps.locks_on_fault and not huge_pages:
        order = Order.REGISTER_FIRST
    else:
        order = Order.POPULATE_FIRST
    # Chunk boundaries on whole hugetlb pages, as on whole OS pages otherwise: no page is shared by
    # two registrations (a hugetlb page is faulted, pinned and freed whole; no retry could split one).
    page_size = hugetlb_page_size(huge_pages) or host.page_size
    placed: list[tuple[BufferSpec, int]] = list(zip(where.specs, where.offsets, strict=True))
    if ranges is not None:
        placed = _range_buffers(placed, ranges, source_start, page_size, caps)
    total = sum(spec.nbytes for spec, _ in placed)
    by_size = max(1, total // MIN_BYTES_PER_DEFAULT_WORKER)
    # Sized to the CPU budget (affinity bounded by the cgroup's CPU quota), not the affinity alone:
    # workers beyond the quota only spend it sooner, and the kernel then stalls every thread of the
    # cgroup, the server's too, until the next period.
    cpus = pool_cpus(host.cpu_budget, background=options.background)
    quota_cpus = None if host.cpu_quota is None else host.cpu_quota.cpus
    wanted_register = options.register_workers or min(by_size, default_register_workers(caps, cpus))
    wanted_populate = (options.populate_workers or min(by_size, default_populate_workers(cpus))) if populate else 0
    # An explicit chunk_bytes= is the chunk size, and an explicit max_chunk_bytes= asks for as few
    # calls as it allows (on ROCm each registration is a device alias of its own: the count
    # matters); only the default (or the environment's) limit is split further so the workers
    # have chunks to share and overlap.
    limit = options.chunk_limit
    workers = max(wanted_register, wanted_populate)
    explicit = options.chunk_bytes is not None or options.max_chunk_bytes is not None
    split_limit = limit if explicit else parallel_limit(limit, total, workers)
    buffers: list[BufferPlan] = []
    for spec, offset in placed:
        if not spec.nbytes:
            buffers.append(BufferPlan(spec, offset, None, ChunkTable()))
            continue
        if options.per_buffer:
            plan = _one_call(spec, page_size, options.max_chunk_bytes)
            buffers.append(BufferPlan(spec, offset, plan, plan.chunks.shifted(offset)))
            continue
        # The split for workers applies only where an aligned unit fits in it.
        unit = math.lcm(spec.granularity or 1, page_size)
        plan_limit = split_limit if split_limit >= unit else limit
        plan = plan_chunks(
            spec.nbytes, granularity=spec.granularity, limit=plan_limit, page_size=page_size,
            start=(source_start + offset) % page_size,
            shared_boundary_pages=caps.exact_ranges,  # only changes plans no page-aligned boundary fits
        )  # fmt: skip
        buffers.append(BufferPlan(spec, offset, plan, plan.chunks.shifted(offset)))
    chunks = ChunkTable.concat(b.chunks for b in buffers)
    chunk_bytes = max((b.plan.chunk_bytes for b in buffers if b.plan), default=0)
    if options.per_buffer and options.max_chunk_bytes is None:
        limit = chunk_bytes  # no limit was asked for: the largest call is the buffer
    granularities = {b.spec.granularity for b in buffers if b.plan}
    granularity = granularities.pop() if len(granularities) == 1 else None
    register_workers = max(1, min(wanted_register, len(chunks)))
    span_bytes = span_bytes_for(chunk_bytes, wanted_populate, where.align) if populate else 0
    if ranges is None:
        runs = page_runs([(b.offset, b.spec.nbytes, b.spec.page_runs) for b in buffers], where.num_pages)
    else:
        runs = (ranges.run,)
    pin_chunks = pin_order(chunks, runs)
    # Spans index the chunks in the order they are pinned: the pipeline faults them in that order.
    spans: Sequence[Span] = SpanTable(pin_chunks, span_bytes) if populate else ()
    populate_workers = min(wanted_populate, len(spans))
    unpin_workers = max(1, min(options.unpin_workers or default_unpin_workers(host.cpu_budget), len(chunks)))
    # Workers take either role. Faulting first (CUDA), registration is the serial bottleneck,
    # so it gets threads of its own; registering first (mlock on-fault) or not faulting, a
    # registration is quick or is the fault, so the roles share threads.
    if order is Order.POPULATE_FIRST:
        threads = populate_workers + register_workers
    else:
        threads = max(populate_workers, register_workers)
    # Faulting may run this far ahead of registration (whole chunks; the front chunk always may).
    # A span never crosses a chunk, so with tiny chunks a worker's real span is a chunk: the
    # lookahead is then a few batches of chunks, not span_bytes each (thousands of chunks ahead
    # of registration cost every chunk more as the pool grew: measured at 100k chunks).
    lookahead_bytes = max(2 * chunk_bytes, populate_workers * min(span_bytes, chunk_bytes * LOOKAHEAD_CHUNKS))
    return PoolPlan(
        nbytes=total, num_pages=where.num_pages, page_bytes=options.layout.page_bytes, chunk_limit=limit,
        chunk_bytes=chunk_bytes, granularity=granularity, populate=populate, huge_pages=huge_pages,
        numa_node=options.numa_node, page_size=page_size, align=where.align, source_start=source_start,
        buffers=tuple(buffers), chunks=chunks, order=order,
        mapping_bytes=where.mapping_bytes if ranges is None else max(page_size, ranges.extent),
        register_workers=register_workers, populate_workers=populate_workers, unpin_workers=unpin_workers,
        threads=threads, span_bytes=span_bytes, spans=spans, lookahead_bytes=lookahead_bytes,
        cpu_budget=host.cpu_budget, cpu_quota=quota_cpus,
        duty_cycle=duty_cycle(quota_cpus, background=options.background and options.populate_workers is None),
        pin_chunks=pin_chunks, page_runs=runs, registrations=len(chunks),
        registrations_reason=_registrations_reason(options, len(chunks), limit, split_limit, workers),
    )  # fmt: skip


def _registrations_reason(options: PoolOptions, count: int, limit: int, split_limit: int, workers: int) -> str:
    """Why the plan makes ``count`` registration calls, in words (pool.chunking_reason, pinpool plan)."""
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
    """The ranges of pin()'s one buffer as buffers of their own (``data[i]``: range *i*, in bytes).
    Two ranges on one OS page need a runtime that tracks registrations by exact byte range."""
    ((spec, base),) = placed
    for (offset, nbytes), (after, _) in itertools.pairwise(ranges.ranges):
        last_page = (source_start + offset + nbytes - 1) // page_size
        if not caps.exact_ranges and last_page == (source_start + after) // page_size:
            raise ConfigError(
                f"pin(): the ranges ending at byte {ranges.first + offset + nbytes} and starting at byte "
                f"{ranges.first + after} of the tensor share an OS page of {page_size} B, and this runtime does not "
                "track registrations "
                "by exact byte range (Capabilities.exact_ranges), so two registrations may not share a page; "
                "round the ranges out to whole pages, or use a runtime that does (cuda, mlock)"
            )
    return [
        (BufferSpec(f"{spec.name}[{i}]", (nbytes,), torch.uint8, spec.granularity, None), base + offset)
        for i, (offset, nbytes) in enumerate(ranges.ranges)
    ]


def _one_call(spec: BufferSpec, page_size: int, bound: int | None) -> ChunkPlan:
    """``chunk_bytes="buffer"``: the buffer is one registration, never cut: no grid
    (``origin=None``), so neither a retry nor the stall budget can split it."""
    if bound is not None and spec.nbytes > bound:
        raise ConfigError(
            f'chunk_bytes="buffer": buffer {spec.name!r} holds {bytes_text(spec.nbytes)}, more than '
            f"max_chunk_bytes={bytes_text(bound)}, and one registration per buffer cannot be cut; raise "
            'max_chunk_bytes=, or let pinpool chunk the buffer (drop chunk_bytes="buffer")'
        )
    unit = math.lcm(spec.granularity or 1, page_size)
    whole = ChunkTable([(0, spec.nbytes, 1)])
    return ChunkPlan(spec.nbytes, spec.granularity, page_size, spec.nbytes, unit, spec.nbytes, whole, origin=None)
