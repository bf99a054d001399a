"""The pinning pipeline: which populate span or chunk registration a worker does next, and how each
ended (one :class:`Landing`). Pure, like the ledger it drives: the engine calls it under one lock and
sleeps when it says ``WAIT``. The orders and the lookahead: docs/concepts.md, "The pipeline"."""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from .._errors import ChunkFailure, LedgerError, RuntimeCallError
from .._plan.chunks import Chunk, Order, Span, SpanTable
from .._plan.prefix import PrefixTracker
from .ledger import ChunkState, Ledger, Phase

T = TypeVar("T")

BATCH_BYTES = 8 << 20  # a worker's batch of consecutive items stops growing at this many bytes,
BATCH_ITEMS = 64  # or items


class _Wait(enum.Enum):
    WAIT = "wait"


WAIT: Final = _Wait.WAIT
"""Nothing for this role right now, but there will be: sleep until the pipeline changes."""


@dataclass(frozen=True)
class Batch:
    """What one worker does next: ``role`` "register" (chunk indices) or "populate" (spans)."""

    role: str
    items: tuple[int | Span | tuple[int, int], ...]


@dataclass(frozen=True)
class Landing:
    """What the calls on one handed-out item (a chunk index or a span) did."""

    item: int | Span | tuple[int, int]  # a chunk, a span, or (registrar, registration) of the transfer books
    error: RuntimeCallError | None = None  # the call that failed (pinning stops)
    stopped: bool = False  # pinning stopped before the item was done or called
    pieces: tuple[Chunk, ...] = ()  # registered, in call order, of a chunk in several calls (rollback undoes them)
    attempts: tuple[ChunkFailure, ...] = ()  # every failed call (empty: just ``error``)
    partial: bool = False  # progress: ``pieces`` are pinned and the item stays in flight
    seconds: float = math.nan  # its one call's time (NaN: observed call by call)
    maybe: tuple[Chunk, ...] = ()  # ranges that failed untrusted: undone like ``pieces``, never pinned
    handle: object = None  # what a transfer registrar's register call returned


@dataclass
class _Out:
    """A batch out with a worker: it ends when the last of its items lands."""

    role: str
    left: int


def take_batch(take: Callable[[], T | _Wait | None], size: Callable[[T], int], share: int) -> list[T]:
    """Consecutive items up to BATCH_BYTES / BATCH_ITEMS and this worker's ``share`` of what waits."""
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


