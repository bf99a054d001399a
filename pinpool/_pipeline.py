"""The pinning pipeline: which populate span or which chunk registration a worker does next.

Pure and synchronous like the ledger it drives: the engine calls it under one lock and
sleeps on a condition when it says ``WAIT``. Three orders:

* ``POPULATE_FIRST`` (CUDA): populate workers pre-fault spans of the next chunks while
  register workers register chunks that are fully faulted, so the driver's serial
  registration overlaps parallel faulting. Faulting runs at most ``lookahead_bytes`` of
  whole chunks ahead of registration (the chunk at the front is always allowed, so a
  chunk larger than the lookahead still progresses).
* ``REGISTER_FIRST`` (mlock): each chunk is registered lock-on-fault (cheap: no page is
  touched), then populate workers fault its spans in parallel and the kernel locks each
  page as it is faulted in: one pass over the memory instead of fault, then lock.
* ``REGISTER_ONLY`` (no pre-faulting): register workers take chunks in order and the
  registration call faults the pages itself.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from ._errors import ChunkFailure, RuntimeCallError
from ._ledger import ChunkState, Ledger, LedgerError, Phase
from ._plan import Chunk, Order, Span, SpanTable
from ._prefix import PrefixTracker

__all__ = ["WAIT", "Batch", "Order", "Pipeline", "Span", "SpanTable", "split_spans"]

T = TypeVar("T")

# A worker's batch of consecutive items stops growing at this many bytes or items.
BATCH_BYTES = 8 << 20
BATCH_ITEMS = 64


class _Wait(enum.Enum):
    WAIT = "wait"


WAIT: Final = _Wait.WAIT
"""Nothing for this role right now, but there will be: sleep until the pipeline changes."""


@dataclass(frozen=True)
class Batch:
    """What one worker does next: ``role`` "register" (chunk indices) or "populate" (spans)."""

    role: str
    items: tuple[int | Span, ...]


def split_spans(chunks: Sequence[Chunk], span_bytes: int) -> SpanTable:
    """Every chunk cut into spans of at most ``span_bytes`` (the last of each chunk may be shorter).

    Span boundaries are the chunk's start plus multiples of ``span_bytes``, so with an aligned
    ``span_bytes`` every span but a chunk's first starts aligned; a span never crosses chunks.
    The result is lazy (a :class:`SpanTable`, equal to the tuple of its spans).
    """
    return SpanTable(chunks, span_bytes)


class Pipeline:
    """Hands out populate spans and chunk registrations, and records how each ended."""

    def __init__(
        self,
        chunks: Sequence[Chunk],
        *,
        order: Order,
        span_bytes: int = 1,
        lookahead_bytes: int = 0,
        register_workers: int = 1,
        populate_workers: int = 1,
        prefix: PrefixTracker | None = None,
    ) -> None:
        if register_workers < 1 or (order is not Order.REGISTER_ONLY and populate_workers < 1):
            raise ValueError(
                f"register_workers={register_workers}, populate_workers={populate_workers}: each role in use "
                "needs at least one worker, or nothing would ever take its work"
            )
        self.ledger = Ledger(chunks)
        self.order = order
        self.register_workers = register_workers
        self.populate_workers = populate_workers
        self._register_batches = 0
        self._populate_batches = 0
        # Lazy: computed from the ledger's chunk table, O(runs) memory however many spans.
        self.spans: Sequence[Span] = () if order is Order.REGISTER_ONLY else split_spans(self.ledger.chunks, span_bytes)
        self._span_bytes = span_bytes
        self._span_total = self.spans.nbytes if isinstance(self.spans, SpanTable) else 0
        self.lookahead_bytes = lookahead_bytes
        self._next_span = 0
        self._spans_landed: dict[int, int] = {}  # spans populated so far, for chunks part-way through
        self._populating = 0
        self._ready: list[int] = []  # POPULATE_FIRST: fully faulted, not yet claimed for registration
        self._window: set[int] = set()  # POPULATE_FIRST: chunks faulting or faulted, registration not landed
        self._window_bytes = 0
        self.populated_bytes = 0
        # Pinned-page bookkeeping for pools used while they pin: each range is reported as it
        # becomes pinned (a registered chunk; a faulted span of a lock-on-fault chunk).
        self.prefix = prefix
        # Pinned bytes of chunks not yet whole: faulted spans of lock-on-fault chunks, and pieces
        # registered so far of chunks registered in several calls (the stall budget).
        self._partial_bytes = 0
        self._piece_bytes: dict[int, int] = {}  # chunk index -> bytes of its pieces counted above
        self._span_parts: dict[tuple[int, int], int] = {}  # REGISTER_FIRST: bytes of spans faulted in parts

    # -- what workers ask for ------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        ledger = self.ledger
        return ledger.stop_cause is not None or ledger.phase is not Phase.PINNING

    @property
    def in_flight(self) -> int:
        """Populate and register calls in progress."""
        return self._populating + self.ledger.in_flight

    def next_work(self) -> Batch | _Wait | None:
        """For a worker that can do either: a batch ``("register", [index, ...])`` or
        ``("populate", [span, ...])`` within each role's concurrency, ``WAIT``, or ``None``
        once nothing is left to hand out. The worker calls :meth:`batch_done` after it.

        Registration comes first: it is the serial bottleneck under CUDA, and under
        lock-on-fault it is what lets faulting start. A batch holds consecutive items until
        they add up to ``BATCH_BYTES`` (a big chunk or span is a batch of one) and at most its
        share of the waiting items, so tiny chunks cost one hand-off per batch, not per chunk.
        """
        if self.stopped or (self._next_span >= len(self.spans) and self.ledger.pending == 0):
            return None
        if self._register_batches < self.register_workers:
            waiting = len(self._ready) if self.order is Order.POPULATE_FIRST else self.ledger.pending
            share = -(-waiting // self.register_workers)
            indices = self._batch(self.next_register, lambda i: self.ledger.chunks[i].nbytes, share)
            if indices:
                self._register_batches += 1
                return Batch("register", tuple(indices))
        if self._populate_batches < self.populate_workers:
            share = -(-(len(self.spans) - self._next_span) // self.populate_workers)
            spans = self._batch(self.next_populate, lambda span: span.nbytes, share)
            if spans:
                self._populate_batches += 1
                return Batch("populate", tuple(spans))
        return self._wait("a worker")

    def _batch(self, take: Callable[[], T | _Wait | None], size: Callable[[T], int], share: int) -> list[T]:
        """Consecutive items up to BATCH_BYTES / BATCH_ITEMS, and no more than this worker's
        ``share`` of what is waiting, so a batch never takes work another worker could overlap."""
        items: list[T] = []
        nbytes = 0
        most = min(BATCH_ITEMS, max(1, share))
        while nbytes < BATCH_BYTES and len(items) < most:
            item = take()
            if item is None or item is WAIT:
                break
            items.append(item)
            nbytes += size(item)
        return items

    def batch_done(self, role: str, unstarted: Sequence[int | Span] = ()) -> None:
        """A worker finished a batch; ``unstarted`` are its items it did not call (pinning stopped)."""
        if role == "register":
            self._register_batches -= 1
        else:
            self._populate_batches -= 1
        for item in unstarted:
            if isinstance(item, Span):
                self._land_span(item)
            else:
                self.ledger.unclaim(item)

    def next_populate(self) -> Span | _Wait | None:
        """The next span to fault, ``None`` when this role is done, or ``WAIT``."""
        if self.stopped or self._next_span >= len(self.spans):
            return None
        span = self.spans[self._next_span]
        blocked = self._blocked(span)
        if blocked is not None:
            return self._wait(f"populate of chunk {span.chunk} ({blocked})")
        if self.order is Order.POPULATE_FIRST and span.chunk not in self._window:
            self._window.add(span.chunk)
            self._window_bytes += self.ledger.chunks[span.chunk].nbytes
        self._next_span += 1
        self._populating += 1
        return span

    def next_register(self) -> int | _Wait | None:
        """The next chunk index to register, ``None`` when this role is done, or ``WAIT``."""
        if self.stopped:
            return None
        ledger = self.ledger
        if self.order is not Order.POPULATE_FIRST:
            return ledger.claim()
        if self._ready:
            index = heapq.heappop(self._ready)
            ledger.claim_index(index)
            return index
        if ledger.pending == 0:
            return None
        return self._wait("registration (no chunk is fully faulted yet)")

    def _wait(self, what: str) -> _Wait:
        # Someone must be able to wake the waiter: a call in flight, or work the other role can take.
        if self.in_flight == 0 and not self._ready and not self._span_available() and not self._claimable():
            raise LedgerError(f"{what} would wait forever: nothing is in flight or ready")
        return WAIT

    def _blocked(self, span: Span) -> str | None:
        """Why ``span`` may not be faulted yet, or None: under REGISTER_FIRST its chunk must be
        registered lock-on-fault first; under POPULATE_FIRST a new chunk must fit the lookahead."""
        if self.order is Order.REGISTER_FIRST:
            state = self.ledger.states[span.chunk]
            return None if state is ChunkState.FAULTING else state.value
        nbytes = self.ledger.chunks[span.chunk].nbytes
        if span.chunk in self._window or not self._window or self._window_bytes + nbytes <= self.lookahead_bytes:
            return None
        return "beyond the lookahead"

    def _span_available(self) -> bool:
        if self.stopped or self._next_span >= len(self.spans):
            return False
        return self._blocked(self.spans[self._next_span]) is None

    def _claimable(self) -> bool:
        if self.stopped or self.order is Order.POPULATE_FIRST:
            return False
        return self.ledger.pending > 0

    # -- how calls ended -------------------------------------------------------------------------

    def populated(self, span: Span) -> int | None:
        """Record a faulted span; returns its chunk's index if that made the chunk pinned (lock-on-fault)."""
        self._land_span(span)
        self.populated_bytes += span.nbytes
        parts = 0
        if self.order is Order.REGISTER_FIRST:
            parts = self._span_parts.pop((span.chunk, span.offset), 0)
            if self.prefix is not None:
                self.prefix.cover(span.offset, span.offset + span.nbytes)  # locked as it faulted
        landed = self._spans_landed.get(span.chunk, 0) + 1
        if landed < -(-self.ledger.chunks[span.chunk].nbytes // self._span_bytes):
            self._spans_landed[span.chunk] = landed
            if self.order is Order.REGISTER_FIRST:
                self._partial_bytes += span.nbytes - parts
            return None
        self._spans_landed.pop(span.chunk, None)
        if self.order is Order.REGISTER_FIRST:
            # The chunk now counts whole in the ledger: drop its earlier spans and this one's parts.
            self._partial_bytes -= self.ledger.chunks[span.chunk].nbytes - span.nbytes + parts
            self.ledger.faulted(span.chunk)  # locked on fault, now every page is in: pinned
            return span.chunk
        if self.ledger.states[span.chunk] is ChunkState.PENDING and not self.stopped:
            heapq.heappush(self._ready, span.chunk)
        return None

    def part_faulted(self, span: Span, offset: int, nbytes: int) -> None:
        """Part of ``span`` was faulted by one of several calls (the stall budget): under
        lock-on-fault that part is locked now, so it counts before the span lands."""
        if self.order is not Order.REGISTER_FIRST:
            return
        key = (span.chunk, span.offset)
        self._span_parts[key] = self._span_parts.get(key, 0) + nbytes
        self._partial_bytes += nbytes
        if self.prefix is not None:
            self.prefix.cover(offset, offset + nbytes)

    def populate_failed(self, span: Span, error: RuntimeCallError) -> None:
        self._land_span(span)
        self.ledger.populate_failed(span.chunk, error)

    def part_registered(self, index: int, piece: Chunk) -> None:
        """One piece of a chunk registered in several calls is pinned now (not under lock-on-fault,
        where a registered piece is pinned only once faulted): it counts before the chunk lands."""
        if self.order is Order.REGISTER_FIRST:
            return
        self._piece_bytes[index] = self._piece_bytes.get(index, 0) + piece.nbytes
        self._partial_bytes += piece.nbytes
        if self.prefix is not None:
            self.prefix.cover(piece.offset, piece.end)

    def _drop_pieces(self, index: int) -> None:
        self._partial_bytes -= self._piece_bytes.pop(index, 0)

    def span_abandoned(self, span: Span) -> None:
        """Pinning stopped part-way through ``span`` (its calls were sized by the stall budget):
        it is no longer in flight, and its chunk never counts as faulted."""
        self._land_span(span)

    def register_stopped(self, index: int, pieces: Sequence[Chunk]) -> None:
        """Pinning stopped part-way through a chunk registered in pieces: the pieces registered
        are undone by the rollback (none: the chunk is simply not registered)."""
        self._drop_pieces(index)
        if pieces:
            self.ledger.partly_registered(index, pieces, ())
        else:
            self.ledger.unclaim(index)
        self._leave_window(index)

    def _land_span(self, span: Span) -> None:
        if self._populating <= 0:
            raise LedgerError(f"span {span} landed with no populate in flight")
        self._populating -= 1

    def registered(self, index: int) -> int | None:
        """Record a registration; returns the index if the chunk is pinned now (not lock-on-fault)."""
        faulting = self.order is Order.REGISTER_FIRST
        self.ledger.registered(index, faulting=faulting)
        self._leave_window(index)
        if faulting:
            return None
        self._cover(index)
        return index

    def register_failed(self, index: int, error: RuntimeCallError, attempts: Sequence[ChunkFailure] = ()) -> None:
        self._drop_pieces(index)
        self.ledger.failed(index, "register", error, attempts)
        self._leave_window(index)

    def registered_in_pieces(self, index: int, pieces: Sequence[Chunk]) -> int | None:
        """A chunk registered as several calls after retries; as :meth:`registered` otherwise."""
        faulting = self.order is Order.REGISTER_FIRST
        self._drop_pieces(index)  # the chunk counts whole from now on
        self.ledger.registered_in_pieces(index, pieces, faulting=faulting)
        self._leave_window(index)
        if faulting:
            return None
        self._cover(index)
        return index

    def _cover(self, index: int) -> None:
        if self.prefix is not None:
            chunk = self.ledger.chunks[index]
            self.prefix.cover(chunk.offset, chunk.end)

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned now: registered chunks, and while pinning under lock-on-fault, the
        faulted (so locked) spans of chunks still faulting (also once pinning stopped early: a
        background pool keeps them locked until it is exited)."""
        partial = self._partial_bytes if self.ledger.phase in (Phase.PINNING, Phase.ROLLED_BACK) else 0
        return self.ledger.registered_bytes + partial

    def register_partly_failed(self, index: int, pieces: Sequence[Chunk], attempts: Sequence[ChunkFailure]) -> None:
        self._drop_pieces(index)
        self.ledger.partly_registered(index, pieces, attempts)
        self._leave_window(index)

    def _leave_window(self, index: int) -> None:
        if index in self._window:
            self._window.remove(index)
            self._window_bytes -= self.ledger.chunks[index].nbytes

    def cancel(self) -> None:
        self.ledger.cancel()

    def finish(self) -> Phase:
        """Close pinning once nothing is in flight; PINNED only if every chunk is registered and faulted."""
        if self._populating:
            raise LedgerError(f"finish with {self._populating} populate calls in flight")
        if self.ledger.stop_cause is None and self.populated_bytes < self._span_total:
            if self.ledger.chunks_done == len(self.ledger.chunks):
                raise LedgerError("finish with every chunk registered but spans left unfaulted")
        return self.ledger.finish_pinning()
