"""The vocabulary every layer shares: :class:`Chunk`, :class:`Span`, their lazy tables, :class:`ChunkPlan`,
:class:`Order`. Plain values importing nothing of pinpool's."""

from __future__ import annotations

import enum
import itertools
import operator
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload


@dataclass(frozen=True, order=True)
class Chunk:
    """One registration call's range, relative to the start of its buffer."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


_T = TypeVar("_T")

# Recently used items are kept in a few small blocks: a lookup while pinned is a dict hit, not a bisection
# and a new object. Few on purpose: items that die young never slow the collector's full passes.
_BLOCK_SHIFT = 4
_BLOCK_MASK = (1 << _BLOCK_SHIFT) - 1
_CACHED_BLOCKS = 8


def _fast_chunk(offset: int, nbytes: int) -> Chunk:
    """``Chunk(offset, nbytes)`` in half the time (no frozen-dataclass ``__init__``; same object)."""
    chunk = object.__new__(Chunk)
    chunk.__dict__.update(offset=offset, nbytes=nbytes)
    return chunk


class _LazyTable(Sequence[_T]):
    """A read-only sequence computed from a few numbers, indexed and sliced as a tuple: subclasses set
    ``_len`` and implement ``_make(lo, hi)``."""

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
        lo, cache = number << _BLOCK_SHIFT, self._cache
        block = tuple(self._make(lo, min(lo + _BLOCK_MASK + 1, self._len)))
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
        return self._block(i >> _BLOCK_SHIFT)[i & _BLOCK_MASK]

    def __iter__(self) -> Iterator[_T]:
        return self._make(0, self._len)

    def _equal_items(self, other: Sequence[object]) -> bool:
        return len(other) == self._len and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to the tuple of its items, so hashed as that tuple (O(len))


# One run of a chunk table: ``count`` chunks of ``nbytes`` each, back to back from ``offset``.
Run = tuple[int, int, int]


class ChunkTable(_LazyTable[Chunk]):
    """Chunks stored as runs of equal, back-to-back chunks: a buffer's plan is at most three runs, so a
    table costs O(runs) whatever its length."""

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
        # Maximal runs are unique for a given sequence, so equal tables have equal runs.
        self._runs = tuple(merged)
        self._starts = tuple(itertools.accumulate((count for _, _, count in merged), initial=0))[:-1]
        self._len = sum(count for _, _, count in merged)
        self._cache = {}

    @classmethod
    def of(cls, chunks: Iterable[Chunk]) -> ChunkTable:
        return cls((c.offset, c.nbytes, 1) for c in chunks)

    @classmethod
    def concat(cls, tables: Iterable[ChunkTable]) -> ChunkTable:
        return cls(run for table in tables for run in table._runs)

    @property
    def runs(self) -> tuple[Run, ...]:
        return self._runs

    @property
    def nbytes(self) -> int:
        return sum(nbytes * count for _offset, nbytes, count in self._runs)

    def shifted(self, delta: int) -> ChunkTable:
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

    def _positions(self, value: object) -> Iterator[int]:  # found arithmetically run by run
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
    """Every chunk cut into spans of at most ``span_bytes`` from its start (never crossing chunks), lazily."""

    __slots__ = ("_runs", "_starts", "chunks", "span_bytes")

    def __init__(self, chunks: Sequence[Chunk], span_bytes: int) -> None:
        if isinstance(span_bytes, bool) or not isinstance(span_bytes, int) or span_bytes <= 0:
            raise ValueError(f"span_bytes={span_bytes} must be positive")
        table = chunks if isinstance(chunks, ChunkTable) else ChunkTable.of(chunks)
        self.chunks, self.span_bytes = table, span_bytes
        runs: list[tuple[int, int, int, int, int]] = []  # per chunk run: first index, offset, nbytes, count, spans each
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
    """How one buffer is registered: chunks of ``chunk_bytes`` (the last maybe shorter) on multiples of
    ``unit`` (lcm(granularity, OS page)). Every boundary, planned or cut later, is ``origin + k * unit``:
    0 page-aligned; mid-page, the first multiple of the granularity on a page, else 0 where chunks may
    share pages (``shared_pages``), else None: never cut."""

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
