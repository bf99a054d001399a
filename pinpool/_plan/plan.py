"""The plan: pure arithmetic over options, :class:`HostFacts` and :class:`Capabilities` deciding chunks,
workers, pipeline order, spans and lookahead before anything is mapped (property-tested on made-up hosts)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._errors import ConfigError
from .._types import Capabilities
from .._units import bytes_text, format_bytes, hugetlb_page_size
from ..layouts._spec import BufferSpec
from .calls import duty_cycle
from .chunks import ChunkPlan, ChunkTable, Order, Span, SpanTable
from .options import CHUNK_ENV, DEFAULT_CHUNK_GIB
from .prefix import PageRun, page_runs, pin_order
from .preflight import Placement, place

if TYPE_CHECKING:
    from .facts import HostFacts
    from .options import PoolOptions


def plan_chunks(
    nbytes: int, *, granularity: int | None, limit: int, page_size: int, start: int = 0,
    shared_boundary_pages: bool = False,
) -> ChunkPlan:  # fmt: skip
    """Split ``nbytes`` into contiguous registration chunks of at most ``limit``, covering it exactly.

    Boundaries are multiples of ``granularity`` (no copy page straddles two registrations) and of
    ``page_size`` (unlocking a chunk would unlock a shared page's neighbour), counted from ``start``
    (the address modulo the page). Where no multiple of the granularity falls on a page (torch's
    memory starts 64 B into one), a ``ConfigError`` unless ``shared_boundary_pages`` (the runtime
    tracks exact ranges): then boundaries are lcm(granularity, page) apart, sharing pages.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"buffer size {nbytes!r} must be a positive integer number of bytes")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"page_size={page_size!r} must be a positive integer")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ConfigError(f"chunk limit {limit!r} must be a positive integer number of bytes")
    if granularity is not None and (
        isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0
    ):
        raise ConfigError(
            f"registration granularity {granularity!r} must be a positive integer number of bytes "
            "(the byte size of one copy page); use None for no alignment constraint"
        )
    unit = math.lcm(granularity or 1, page_size)
    misalignment = start % page_size
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
        # Fits one call: still cut in chunk_bytes steps from its start (as the reference does),
        # unless those steps would fall inside OS pages nobody may share.
        if misalignment and not shared_boundary_pages:
            return ChunkPlan(nbytes, granularity, page_size, limit, unit, nbytes, ChunkTable([(0, nbytes, 1)]), origin)
        first = 0
    elif origin is None:
        raise _no_aligned_boundary(granularity or 1, misalignment)
    else:
        first = origin
    # An unaligned start: the first chunk is cut short to reach an aligned boundary (first <= unit <= limit).
    head = first + (limit - first) // unit * unit if first else 0
    # Runs, never listed: a plan of 2**35 chunks is three runs (a short head, full chunks, a tail).
    full, tail = divmod(nbytes - head, chunk_bytes)
    chunks = ChunkTable(
        [(0, head, 1 if head else 0), (head, chunk_bytes, full), (head + full * chunk_bytes, tail, 1 if tail else 0)]
    )
    shared = bool(misalignment) and not first and len(chunks) > 1  # boundaries inside OS pages
    return ChunkPlan(nbytes, granularity, page_size, limit, unit, min(chunk_bytes, nbytes), chunks, origin, shared)


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
    """What :func:`pinpool.pin` registers of a strided view or ``ranges=``: sorted, disjoint ranges from
    the first one's start (``first`` bytes into the tensor); ``run``: its pages, the gaps its holes."""

    ranges: tuple[tuple[int, int], ...]
    extent: int
    run: PageRun
    first: int


@dataclass(frozen=True)
class PoolPlan:
    """Everything decided about a pool before anything is mapped (bytes; offsets from the pool's start)."""

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
    duty_cycle: float  # the share of their time pin workers spend in calls (1: no rest; see _plan/calls.py)
    span_bytes: int  # 0 without pre-faulting
    spans: Sequence[Span]  # pin_chunks cut into populate calls (a SpanTable), or () without pre-faulting
    lookahead_bytes: int
    # The chunks in pin order, interleaved across page runs so the page prefix grows early (_plan/prefix.py).
    pin_chunks: ChunkTable
    page_runs: tuple[PageRun, ...]
    registrations: int
    registrations_reason: str