class Pipeline:
    """Hands out populate spans and chunk registrations, and records how each ended."""

    def __init__(
        self, chunks: Sequence[Chunk], *, order: Order, span_bytes: int = 1, lookahead_bytes: int = 0,
        register_workers: int = 1, populate_workers: int = 1, prefix: PrefixTracker | None = None,
        spans: Sequence[Span] | None = None,
    ) -> None:  # fmt: skip
        if register_workers < 1 or (order is not Order.REGISTER_ONLY and populate_workers < 1):
            raise ValueError(
                f"register_workers={register_workers}, populate_workers={populate_workers}: each role in use "
                "needs at least one worker, or nothing would ever take its work"
            )
        self.ledger = Ledger(chunks)
        self.order = order
        self.register_workers = register_workers
        self.populate_workers = populate_workers
        self._batches = {"register": 0, "populate": 0}  # out with a worker, by role
        self._out: dict[int | Span, _Out] = {}  # each batched item not yet landed -> its batch
        self.spans: Sequence[Span] = (
            () if order is Order.REGISTER_ONLY else spans if spans else SpanTable(self.ledger.chunks, span_bytes)
        )
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
        self.prefix = prefix  # told of each range as it becomes pinned (pools used while they pin)
        self._span_parts: dict[tuple[int, int], int] = {}  # REGISTER_FIRST: bytes of spans faulted in parts

    @property
    def stopped(self) -> bool:
        ledger = self.ledger
        return ledger.stop_cause is not None or ledger.phase is not Phase.PINNING

    @property
    def handed_out(self) -> bool:
        """Every span and chunk was handed out (some may still be in flight)."""
        return self._next_span >= len(self.spans) and self.ledger.pending == 0

    @property
    def in_flight(self) -> int:
        return self._populating + self.ledger.in_flight

    def next_work(self) -> Batch | _Wait | None:
        """A batch for a worker of either role, ``WAIT``, or ``None`` once nothing is left; registration first."""
        if self.stopped or (self._next_span >= len(self.spans) and self.ledger.pending == 0):
            return None
        if self._batches["register"] < self.register_workers:
            waiting = len(self._ready) if self.order is Order.POPULATE_FIRST else self.ledger.pending
            share = -(-waiting // self.register_workers)
            indices = take_batch(self.next_register, lambda i: self.ledger.chunks[i].nbytes, share)
            if indices:
                return self._hand_out("register", indices)
        if self._batches["populate"] < self.populate_workers:
            share = -(-(len(self.spans) - self._next_span) // self.populate_workers)
            spans = take_batch(self.next_populate, lambda span: span.nbytes, share)
            if spans:
                return self._hand_out("populate", spans)
        return self._wait("a worker")

    def _hand_out(self, role: str, items: Sequence[int | Span]) -> Batch:
        out = _Out(role, len(items))
        self._batches[role] += 1
        for item in items:
            self._out[item] = out
        return Batch(role, tuple(items))

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
        if self.in_flight == 0 and not self._ready:
            live = not self.stopped
            span = live and self._next_span < len(self.spans) and self._blocked(self.spans[self._next_span]) is None
            claimable = live and self.order is not Order.POPULATE_FIRST and self.ledger.pending > 0
            if not span and not claimable:
                raise LedgerError(f"{what} would wait forever: nothing is in flight or ready")
        return WAIT

    def _blocked(self, span: Span) -> str | None:
        """Why ``span`` may not be faulted yet (its chunk not registered lock-on-fault, or beyond the lookahead)."""
        if self.order is Order.REGISTER_FIRST:
            state = self.ledger.states[span.chunk]
            return None if state is ChunkState.FAULTING else state.value
        nbytes = self.ledger.chunks[span.chunk].nbytes
        if span.chunk in self._window or not self._window or self._window_bytes + nbytes <= self.lookahead_bytes:
            return None
        return "beyond the lookahead"

    def land(self, landing: Landing) -> int | None:
        """Put what the calls on one item did on the books; the chunk's index if that made it pinned."""
        if landing.error is not None and landing.stopped:
            raise LedgerError(f"{landing.item!r} landed both failed and stopped: {landing}")
        if landing.partial and (landing.error is not None or landing.stopped or not landing.pieces):
            raise LedgerError(f"progress of {landing.item!r} must name its pieces and nothing else: {landing}")
        item = landing.item
        assert not isinstance(item, tuple), "a transfer registration lands in the session's Transfers"
        out = None if landing.partial else self._out.pop(item, None)  # None: handed out alone, not in a batch
        if out is not None:
            out.left -= 1
            if out.left == 0:
                self._batches[out.role] -= 1
        if isinstance(item, Span):
            return self._land_span(landing, item)
        return self._land_chunk(landing, item)

    def _land_span(self, landing: Landing, span: Span) -> int | None:
        if landing.partial:  # under lock-on-fault a part faulted is locked: it counts before the span lands
            if self.order is Order.REGISTER_FIRST:
                for part in landing.pieces:
                    key = (span.chunk, span.offset)
                    self._span_parts[key] = self._span_parts.get(key, 0) + part.nbytes
                    self.ledger.pinned_part(span.chunk, part.nbytes)
                    self._cover(part)
            return None
        if self._populating <= 0:
            raise LedgerError(f"span {span} landed with no populate in flight")
        self._populating -= 1
        if landing.error is not None:
            self.ledger.populate_failed(span.chunk, landing.error)
            return None
        if landing.stopped:  # never called, or stopped between its calls: its chunk never counts as faulted
            return None
        self.populated_bytes += span.nbytes
        parts = 0
        if self.order is Order.REGISTER_FIRST:
            parts = self._span_parts.pop((span.chunk, span.offset), 0)
            self._cover(Chunk(span.offset, span.nbytes))  # locked as it faulted
        landed = self._spans_landed.get(span.chunk, 0) + 1
        if landed < -(-self.ledger.chunks[span.chunk].nbytes // self._span_bytes):
            self._spans_landed[span.chunk] = landed
            if self.order is Order.REGISTER_FIRST:
                self.ledger.pinned_part(span.chunk, span.nbytes - parts)
            return None
        self._spans_landed.pop(span.chunk, None)
        if self.order is Order.REGISTER_FIRST:
            self.ledger.faulted(span.chunk)  # locked on fault, now every page is in: pinned, and counted whole
            return span.chunk
        if self.ledger.states[span.chunk] is ChunkState.PENDING and not self.stopped:
            heapq.heappush(self._ready, span.chunk)
        return None

    def _land_chunk(self, landing: Landing, index: int) -> int | None:
        ledger, pieces = self.ledger, landing.pieces
        if landing.partial:  # pieces registered count before the chunk lands (lock-on-fault: once faulted)
            if self.order is not Order.REGISTER_FIRST:
                for piece in pieces:
                    ledger.pinned_part(index, piece.nbytes)
                    self._cover(piece)
            return None
        if index in self._window:
            self._window.remove(index)
            self._window_bytes -= self.ledger.chunks[index].nbytes
        error = landing.error
        # Pieces of a chunk failed or stopped part-way stay pinned until teardown (progress told of some).
        pinned = self.order is not Order.REGISTER_FIRST
        if pieces and (error is not None or landing.stopped) and pinned:
            for piece in pieces:
                self._cover(piece)
        if error is not None:  # every failed attempt is reported (a real out-of-memory is never hidden)
            attempts = landing.attempts or (ChunkFailure(ledger.chunks[index], "register", error),)
            if pieces or landing.maybe:  # the pieces registered are undone by the rollback, from the books
                ledger.partly_registered(index, pieces, attempts, pinned=pinned, maybe=landing.maybe)
            else:
                ledger.failed(index, "register", error, attempts)
            return None
        if landing.stopped:  # what stopped pinning is reported, not this chunk's earlier attempts
            if pieces:
                ledger.partly_registered(index, pieces, (), pinned=pinned)
            else:  # never called, or stopped before its first piece: simply not registered
                ledger.unclaim(index)
            return None
        ledger.registered(index, faulting=not pinned)
        if pieces and pieces != (ledger.chunks[index],):  # teardown unregisters each piece's base
            ledger.pieces[index] = tuple(pieces)
        if not pinned:  # lock-on-fault: pinned once faulted
            return None
        self._cover(ledger.chunks[index])
        return index

    def _cover(self, pinned: Chunk) -> None:
        if self.prefix is not None:
            self.prefix.cover(pinned.offset, pinned.end)

    def finish(self) -> Phase:
        """Close pinning once nothing is in flight; PINNED only if every chunk is registered and faulted."""
        if self._populating:
            raise LedgerError(f"finish with {self._populating} populate calls in flight")
        if self.ledger.stop_cause is None and self.populated_bytes < self._span_total:
            if self.ledger.chunks_done == len(self.ledger.chunks):
                raise LedgerError("finish with every chunk registered but spans left unfaulted")
        return self.ledger.finish_pinning()
