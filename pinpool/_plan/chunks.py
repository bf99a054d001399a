"""The vocabulary every layer shares: chunks, spans, their lazy tables, chunk plans and pipeline orders.

A :class:`Chunk` is one registration call's range; a :class:`Span` one populate call's. The
tables (:class:`ChunkTable`, :class:`SpanTable`) are sequences computed arithmetically from a
few runs of equal, back-to-back items, so a table of 2**35 chunks costs what one of 3 does.
:class:`ChunkPlan` is how one buffer is registered, :class:`Order` how pre-faulting and
registration are ordered. Plain values with no policy: the planner (:mod:`pinpool._plan.plan`) makes
them, the pipeline, the ledger, the prefix tracker and the errors read them. This module imports
nothing of pinpool's, so every other module may import it.
"""

from __future__ import annotations

import enum
import operator
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

__all__ = ["Chunk", "ChunkPlan", "ChunkTable", "Order", "Run", "Span", "SpanTable"]


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


class Order(enum.Enum):
    """How pre-faulting and registration are ordered (see :mod:`pinpool._pin.pipeline`)."""

    POPULATE_FIRST = "populate_first"
    REGISTER_FIRST = "register_first"
    REGISTER_ONLY = "register_only"