def plan_pool(
    options: PoolOptions, host: HostFacts, caps: Capabilities, *, source_start: int = 0,
    placement: Placement | None = None, ranges: SourceRanges | None = None,
) -> PoolPlan:  # fmt: skip
    """Plan a pool (:class:`ConfigError` for what cannot be). ``placement``: the caller's, checked (else
    placed here); ``ranges``: each becomes a buffer, so no chunk crosses a gap between ranges."""
    where = placement or place(options, host)
    populate = options.populate
    if populate is None:
        populate = caps.populates or host.populate_write
    elif populate and not caps.populates and not host.populate_write:
        raise ConfigError(
            "populate=True needs MADV_POPULATE_WRITE (Linux 5.14 or newer), which this kernel rejects; "
            "use populate=False (registration then faults the pages itself)"
        )
    huge_pages = options.huge_pages
    # On huge pages the kernel's on-fault locking is far slower than faulting first (measured: 2.5 vs 21 GB/s on THP).
    order = (
        Order.REGISTER_ONLY if not populate
        else Order.REGISTER_FIRST if caps.locks_on_fault and not huge_pages
        else Order.POPULATE_FIRST
    )  # fmt: skip
    # Boundaries on whole hugetlb pages (faulted, pinned and freed whole; no retry could split one).
    page_size = hugetlb_page_size(huge_pages) or host.page_size
    placed: list[tuple[BufferSpec, int]] = list(zip(where.specs, where.offsets, strict=True))
    if ranges is not None:
        placed = _range_buffers(placed, ranges, source_start, page_size, caps)
    total = sum(spec.nbytes for spec, _ in placed)
    by_size = max(1, total // MIN_BYTES_PER_DEFAULT_WORKER)
    # The CPU budget, not the affinity: workers beyond the quota only spend it sooner, and the
    # kernel then stalls every thread of the cgroup, the server's too, until the next period.
    cpus = pool_cpus(host.cpu_budget, background=options.background)
    quota_cpus = None if host.cpu_quota is None else host.cpu_quota.cpus
    # One where registration is serial (the CUDA driver's lock).
    default_register = 1 if caps.serial_registration else max(1, min(MAX_DEFAULT_WORKERS, cpus))
    wanted_register = options.register_workers or min(by_size, default_register)
    wanted_populate = (options.populate_workers or min(by_size, default_populate_workers(cpus))) if populate else 0
    # Only the default limit is split for the workers: explicit ones ask for exact or fewest calls
    # (on ROCm each registration is a device alias of its own: the count matters).
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
    runs = page_runs([(b.offset, b.spec.nbytes, b.spec.page_runs) for b in buffers], where.num_pages)
    runs = runs if ranges is None else (ranges.run,)
    pin_chunks = pin_order(chunks, runs)
    # Spans index the chunks in the order they are pinned: the pipeline faults them in that order.
    spans: Sequence[Span] = SpanTable(pin_chunks, span_bytes) if populate else ()
    populate_workers = min(wanted_populate, len(spans))
    # Unregistering scales across threads for CUDA too (Mooncake: 500 GB in 1.5 s on threads, 11.8 s in one).
    default_unpin = max(1, min(MAX_DEFAULT_WORKERS, host.cpu_budget))
    unpin_workers = max(1, min(options.unpin_workers or default_unpin, len(chunks)))
    # Faulting first, registration is the serial bottleneck and gets threads of its own; else
    # a registration is quick or is the fault, and the roles share threads.
    pair = (populate_workers, register_workers)
    threads = sum(pair) if order is Order.POPULATE_FIRST else max(pair)
    # How far faulting may run ahead of registration: with tiny chunks a few batches of chunks,
    # not span_bytes each (thousands of chunks ahead cost every chunk more: measured at 100k).
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
