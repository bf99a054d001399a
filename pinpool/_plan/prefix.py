"""Which leading pages of a pool are pinned (:class:`PrefixTracker`), and the chunk order that makes them
grow early (:func:`pin_order`). A buffer is ``page_runs`` equal runs (a K/V buffer's halves, layer_first's
layers); page *i* is usable once its slice of every run is pinned."""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .chunks import Chunk, ChunkTable

# Interleaving materialises the order: beyond this many chunks the pool keeps offset order.
MAX_INTERLEAVED_CHUNKS = 1 << 20


@dataclass(frozen=True)
class PageRun:
    """Bytes ``[start, end)`` of the pool holding one slice per page, ``page_bytes`` each
    (None: the pages' bytes are not in page order; usable only once the whole run is pinned)."""

    start: int
    end: int
    page_bytes: int | None
    # Bytes nothing registers (between a strided view's rows, or ranges=): counted pinned from the start.
    holes: tuple[tuple[int, int], ...] = ()


def page_runs(buffers: Sequence[tuple[int, int, int | None]], num_pages: int) -> tuple[PageRun, ...]:
    """The runs of buffers given as ``(offset in the pool, nbytes, page_runs)``."""
    runs: list[PageRun] = []
    for offset, nbytes, count in buffers:
        if nbytes <= 0:
            continue
        if count is None or count <= 0 or num_pages <= 0 or nbytes % (count * num_pages):
            runs.append(PageRun(offset, offset + nbytes, None))
            continue
        length = nbytes // count
        runs.extend(PageRun(offset + k * length, offset + (k + 1) * length, length // num_pages) for k in range(count))
    return tuple(runs)


def pin_order(chunks: ChunkTable, runs: Sequence[PageRun]) -> ChunkTable:
    """``chunks`` in pin order: with several runs, merged by the fraction of its run each completes."""
    if len(runs) <= 1 or len(chunks) > MAX_INTERLEAVED_CHUNKS:
        return chunks

    def keyed(run_index: int, run: PageRun) -> Iterator[tuple[float, int, Chunk]]:
        length = run.end - run.start
        first = bisect.bisect_right(chunks, run.start, key=lambda chunk: chunk.end)  # the first ending after it
        for index in range(first, len(chunks)):
            if (chunk := chunks[index]).offset >= run.end:
                return
            yield (min(chunk.end, run.end) - run.start) / length, run_index, chunk

    merged = heapq.merge(*(keyed(i, run) for i, run in enumerate(runs)))
    # A chunk spanning runs is keyed once per run: keep its first.
    return ChunkTable.of(dict.fromkeys(chunk for _key, _run, chunk in merged))


class PrefixTracker:
    """Leading pages pinned: per run, the covered prefix and a heap of pinned ranges beyond it."""

    def __init__(self, runs: Sequence[PageRun], num_pages: int) -> None:
        self.runs = tuple(sorted(runs, key=lambda r: r.start))
        self.num_pages = num_pages
        self._starts = [run.start for run in self.runs]
        self._done = [run.start for run in self.runs]  # absolute end of each run's pinned prefix
        self._ahead: list[list[tuple[int, int]]] = [[] for _ in self.runs]  # heaps of ranges beyond it
        self.pages = 0 if self.runs else num_pages  # leading pages pinned: written by cover() only
        for run in self.runs:
            for lo, hi in run.holes:
                self.cover(lo, hi)

    def cover(self, start: int, end: int) -> None:
        index = max(0, bisect.bisect_right(self._starts, start) - 1)
        changed = False
        while index < len(self.runs) and self.runs[index].start < end:
            run = self.runs[index]
            lo, hi = max(start, run.start), min(end, run.end)
            if lo < hi:
                changed |= self._add(index, lo, hi)
            index += 1
        if changed:
            self.pages = self._count()

    def _add(self, index: int, lo: int, hi: int) -> bool:
        done, ahead = self._done[index], self._ahead[index]
        if lo > done:
            heapq.heappush(ahead, (lo, hi))
            return False
        done = max(done, hi)
        while ahead and ahead[0][0] <= done:
            done = max(done, heapq.heappop(ahead)[1])
        self._done[index] = done
        return True

    def _count(self) -> int:
        pages = self.num_pages
        for run, done in zip(self.runs, self._done, strict=True):
            if run.page_bytes is None:
                pages = min(pages, self.num_pages if done >= run.end else 0)
            else:
                pages = min(pages, (done - run.start) // run.page_bytes)
        return pages
