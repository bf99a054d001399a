"""Planning: pure arithmetic that decides everything about a pool before anything is mapped.

:func:`plan_chunks` splits one buffer into registration calls; :func:`plan_pool` takes a
pool's options, the host's facts and the runtime's capabilities and decides everything the
constructor used to decide piecemeal: pages, buffers and where they sit in the mapping,
the chunk table, workers per role, the pipeline order, populate spans and lookahead.
Nothing here touches memory, a runtime or the host (host facts arrive as a value,
:class:`pinpool._host.HostFacts`), so every rule is checked before anything is allocated
or pinned, and the whole module is property-tested with hand-made hosts.

Chunk and span tables are lazy: :class:`ChunkTable` and :class:`SpanTable` are sequences
computed arithmetically from a few runs of equal, back-to-back items, so planning a pool of
2**35 chunks costs what planning one of 3 does.
"""

from __future__ import annotations

import enum
import math
import operator
import os
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ._errors import ConfigError
from ._types import Capabilities
from ._units import format_bytes, parse_env_gib, parse_size
from .layouts import BufferSpec

if TYPE_CHECKING:
    from ._host import HostFacts
    from ._options import PoolOptions
    from ._prefix import PageRun

CHUNK_ENV = "PINPOOL_REGISTER_CHUNK_GB"
DEFAULT_CHUNK_GIB = 256


@dataclass(frozen=True, order=True)
class Chunk:
    """One registration call's range, relative to the start of its buffer."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


_T = TypeVar("_T")

# Lazy tables keep recently used items in blocks, so the few lookups each chunk gets while it
# is pinned (claim, call, record, report, teardown) cost a dict hit and a tuple index, not a
# bisection and a new object each; a bounded number of blocks keeps memory O(1) in the length.
# Small on purpose (8 blocks of 16): items that die young never reach the collector's oldest
# generation, whose full passes otherwise grow the per-chunk cost with the pool (measured).
_BLOCK_SHIFT = 4
_BLOCK_MASK = (1 << _BLOCK_SHIFT) - 1
_CACHED_BLOCKS = 8


def _fast_chunk(offset: int, nbytes: int) -> Chunk:
    """``Chunk(offset, nbytes)`` in half the time (no frozen-dataclass ``__init__``; same object)."""
    chunk = object.__new__(Chunk)
    fields = chunk.__dict__
    fields["offset"] = offset
    fields["nbytes"] = nbytes
    return chunk


class _LazyTable(Sequence[_T]):
    """A read-only sequence whose items are computed from a few numbers, with a small block cache.

    Subclasses set ``_len`` and implement ``_make(lo, hi)`` (items lo..hi-1, in order) and
    ``_slice(lo, hi)`` (a contiguous slice). Indices, negative indices and slices behave as a
    tuple's do.
    """

    __slots__ = ("_cache", "_len")

    _len: int
    _cache: dict[int, tuple[_T, ...]]

    def _make(self, lo: int, hi: int) -> Iterator[_T]:
        raise NotImplementedError

    def _slice(self, lo: int, hi: int) -> Sequence[_T]:
        return tuple(self._make(lo, hi))

    def __len__(self) -> int:
        return self._len

    def _block(self, number: int) -> tuple[_T, ...]:
        lo = number << _BLOCK_SHIFT
        block = tuple(self._make(lo, min(lo + _BLOCK_MASK + 1, self._len)))
        cache = self._cache
        if len(cache) >= _CACHED_BLOCKS:
            try:
                del cache[next(iter(cache))]  # the oldest block
            except (KeyError, RuntimeError, StopIteration):  # another thread changed the cache meanwhile
                pass
        cache[number] = block
        return block

    @overload
    def __getitem__(self, index: int) -> _T: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[_T]: ...

    def __getitem__(self, index: int | slice) -> _T | Sequence[_T]:
        try:  # the hot path: an index into a cached block
            return self._cache[index >> _BLOCK_SHIFT][index & _BLOCK_MASK]  # type: ignore[operator]
        except (KeyError, TypeError, IndexError):  # not cached, a slice, negative, or out of range
            pass
        if type(index) is int and 0 <= index < self._len:
            return self._block(index >> _BLOCK_SHIFT)[index & _BLOCK_MASK]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step == 1:
                return self._slice(start, max(start, stop))
            return tuple(self[i] for i in range(start, stop, step))
        i = operator.index(index)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {index} out of range for {self._len} items")
        return self[i]

    def __iter__(self) -> Iterator[_T]:
        return self._make(0, self._len)

    def _equal_items(self, other: Sequence[object]) -> bool:
        return len(other) == self._len and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to the tuple of its items, so hashed as that tuple (O(len))


# One run of a chunk table: ``count`` chunks of ``nbytes`` each, back to back from ``offset``.
Run = tuple[int, int, int]


class ChunkTable(_LazyTable[Chunk]):
    """An immutable sequence of chunks, stored as runs of equal, back-to-back chunks.

    A buffer's plan is at most three runs (a short head for unaligned memory, the full chunks,
    a short tail), so a table costs O(runs) memory whatever its length; indexing finds the run
    by bisection (recently used chunks come from a small cache), iteration makes each
    :class:`Chunk` as it goes. It behaves as a tuple of chunks does: ``len``, indices
    (negative too), slices (a contiguous slice is a ChunkTable), ``in``, ``index``, ``count``,
    and equality with tuples and other tables.
    """

    __slots__ = ("_runs", "_starts")

    def __init__(self, runs: Iterable[Run] = ()) -> None:
        merged: list[Run] = []
        for offset, nbytes, count in runs:
            if count <= 0:
                continue
            if merged:
                last_offset, last_nbytes, last_count = merged[-1]
                if last_nbytes == nbytes and last_offset + last_nbytes * last_count == offset:
                    merged[-1] = (last_offset, nbytes, last_count + count)
                    continue
            merged.append((offset, nbytes, count))
        starts: list[int] = []
        total = 0
        for _offset, _nbytes, count in merged:
            starts.append(total)
            total += count
        # Maximal runs are unique for a given sequence, so equal tables have equal runs.
        self._runs = tuple(merged)
        self._starts = tuple(starts)
        self._len = total
        self._cache = {}

    @classmethod
    def of(cls, chunks: Iterable[Chunk]) -> ChunkTable:
        """A table of these chunks (consecutive equal, back-to-back ones share a run)."""
        return cls((c.offset, c.nbytes, 1) for c in chunks)

    @classmethod
    def concat(cls, tables: Iterable[ChunkTable]) -> ChunkTable:
        return cls(run for table in tables for run in table._runs)

    @property
    def runs(self) -> tuple[Run, ...]:
        """``(offset, nbytes, count)`` per run, in sequence order."""
        return self._runs

    @property
    def nbytes(self) -> int:
        """The bytes of all chunks together."""
        return sum(nbytes * count for _offset, nbytes, count in self._runs)

    def shifted(self, delta: int) -> ChunkTable:
        """The same chunks with ``delta`` added to every offset."""
        return ChunkTable((offset + delta, nbytes, count) for offset, nbytes, count in self._runs)

    def _make(self, lo: int, hi: int) -> Iterator[Chunk]:
        if lo >= hi:
            return
        run = bisect_right(self._starts, lo) - 1
        for (offset, nbytes, count), first in zip(self._runs[run:], self._starts[run:], strict=True):
            if first >= hi:
                return
            for k in range(max(lo, first) - first, min(hi, first + count) - first):
                yield _fast_chunk(offset + k * nbytes, nbytes)

    def _slice(self, lo: int, hi: int) -> ChunkTable:
        runs: list[Run] = []
        for (offset, nbytes, count), first in zip(self._runs, self._starts, strict=True):
            start, stop = max(lo, first), min(hi, first + count)
            if start < stop:
                runs.append((offset + (start - first) * nbytes, nbytes, stop - start))
        return ChunkTable(runs)

    def __reversed__(self) -> Iterator[Chunk]:
        for offset, nbytes, count in reversed(self._runs):
            for k in range(count - 1, -1, -1):
                yield _fast_chunk(offset + k * nbytes, nbytes)

    def _positions(self, value: object) -> Iterator[int]:
        """Indices holding ``value``, in order, found arithmetically run by run."""
        if not isinstance(value, Chunk):
            return
        for (offset, nbytes, count), first in zip(self._runs, self._starts, strict=True):
            if nbytes != value.nbytes:
                continue
            delta = value.offset - offset
            if nbytes == 0:
                if delta == 0:
                    yield from range(first, first + count)
            elif delta >= 0 and delta % nbytes == 0 and delta // nbytes < count:
                yield first + delta // nbytes

    def __contains__(self, value: object) -> bool:
        return next(self._positions(value), None) is not None

    def index(self, value: Any, start: int = 0, stop: int | None = None) -> int:
        lo, hi, _step = slice(start, stop).indices(self._len)
        for position in self._positions(value):
            if lo <= position < hi:
                return position
        raise ValueError(f"{value!r} is not in the chunk table")

    def count(self, value: Any) -> int:
        return sum(1 for _ in self._positions(value))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return self._runs == other._runs
        if isinstance(other, tuple):
            return self._equal_items(other)
        return NotImplemented

    __hash__ = _LazyTable.__hash__

    def __repr__(self) -> str:
        if self._len <= 4:
            return f"ChunkTable({tuple(self)!r})"
        shown = ", ".join(f"{count}x{nbytes}@{offset}" for offset, nbytes, count in self._runs[:4])
        more = f", ... {len(self._runs) - 4} more runs" if len(self._runs) > 4 else ""
        return f"<ChunkTable of {self._len} chunks: {shown}{more}>"


@dataclass(frozen=True)
class Span:
    """One populate call: part of chunk ``chunk`` (an index), offsets relative to the pool."""

    chunk: int
    offset: int
    nbytes: int


class SpanTable(_LazyTable[Span]):
    """Every chunk of a table cut into spans of at most ``span_bytes``, computed lazily.

    Span boundaries are each chunk's start plus multiples of ``span_bytes`` (the last span of a
    chunk may be shorter); a span never crosses chunks. O(runs of the chunk table) memory.
    Slices are tuples.
    """

    __slots__ = ("_runs", "_starts", "chunks", "span_bytes")

    def __init__(self, chunks: Sequence[Chunk], span_bytes: int) -> None:
        if isinstance(span_bytes, bool) or not isinstance(span_bytes, int) or span_bytes <= 0:
            raise ValueError(f"span_bytes={span_bytes} must be positive")
        table = chunks if isinstance(chunks, ChunkTable) else ChunkTable.of(chunks)
        self.chunks = table
        self.span_bytes = span_bytes
        # Per chunk run: (first chunk index, offset, nbytes, count, spans per chunk).
        runs: list[tuple[int, int, int, int, int]] = []
        starts: list[int] = []
        total = 0
        for (offset, nbytes, count), first in zip(table.runs, table._starts, strict=True):
            per = -(-nbytes // span_bytes)
            if per > 0:
                runs.append((first, offset, nbytes, count, per))
                starts.append(total)
                total += per * count
        self._runs = tuple(runs)
        self._starts = tuple(starts)
        self._len = total
        self._cache = {}

    def spans_in(self, nbytes: int) -> int:
        """How many spans a chunk of ``nbytes`` is cut into."""
        return -(-nbytes // self.span_bytes)

    @property
    def nbytes(self) -> int:
        """The bytes of all spans together (those of all chunks)."""
        return self.chunks.nbytes

    def _make(self, lo: int, hi: int) -> Iterator[Span]:
        if lo >= hi:
            return
        span_bytes = self.span_bytes
        run = bisect_right(self._starts, lo) - 1
        for (first, offset, nbytes, count, per), start in zip(self._runs[run:], self._starts[run:], strict=True):
            if start >= hi:
                return
            for j in range(max(lo, start) - start, min(hi, start + count * per) - start):
                k, within = divmod(j, per)
                begin = within * span_bytes
                yield Span(first + k, offset + k * nbytes + begin, min(span_bytes, nbytes - begin))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SpanTable) and other.span_bytes == self.span_bytes and other.chunks == self.chunks:
            return True
        if isinstance(other, SpanTable | tuple):
            return self._equal_items(other)
        return NotImplemented

    __hash__ = _LazyTable.__hash__

    def __repr__(self) -> str:
        return f"<SpanTable of {self._len} spans of <= {self.span_bytes} B over {len(self.chunks)} chunks>"


@dataclass(frozen=True)
class ChunkPlan:
    """How one buffer of ``nbytes`` is registered.

    ``granularity`` is the layout's copy-page size (``None``: no constraint), ``unit`` the
    step every chunk boundary is a multiple of (lcm of granularity and OS page), and
    ``chunk_bytes`` the size of every chunk but possibly the last.

    ``origin`` is where the grid of allowed boundaries starts: every boundary (planned, or
    cut later by a retry or the stall budget) is ``origin + k * unit`` bytes from the
    buffer's start. 0 for page-aligned memory; for memory starting mid-page, the first
    multiple of the granularity on an OS page, or 0 again where there is none and
    neighbours may share their boundary page (``shared_pages``); ``None`` where there is
    none and they may not, so the buffer is never cut (it must fit one call).
    ``shared_pages``: the boundaries fall inside OS pages, each page shared by the two
    chunks around it (only planned for runtimes that track exact byte ranges).
    """

    nbytes: int
    granularity: int | None
    page_size: int
    limit: int
    unit: int
    chunk_bytes: int
    chunks: ChunkTable
    origin: int | None = 0
    shared_pages: bool = False


def chunk_limit_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """The per-call limit in bytes from ``PINPOOL_REGISTER_CHUNK_GB`` (GiB, fractions allowed)."""
    env = os.environ if environ is None else environ
    raw = env.get(CHUNK_ENV)
    if raw is None:
        return DEFAULT_CHUNK_GIB << 30
    return parse_env_gib(CHUNK_ENV, raw, default_gib=DEFAULT_CHUNK_GIB)


def resolve_chunk_limit(chunk_bytes: int | str | None) -> int:
    """``chunk_bytes=`` when given (int or size string), else the environment, else 256 GiB."""
    if chunk_bytes is None:
        return chunk_limit_from_env()
    return parse_size(chunk_bytes, what="chunk_bytes")


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


def _first_boundary(granularity: int, page_size: int, misalignment: int, unit: int) -> int:
    """The smallest B > 0 with B % granularity == 0 and (misalignment + B) % page_size == 0; 0 if aligned."""
    boundary = _aligned_boundary(granularity, page_size, misalignment, unit)
    if boundary is None:
        raise _no_aligned_boundary(granularity, misalignment)
    return boundary


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


class Order(enum.Enum):
    """How pre-faulting and registration are ordered (see :mod:`pinpool._pipeline`)."""

    POPULATE_FIRST = "populate_first"
    REGISTER_FIRST = "register_first"
    REGISTER_ONLY = "register_only"


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


def _human(nbytes: int) -> str:
    """``format_bytes``, safe for absurd values (no float overflow, no int-to-str digit limit)."""
    return format_bytes(nbytes) if nbytes.bit_length() <= 128 else f"about 2**{nbytes.bit_length() - 1} B"


def _bytes_text(nbytes: int) -> str:
    return f"{nbytes} B = {format_bytes(nbytes)}" if nbytes.bit_length() <= 128 else _human(nbytes)


# -- host checks: pure, against HostFacts ---------------------------------------------------------


def check_numa_node(node: int | None, nodes: Sequence[int]) -> None:
    if node is None:
        return
    if isinstance(node, bool) or not isinstance(node, int) or node not in nodes:
        raise ConfigError(
            f"numa_node={node!r} is not a NUMA node with memory on this host (nodes: {', '.join(map(str, nodes))}); "
            "give one of those, or None to let the kernel place the memory"
        )


def check_thp_mode(mode: str | None) -> None:
    """huge_pages=True needs transparent huge pages in 'always' or 'madvise' mode."""
    if mode not in ("always", "madvise"):
        raise ConfigError(
            f"huge_pages=True needs transparent huge pages, but "
            f"/sys/kernel/mm/transparent_hugepage/enabled is {mode or 'missing'}; "
            "set it to 'madvise' (echo madvise > /sys/kernel/mm/transparent_hugepage/enabled) "
            "or use huge_pages=False"
        )


def check_hugetlb_pages(nbytes: int, *, free: int, total: int, huge_page_size: int) -> None:
    """huge_pages='hugetlb' needs enough free huge pages reserved in the hugetlb pool."""
    needed = -(-nbytes // huge_page_size)
    if free < needed:
        page = format_bytes(huge_page_size)
        raise ConfigError(
            f"huge_pages='hugetlb' needs {needed} free {page} hugetlb pages "
            f"({_human(needed * huge_page_size)}), "
            f"but the host has {free} free of {total} reserved; reserve them first "
            f"(echo {total - free + needed} > /proc/sys/vm/nr_hugepages, or hugepages= on the kernel command line), "
            "or use huge_pages=True (transparent huge pages, nothing to reserve)"
        )


def check_address_space(mapping_bytes: int, *, size: int, address_space: int) -> None:
    """A pool bigger than the process's address space can never be mapped: refuse it now, in
    microseconds, rather than fail in mmap (or run out of memory planning it)."""
    if mapping_bytes > address_space:
        raise ConfigError(
            f"size={_bytes_text(size)} needs {_human(mapping_bytes)} of address space, more than a process "
            f"on this host can map at all ({_human(address_space)}, its user address space); "
            "give a size that fits the host's memory"
        )


# -- the memory pre-flight: what pinning makes resident and locked, against what the host allows -----

# Every 4 KiB page mapped needs an 8-byte page-table entry, resident and charged to the memory
# cgroup like the page itself: 0.2% of a pool, 2 GiB per TiB. THP keeps a deposited page table per
# huge page as well (to split it later), so the estimate holds with huge_pages=True too.
_PTE_BYTES = 8

_RAISE_MEMLOCK = (
    "raise the limit (`ulimit -l unlimited`; systemd `LimitMEMLOCK=infinity`; docker `--ulimit memlock=-1:-1`; "
    "/etc/security/limits.conf `memlock unlimited`), grant the process CAP_IPC_LOCK"
)


@dataclass(frozen=True)
class Pinning:
    """What pinning with a runtime costs the host. resident: every pinned page is faulted in and
    can be neither swapped out nor reclaimed (charged to the memory cgroup). memlock: the pages
    are charged to RLIMIT_MEMLOCK too (mlock; CUDA's driver may or may not, so it is not assumed)."""

    resident: bool
    memlock: bool


def runtime_pinning(runtime: object, host: HostFacts) -> Pinning | None:
    """What pinning with ``runtime`` costs: a name as the user gave it (``"auto"``, ``"mlock"``,
    ``"cuda"``, ``"rocm"``) or a runtime object. None when nothing is known to be pinned for
    real: None (not said), an unknown name (resolving it raises the ConfigError), FakeRuntime
    (it touches no memory, so tests may plan pools far beyond this host).

    ``"auto"`` is judged from the host facts, without starting a GPU driver: mlock (and its
    memlock budget) unless torch was built for CUDA with the NVIDIA driver loaded, or for ROCm
    with /dev/kfd. A GPU stack with no visible device resolves to mlock after all; its memlock
    shortfall then surfaces as mlock's own ENOMEM, in a PinError after a full rollback.
    """
    if runtime is None:
        return None
    if isinstance(runtime, str):
        if runtime == "auto":
            gpu = bool(host.torch_cuda and host.nvidia_driver) or bool(host.torch_hip and host.amd_kfd)
            return Pinning(resident=True, memlock=not gpu)
        if runtime in ("cuda", "rocm", "mlock"):
            return Pinning(resident=True, memlock=runtime == "mlock")
        return None
    if _is_a(runtime, "FakeRuntime"):
        return None
    # Any other object pins for real: that is what a runtime is for.
    return Pinning(resident=True, memlock=_is_a(runtime, "MlockRuntime"))


def _is_a(runtime: object, name: str) -> bool:
    """Whether ``runtime`` is (a subclass of) pinpool's class ``name``. By name, not ``isinstance``:
    tests replace ``pinpool.testing.FakeRuntime`` with factories, and the runtimes import the
    modules this one is imported by."""
    return any(c.__name__ == name and c.__module__.startswith("pinpool.") for c in type(runtime).__mro__)


def check_memory_available(nbytes: int, host: HostFacts, *, subject: str) -> None:
    """Refuse to pin ``nbytes`` of new memory where the process may not make that much resident:
    the memory cgroup's room (limit - usage + reclaimable page cache) and MemAvailable, the smaller.

    Pinned pages stay resident, so past the cgroup's limit the kernel cannot reclaim them and
    OOM-kills the process (exit 137) instead of failing a call that could be rolled back. Unknown
    figures are not guessed at: with neither known, nothing is checked.
    """
    available = host.memory_available
    tables = -(-nbytes // host.page_size) * _PTE_BYTES
    needed = nbytes + tables
    if available is None or needed <= available:
        return
    limit, usage, cache = host.cgroup_memory_limit, host.cgroup_memory_usage, host.cgroup_memory_reclaimable
    room, mem = host.cgroup_room, host.mem_available
    mem_text = "MemAvailable is unknown" if mem is None else f"MemAvailable is {_human(mem)}"
    if room is None or limit is None:
        sources = f"{mem_text} and no memory cgroup limit applies"
        fixes = "or free memory on the host (other processes, other pools)"
    else:
        used = "usage unknown" if usage is None else f"{_human(usage)} in use"
        if usage is not None and cache:
            used += f", {_human(cache)} of it reclaimable page cache"
        cgroup = f"memory cgroup {host.cgroup_path or '/'} (cgroup v{host.cgroup_version or '?'})"
        cgroup_text = f"the {cgroup} has a limit of {_human(limit)} ({used}), leaving {_human(room)}"
        if mem is None or room <= mem:  # the cgroup binds
            limit_file = "memory.max" if host.cgroup_version == 2 else "memory.limit_in_bytes"
            sources = f"{cgroup_text}; {mem_text}"
            fixes = (
                f"raise the container's memory limit ({limit_file} of that cgroup: docker run --memory, "
                "Kubernetes resources.limits.memory) or free memory in it"
            )
        else:
            sources = f"{mem_text} ({cgroup_text})"
            fixes = "or free memory on the host (other processes, other pools)"
    fit = available * host.page_size // (host.page_size + _PTE_BYTES) // host.page_size * host.page_size
    raise ConfigError(
        f"{subject} cannot be pinned here: it needs {_human(needed)} of memory ({_human(nbytes)} of pages plus "
        f"{_human(tables)} of page tables), but only {_human(available)} is available: {sources}. Pinned pages can be "
        "neither swapped out nor reclaimed, so pinning this pool would get the process OOM-killed (exit 137) "
        f"rather than fail. Give a smaller size (at most {_human(fit)} fits now), {fixes}; "
        "nothing has been mapped or pinned"
    )


def check_memlock(nbytes: int, host: HostFacts, *, subject: str) -> None:
    """Refuse to mlock ``nbytes`` past RLIMIT_MEMLOCK: without CAP_IPC_LOCK, the soft limit must
    cover what this process has locked already (VmLck) plus the pool, or mlock fails part-way."""
    soft = host.memlock_soft
    if host.cap_ipc_lock or soft is None:
        return
    left = max(0, soft - host.locked_bytes)
    if nbytes <= left:
        return
    hard = "unlimited" if host.memlock_hard is None else _human(host.memlock_hard)
    raise ConfigError(
        f"{subject} needs {_human(nbytes)} locked with mlock, but RLIMIT_MEMLOCK leaves only {_human(left)}: "
        f"soft limit {_human(soft)} (hard {hard}), {_human(host.locked_bytes)} already locked by this process "
        "(VmLck), and no CAP_IPC_LOCK, so mlock would fail with ENOMEM part-way. "
        f"{_RAISE_MEMLOCK[0].upper()}{_RAISE_MEMLOCK[1:]}, or give a smaller size (at most {_human(left)} fits now); "
        "nothing has been mapped or pinned"
    )


@dataclass(frozen=True)
class BufferPlan:
    """Where one layout buffer sits in the pool's mapping, and how it is chunked."""

    spec: BufferSpec
    offset: int  # bytes from the start of the mapping
    plan: ChunkPlan | None  # None for a zero-byte buffer: nothing to register
    chunks: ChunkTable  # its chunks, offsets relative to the mapping


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
    page_size: int  # the OS page chunks are aligned to
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
    span_bytes: int  # 0 without pre-faulting
    spans: Sequence[Span]  # a SpanTable, or () without pre-faulting
    lookahead_bytes: int
    # The chunks in the order they are pinned: offset order, interleaved across page runs so
    # the pinned page prefix grows from the start (see _prefix.py); and those runs.
    pin_chunks: ChunkTable
    page_runs: tuple[PageRun, ...]


@dataclass(frozen=True)
class _Placement:
    num_pages: int
    specs: tuple[BufferSpec, ...]
    offsets: tuple[int, ...]
    nbytes: int
    align: int
    mapping_bytes: int


def _place(options: PoolOptions, host: HostFacts) -> _Placement:
    """Pages, buffers and their offsets in the mapping, after the host checks that need no runtime."""
    check_numa_node(options.numa_node, host.numa_nodes)
    if options.huge_pages is True:
        check_thp_mode(host.thp_mode)
    layout = options.layout
    num_pages = options.size // layout.page_bytes
    specs = tuple(layout.buffers(num_pages))
    align = host.huge_page_size if options.huge_pages else host.page_size
    offsets: list[int] = []
    offset = 0
    for spec in specs:
        offsets.append(offset)
        offset += -(-spec.nbytes // align) * align
    mapping_bytes = max(offset, host.page_size)
    check_address_space(mapping_bytes, size=options.size, address_space=host.address_space_bytes)
    if options.huge_pages == "hugetlb":
        check_hugetlb_pages(
            mapping_bytes, free=host.hugetlb_free, total=host.hugetlb_total, huge_page_size=host.huge_page_size
        )
    nbytes = sum(spec.nbytes for spec in specs)
    return _Placement(num_pages, specs, tuple(offsets), nbytes, align, mapping_bytes)


def check_host(
    options: PoolOptions, host: HostFacts, runtime: object = None, *, new_memory: bool = True,
    new_bytes: int | None = None,
) -> None:  # fmt: skip
    """The pre-flight: every check against the host that needs no resolved runtime, before
    anything is mapped. Callable before a runtime is resolved, since resolving one (CUDA) may
    initialise a GPU driver, which a doomed configuration should not wait for.

    Always: the checks :func:`plan_pool` makes too (NUMA node, THP, address space, hugetlb
    pages). With ``runtime`` (the user's name for it, or a runtime object; see
    :func:`runtime_pinning`): the memory the pool would pin against what the process may still
    make resident (memory cgroup, MemAvailable; not for hugetlb pages, which are reserved, nor
    for a caller's tensor, ``new_memory=False``, which may be resident already) and, under
    mlock, against RLIMIT_MEMLOCK. ``new_bytes``: a shared file's pool (``memory=``) needs only
    the pages the file does not hold yet as new memory; it locks all of them all the same.
    """
    place = _place(options, host)
    pinning = runtime_pinning(runtime, host)
    if pinning is None:
        return
    page = host.page_size
    subject = f"size={_bytes_text(options.size)}" if new_memory else f"pin(tensor) of {_bytes_text(options.size)}"
    if pinning.resident and new_memory and options.huge_pages != "hugetlb":
        needed = place.mapping_bytes if new_bytes is None else new_bytes
        if needed:
            check_memory_available(needed, host, subject=subject)
    if pinning.memlock:
        # mlock charges the pages each chunk covers: every buffer rounded out to pages (a caller's
        # tensor may start mid-page: one page more).
        locked = sum(-(-spec.nbytes // page) * page for spec in place.specs) + (0 if new_memory else page)
        check_memlock(locked, host, subject=subject)


def plan_pool(options: PoolOptions, host: HostFacts, caps: Capabilities, *, source_start: int = 0) -> PoolPlan:
    """Plan a pool: a pure function of its options, the host's facts and the runtime's abilities.

    ``source_start`` is the memory's start modulo the OS page: 0 for memory pinpool maps
    (page-aligned), a caller's tensor's ``data_ptr() % page_size`` for :func:`pinpool.pin`.
    Raises :class:`ConfigError` for anything the host cannot do (NUMA node, THP, hugetlb pages,
    MADV_POPULATE_WRITE, a size beyond the address space) or the options cannot satisfy.
    """
    place = _place(options, host)
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
    total = place.nbytes
    by_size = max(1, total // MIN_BYTES_PER_DEFAULT_WORKER)
    wanted_register = options.register_workers or min(by_size, default_register_workers(caps, host.cpus))
    wanted_populate = (options.populate_workers or min(by_size, default_populate_workers(host.cpus))) if populate else 0
    # An explicit chunk_bytes= is the chunk size; the default (or the environment's) is an
    # upper bound that is split further so the workers have chunks to share and overlap.
    limit = options.chunk_limit
    workers = max(wanted_register, wanted_populate)
    split_limit = limit if options.chunk_bytes is not None else parallel_limit(limit, total, workers)
    page_size = host.page_size
    buffers: list[BufferPlan] = []
    for spec, offset in zip(place.specs, place.offsets, strict=True):
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
            spec.nbytes, granularity=spec.granularity, limit=plan_limit, page_size=page_size, start=source_start,
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
    span_bytes = span_bytes_for(chunk_bytes, wanted_populate, place.align) if populate else 0
    spans: Sequence[Span] = SpanTable(chunks, span_bytes) if populate else ()
    populate_workers = min(wanted_populate, len(spans))
    unpin_workers = max(1, min(options.unpin_workers or default_unpin_workers(host.cpus), len(chunks)))
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
    from ._prefix import page_runs, pin_order  # it builds on this module's tables

    runs = page_runs([(b.offset, b.spec.nbytes, b.spec.page_runs) for b in buffers], place.num_pages)
    return PoolPlan(
        nbytes=total, num_pages=place.num_pages, page_bytes=options.layout.page_bytes, chunk_limit=limit,
        chunk_bytes=chunk_bytes, granularity=granularity, populate=populate, huge_pages=huge_pages,
        numa_node=options.numa_node, page_size=page_size, align=place.align, source_start=source_start,
        buffers=tuple(buffers), mapping_bytes=place.mapping_bytes, chunks=chunks, order=order,
        register_workers=register_workers, populate_workers=populate_workers, unpin_workers=unpin_workers,
        threads=threads, span_bytes=span_bytes, spans=spans, lookahead_bytes=lookahead_bytes,
        pin_chunks=pin_order(chunks, runs), page_runs=runs,
    )  # fmt: skip


def _one_call(spec: BufferSpec, page_size: int, bound: int | None) -> ChunkPlan:
    """``chunk_bytes="buffer"``: the buffer is one registration, never cut: no grid
    (``origin=None``), so neither a retry nor the stall budget can split it."""
    if bound is not None and spec.nbytes > bound:
        raise ConfigError(
            f'chunk_bytes="buffer": buffer {spec.name!r} holds {_bytes_text(spec.nbytes)}, more than '
            f"max_chunk_bytes={_bytes_text(bound)}, and one registration per buffer cannot be cut; raise "
            'max_chunk_bytes=, or let pinpool chunk the buffer (drop chunk_bytes="buffer")'
        )
    unit = math.lcm(spec.granularity or 1, page_size)
    whole = ChunkTable([(0, spec.nbytes, 1)])
    return ChunkPlan(spec.nbytes, spec.granularity, page_size, spec.nbytes, unit, spec.nbytes, whole, origin=None)


@dataclass(frozen=True)
class RetryGrid:
    """Where chunks of one buffer may be cut: ``origin + k * unit``, within ``[start, end)``."""

    start: int
    end: int
    unit: int
    origin: int


@dataclass(frozen=True)
class RetrySplitter:
    """Halves of a failed chunk for a retry that keep every planning invariant: the cut is on its
    buffer's grid (a multiple of lcm(granularity, OS page) from the buffer's first boundary), and
    neither half is below ``floor_bytes`` (min_chunk_bytes) or one unit. Pure."""

    grids: tuple[RetryGrid, ...]
    floor_bytes: int

    def split(self, chunk: Chunk) -> tuple[Chunk, Chunk] | None:
        grid = next((g for g in self.grids if g.start <= chunk.offset < g.end), None)
        if grid is None:
            return None
        floor = max(self.floor_bytes, grid.unit)
        if chunk.nbytes < 2 * floor:
            return None
        mid = chunk.offset + chunk.nbytes // 2
        cut = grid.origin + (mid - grid.origin) // grid.unit * grid.unit
        if cut - chunk.offset < floor:
            cut += grid.unit
        if cut - chunk.offset < floor or chunk.end - cut < floor:
            return None
        return Chunk(chunk.offset, cut - chunk.offset), Chunk(cut, chunk.end - cut)

    def first_piece(self, chunk: Chunk, at_most: int) -> Chunk:
        """The first piece of ``chunk`` of at most ``at_most`` bytes cut on its buffer's grid (one
        unit when ``at_most`` is less), or the whole chunk where no cut fits (the stall budget)."""
        grid = next((g for g in self.grids if g.start <= chunk.offset < g.end), None)
        if grid is None or chunk.nbytes <= at_most:
            return chunk
        cut = grid.origin + (chunk.offset + at_most - grid.origin) // grid.unit * grid.unit
        if cut <= chunk.offset:
            cut = grid.origin + ((chunk.offset - grid.origin) // grid.unit + 1) * grid.unit
        return chunk if cut >= chunk.end else Chunk(chunk.offset, cut - chunk.offset)

    def unit_of(self, chunk: Chunk) -> int:
        """The cut unit of ``chunk``'s buffer (lcm(granularity, OS page)); its size where it has none."""
        grid = next((g for g in self.grids if g.start <= chunk.offset < g.end), None)
        return chunk.nbytes if grid is None else grid.unit


def retry_splitter(plan: PoolPlan, min_chunk_bytes: int) -> RetrySplitter:
    """The retry cuts allowed in ``plan``'s buffers: each buffer's own grid (``ChunkPlan.origin``),
    so a caller's unaligned tensor keeps its page-aligned boundaries, or its shared-page grid."""
    grids = []
    for buffer in plan.buffers:
        if buffer.plan is None or buffer.plan.origin is None:  # no aligned cut exists: never split
            continue
        grids.append(
            RetryGrid(
                buffer.offset, buffer.offset + buffer.spec.nbytes, buffer.plan.unit, buffer.offset + buffer.plan.origin
            )
        )
    return RetrySplitter(tuple(grids), min_chunk_bytes)
