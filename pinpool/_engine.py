"""The pinning engine: the synchronous bodies that worker threads run, shared by both drivers.

One :class:`PinSession` per entered pool. Workers are long-lived calls of
:meth:`PinSession.work` that pull chunks from the ledger until it says stop, so a pool
pays one thread hop per worker, not per chunk. Every outcome is recorded in the ledger
inside the worker, under the session lock, so a host that was cancelled while waiting
still knows exactly what to roll back.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

from ._errors import ChunkFailure, RuntimeCallError
from ._ledger import ChunkState, LedgerError, Phase, RegistrationBook, StopCause
from ._libc import MADV_POPULATE_WRITE
from ._memory import populate_range
from ._observe import Observer
from ._pipeline import BATCH_BYTES, BATCH_ITEMS, WAIT, Order, Pipeline, Span, _Wait
from ._plan import Chunk, RetrySplitter
from ._prefix import PrefixTracker
from ._priority import lower_this_thread
from ._stall import CallSizer
from ._types import Capabilities
from .runtimes import LocksOnFault, Populates, Runtime

T = TypeVar("T")
# Within a long batch of small calls, outcomes are put on the books at least this often.
RECORD_INTERVAL_SECONDS = 0.01
# How one call ended: (its error or None, the pipeline method that records it, the item, seconds).
Outcome = tuple[RuntimeCallError | None, Callable[..., int | None], Any, float]


def as_runtime_error(exc: BaseException, op: str, ptr: int, nbytes: int) -> RuntimeCallError:
    """A runtime that raised something other than RuntimeCallError still gets a typed record."""
    if isinstance(exc, RuntimeCallError):
        return exc
    error = RuntimeCallError(op=op, code=-1, reason=type(exc).__name__, message=str(exc), ptr=ptr, nbytes=nbytes)
    error.__cause__ = exc
    return error


def _between_calls_error(exc: BaseException, op: str, ptr: int, nbytes: int) -> RuntimeCallError:
    """Something pinpool itself raised between a chunk's runtime calls, as that chunk's failure."""
    error = RuntimeCallError(
        op=op, code=-1, reason=type(exc).__name__, ptr=ptr, nbytes=nbytes,
        message=f"{exc} (raised by pinpool between runtime calls, not by the runtime; this is a pinpool bug, "
        "please report it)",
    )  # fmt: skip
    error.__cause__ = exc
    return error


class PinSession:
    """The state of one pinning: pipeline and ledger, lock, runtime, and the memory it pins."""

    def __init__(
        self,
        *,
        chunks: Sequence[Chunk],
        runtime: Runtime,
        caps: Capabilities,
        base_ptr: int,
        order: Order,
        span_bytes: int,
        lookahead_bytes: int,
        register_workers: int,
        populate_workers: int,
        unpin_workers: int,
        observer: Observer,
        retry: RetrySplitter | None = None,
        max_retries: int = 0,
        prefix: PrefixTracker | None = None,
        max_call_seconds: float | None = None,
        populate_unit: int = 4096,
        pin_nice: int = 0,
        populate_advice: int = MADV_POPULATE_WRITE,
    ) -> None:
        # Workers start calling only once all of them are started: a populate call holds mmap_lock,
        # and starting the next thread (its stack is an mmap) would wait behind it (measured: the
        # second worker began one 512 MiB span late, so the first spans ran one after the other).
        self._go = threading.Event()
        self.pipeline = Pipeline(
            chunks, order=order, span_bytes=span_bytes, lookahead_bytes=lookahead_bytes,
            register_workers=register_workers, populate_workers=populate_workers, prefix=prefix,
        )  # fmt: skip
        self.prefix = prefix
        self.ledger = self.pipeline.ledger
        # Every registration call live now (pool.registrations), written as each call returns.
        self.book = RegistrationBook(self.ledger.chunks)
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.runtime = runtime
        self.base_ptr = base_ptr
        self.observer = observer
        self.unpin_workers = unpin_workers
        # Which calls to make is declared by the runtime (capabilities), never probed.
        self._populate: Callable[[int, int], None] = (
            cast(Populates, runtime).populate
            if caps.populates
            else functools.partial(populate_range, advice=populate_advice)
        )
        self._register: Callable[[int, int], None] = (
            cast(LocksOnFault, runtime).lock_on_fault if order is Order.REGISTER_FIRST else runtime.register
        )
        self.pid = os.getpid()
        # Retry with halving: only codes the runtime declares retryable, within one budget per pool.
        self._cutter = retry
        self._retry = retry if caps.retryable_codes else None
        self._retryable = caps.retryable_codes
        self._retries_left = max_retries
        self.retries = 0
        self._pin_started = time.perf_counter()
        self.pin_seconds = 0.0
        self.unpin_seconds = 0.0
        self._failed_before = 0
        self._teardown_started = 0.0
        # The stall budget: every register and populate call sized to fit max_call_seconds.
        self._register_sizer = CallSizer(max_call_seconds) if max_call_seconds and retry is not None else None
        self._populate_sizer = CallSizer(max_call_seconds) if max_call_seconds else None
        self._pieces_follow_faulting = (
            self._register_sizer is not None and self._populate_sizer is not None and order is Order.REGISTER_FIRST
        )
        self._populate_unit = populate_unit
        # Pin workers run this much nicer than the process (pin_nice=, see _priority.py); never
        # the thread that made the session (it entered the pool, and may go on serving).
        self._pin_nice = pin_nice
        self._owner_thread = threading.get_ident()

    # -- worker bodies ---------------------------------------------------------------------

    def _next(self, take: Callable[[], T | _Wait | None]) -> T | None:
        """The next item of a role, sleeping while the pipeline says WAIT."""
        with self._changed:
            while True:
                try:
                    item = take()
                except BaseException:
                    # A scheduling bug must not leave the other workers asleep forever.
                    self.ledger.cancel()
                    self._changed.notify_all()
                    raise
                if item is not WAIT:
                    return item
                self._changed.wait()

    def work(self) -> None:
        """One worker: populate spans and register chunks, as the pipeline hands them out.

        A batch's outcomes are recorded together, under one lock hold (its items stay in flight
        until then, so a rollback waits for them): when the batch ends, and every
        RECORD_INTERVAL_SECONDS within a long one, so the pinned prefix and progress move while a
        batch of many small chunks runs. A failure ends the batch at once, so the other workers
        hear of it after one call, not one batch.
        """
        pipeline = self.pipeline
        if self._pin_nice > 0 and threading.get_ident() != self._owner_thread:
            lower_this_thread(self._pin_nice)  # a fresh thread that only pins: nothing to restore
        self._go.wait()
        while (batch := self._next(pipeline.next_work)) is not None:
            items = batch.items
            outcomes: list[Outcome] = []
            started = 0  # items whose call was made
            try:
                recorded_at = time.perf_counter()
                for item in items:
                    if started and pipeline.stopped:  # another worker failed, or the caller cancelled
                        break
                    outcome = self._populate_span(item) if isinstance(item, Span) else self._register_chunk(item)
                    outcomes.append(outcome)  # on the books before anything else can go wrong
                    started += 1
                    self._observe(outcome)
                    if outcome[0] is not None:
                        break
                    if time.perf_counter() - recorded_at >= RECORD_INTERVAL_SECONDS:
                        landed, outcomes = outcomes, []  # never recorded twice, whatever _record raises
                        self._record(landed)
                        recorded_at = time.perf_counter()
            finally:
                self._record(outcomes, batch.role, items[started:])

    def _record(self, outcomes: list[Outcome], role: str | None = None, unstarted: Sequence[int | Span] = ()) -> None:
        """Put ``outcomes`` on the books; with ``role``, the batch has ended too."""
        pinned: list[int] = []
        with self._changed:
            for error, record, item, _seconds in outcomes:
                if error is None:
                    if (index := record(item)) is not None:
                        pinned.append(index)
                else:
                    record(item, error)
            if role is not None:
                self.pipeline.batch_done(role, unstarted)
            self._changed.notify_all()  # the landings may have made work for waiting workers
        for index in pinned:
            self.observer.chunk_pinned(self.ledger.chunks[index])

    def _call(
        self, call: Callable[[int, int], None], op: str, offset: int, nbytes: int
    ) -> tuple[RuntimeCallError | None, float]:
        """One runtime call; anything it raises, BaseException included, is that call's failure."""
        ptr = self.base_ptr + offset
        self.observer.call_started()
        started = time.perf_counter()
        try:
            call(ptr, nbytes)
        except BaseException as exc:  # recorded, never lost; a worker thread has no caller to raise to
            return as_runtime_error(exc, op, ptr, nbytes), time.perf_counter() - started
        finally:
            self.observer.call_ended()
        return None, time.perf_counter() - started

    def _populate_span(self, span: Span) -> Outcome:
        sizer = self._populate_sizer
        if sizer is None:
            error, seconds = self._call(self._populate, "populate", span.offset, span.nbytes)
            return (error, self.pipeline.populated if error is None else self.pipeline.populate_failed, span, seconds)
        # Under a stall budget the span is faulted in calls sized to fit it (page multiples). As
        # for a chunk's pieces, anything raised between the calls (a pinpool bug) is the span's
        # failure, landed on the books with its progress, never an exception that escapes the
        # worker with the span still in flight.
        try:
            return self._paced_populate(span, sizer)
        except BaseException as exc:  # a worker thread has no caller to raise to
            error = _between_calls_error(exc, "populate", self.base_ptr + span.offset, span.nbytes)
            return (error, self.pipeline.populate_failed, span, 0.0)  # 0.0, not nan: the worker observes it

    def _paced_populate(self, span: Span, sizer: CallSizer) -> Outcome:
        offset, end = span.offset, span.offset + span.nbytes
        while offset < end:
            if self.pipeline.stopped:  # stop between calls, not after the whole span
                return (None, _abandoned(self.pipeline), span, math.nan)
            nbytes = sizer.next_bytes(self._populate_unit, end - offset)
            error, seconds = self._call(self._populate, "populate", offset, nbytes)
            sizer.record(nbytes, seconds)
            if error is not None:
                return (error, self.pipeline.populate_failed, span, seconds)
            self.observer.span_populated(nbytes, seconds)
            if offset + nbytes < end:  # progress within the span (its landing records the rest)
                with self.lock:
                    self.pipeline.part_faulted(span, offset, nbytes)
            offset += nbytes
        return (None, self.pipeline.populated, span, math.nan)  # nan: observed call by call

    def _register_chunk(self, index: int) -> Outcome:
        chunk = self.ledger.chunks[index]
        if self._register_sizer is not None:
            return self._register_pieces(index, chunk, [], [], paced=True)
        error, seconds = self._call(self._register, "register", chunk.offset, chunk.nbytes)
        if error is None:
            self.book.chunk_registered(index)
            return (None, self.pipeline.registered, index, seconds)
        halves = self._halves(chunk, error, attempt=1)
        if halves is None:
            return (error, self.pipeline.register_failed, index, seconds)
        self.observer.chunk_failed(chunk, "register", error, seconds, attempt=1)
        return self._register_pieces(index, chunk, list(halves), [ChunkFailure(chunk, "register", error)])

    def _halves(self, piece: Chunk, error: RuntimeCallError, attempt: int) -> tuple[Chunk, Chunk] | None:
        """Aligned halves to retry ``piece`` with, if its error is retryable and the budget allows."""
        if self._retry is None or error.code not in self._retryable:
            return None
        halves = self._retry.split(piece)
        if halves is None:
            return None
        with self.lock:
            if self._retries_left <= 0:
                return None
            self._retries_left -= 1
            self.retries += 1
        self.observer.chunk_retried(piece, error, halves, attempt)
        return halves

    def _register_pieces(
        self, index: int, chunk: Chunk, todo: list[Chunk], attempts: list[ChunkFailure], *, paced: bool = False
    ) -> Outcome:
        """Register ``chunk`` as several calls: the halves of a failed call (``todo``), or, under
        the stall budget (``paced``), pieces sized to fit it as the calls go. A piece that fails
        retryably is halved again. Every failed attempt is kept, so a final failure lists them
        all (a real out-of-memory is never hidden). Each call is observed as it ends.

        The pieces registered so far exist only in ``done`` until the chunk lands, so nothing may
        take them away: a piece joins ``done`` as soon as its call returns, before anything else
        runs, and anything raised between calls (the sizer, the cutter, the observer, the books:
        a pinpool bug, never the runtime's) becomes this chunk's failure, landed with the pieces
        registered so the rollback undoes them, instead of escaping the worker with them."""
        done: list[Chunk] = []
        try:
            return self._pieces_loop(index, chunk, todo, attempts, done, paced=paced)
        except BaseException as exc:  # a worker thread has no caller to raise to: land it, never lose `done`
            error = _between_calls_error(exc, "register", self.base_ptr + chunk.offset, chunk.nbytes)
            attempts.append(ChunkFailure(chunk, "register", error))
            landing = _partly(self.pipeline, done, attempts) if done else _failed_after(self.pipeline, attempts)
            return (error, landing, index, 0.0)  # 0.0, not nan: the worker observes this failure

    def _pieces_loop(
        self,
        index: int,
        chunk: Chunk,
        todo: list[Chunk],
        attempts: list[ChunkFailure],
        done: list[Chunk],
        *,
        paced: bool,
    ) -> Outcome:
        """The calls of :meth:`_register_pieces`; every registered piece is in ``done`` at once."""
        sizer, cutter = self._register_sizer, self._cutter
        offset = chunk.offset if paced else chunk.end  # where the pieces not yet cut begin
        while todo or offset < chunk.end:
            if todo:
                piece = todo.pop(0)
            else:
                assert sizer is not None and cutter is not None
                if self.pipeline.stopped:  # stop between calls: the rollback undoes the pieces
                    return (None, _stopped(self.pipeline, done), index, math.nan)
                rest = Chunk(offset, chunk.end - offset)
                unit = cutter.unit_of(rest)
                at_most = sizer.next_bytes(unit, rest.nbytes)
                if self._pieces_follow_faulting:
                    # A lock-on-fault registration is quick, but its piece is later unlocked in one
                    # call (munlock), which holds mmap_lock for writing as long as the faulting took:
                    # pieces are sized by the faulting rate, so unpinning stays within the budget too.
                    at_most = min(at_most, self._populate_sizer.hint(unit, rest.nbytes))  # type: ignore[union-attr]
                piece = cutter.first_piece(rest, at_most)
                offset = piece.end
            failure, took = self._call(self._register, "register", piece.offset, piece.nbytes)
            if failure is None:
                done.append(piece)  # first: from here on the piece is on the books, whatever raises
                self.book.registered(index, chunk, piece)
            if sizer is not None:
                sizer.record(piece.nbytes, took)
            if failure is None:
                self.observer.chunk_registered(piece, took, attempt=len(attempts) + 1)
                if paced and (todo or offset < chunk.end):  # progress within the chunk
                    with self.lock:
                        self.pipeline.part_registered(index, piece)
                continue
            attempts.append(ChunkFailure(piece, "register", failure))
            self.observer.chunk_failed(piece, "register", failure, took, attempt=len(attempts))
            again = self._halves(piece, failure, attempt=len(attempts))
            if again is None:
                if done:  # the registered pieces are undone by the rollback, from the books
                    return (failure, _partly(self.pipeline, done, attempts), index, math.nan)
                return (failure, _failed_after(self.pipeline, attempts), index, math.nan)
            todo[:0] = again
        if done == [chunk]:  # one call did it all: an ordinary registration
            return (None, self.pipeline.registered, index, math.nan)
        return (None, _in_pieces(self.pipeline, done), index, math.nan)  # nan: observed call by call

    def registrations(self) -> tuple[Chunk, ...]:
        """Every registration call live now, sorted by offset (see :class:`RegistrationBook`);
        none in a forked child, whose parent holds them."""
        return self.book.snapshot() if os.getpid() == self.pid else ()

    def _observe(self, outcome: Outcome) -> None:
        error, _record, item, seconds = outcome
        if math.isnan(seconds):  # a retried chunk: each of its calls was observed as it ended
            return
        observer = self.observer
        if isinstance(item, Span):
            if error is None:
                observer.span_populated(item.nbytes, seconds)
            else:
                observer.chunk_failed(self.ledger.chunks[item.chunk], "populate", error, seconds)
        elif error is None:
            observer.chunk_registered(self.ledger.chunks[item], seconds)
        else:
            observer.chunk_failed(self.ledger.chunks[item], "register", error, seconds)

    def go(self) -> None:
        """Every pinning thread is started (or no more will be): workers may begin."""
        self._go.set()

    def cancel(self) -> None:
        """Tell workers to stop after their current call."""
        self.stop(StopCause.CANCELLED)

    def stop(self, cause: StopCause) -> None:
        """Tell workers to stop after their current call, for ``cause`` (the first cause wins)."""
        with self._changed:
            self.ledger.stop(cause)
            self._changed.notify_all()
        self._go.set()  # a worker still waiting to begin must see the stop, not wait forever

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no populate or register call is in flight (workers stop at the next one
        once stopped); False if some still is after ``timeout`` seconds."""
        with self._changed:
            return self._changed.wait_for(lambda: self.pipeline.in_flight == 0, timeout=timeout)

    def finish_pinning(self) -> Phase:
        """Every pinning thread is done: close the pinning phase (PINNED, or ROLLED_BACK to undo)."""
        with self.lock:
            return self._finish_pinning_locked()

    def _finish_pinning_locked(self) -> Phase:
        self.pin_seconds = time.perf_counter() - self._pin_started
        try:
            return self.pipeline.finish()
        except LedgerError:
            # The books disagree with "every thread is done" (a worker crashed mid-batch: a
            # pinpool bug). Roll back what is known to be registered; the lifecycle reports it.
            return self.ledger.abort()

    def begin_teardown(self) -> tuple[Callable[[], None], ...]:
        """What the unpin threads run: unregister every registered chunk base, claimed from one
        queue in reverse offset order. Empty when there is nothing to undo, once closed
        (teardown is idempotent), and in a forked child (the registrations are the parent's)."""
        ledger = self.ledger
        with self._changed:
            if ledger.phase is Phase.PINNING:
                self._finish_pinning_locked()
            if ledger.phase is Phase.CLOSED:
                return ()
            if os.getpid() != self.pid:
                ledger.disown()
                return ()
            order = ledger.teardown_order()
            self._failed_before = len(ledger.failures)
        self._teardown_started = time.perf_counter()
        pending = collections.deque(order)
        return tuple(lambda: self._unregister_work(pending) for _ in range(min(self.unpin_workers, len(order))))

    def end_teardown(self, crashed: Sequence[BaseException] = ()) -> tuple[ChunkFailure, ...]:
        """Close the books once every unpin thread is done; returns this teardown's unregister failures.

        A chunk still registered here means an unpin worker crashed before reaching it (a pinpool
        bug): it is reported as leaked, never left silently registered."""
        ledger = self.ledger
        with self._changed:
            if ledger.phase is Phase.CLOSED:
                return ()
            for index in ledger.teardown_order():
                chunk = ledger.chunks[index]
                ledger.unregister_failed(
                    index,
                    RuntimeCallError(
                        op="unregister", code=-1, reason="InternalError", ptr=self.base_ptr + chunk.offset,
                        nbytes=chunk.nbytes, message=f"never unregistered: an unpin worker crashed ({crashed!r})",
                    ),
                )  # fmt: skip
            ledger.close()
            self.unpin_seconds += time.perf_counter() - self._teardown_started
            return tuple(ledger.failures[self._failed_before :])

    def _unregister_work(self, pending: collections.deque[int]) -> None:
        """One unpin worker: unregister chunk bases from the shared reverse-order queue.

        It claims a batch of consecutive chunks at a time (as pinning does: up to BATCH_BYTES or
        BATCH_ITEMS, and no more than its share), so tiny chunks cost one lock hand-off per batch,
        not two per chunk; outcomes go on the books at the end of the batch and at least every
        RECORD_INTERVAL_SECONDS. Claimed chunks not yet unregistered when something interrupts
        the worker go back to the queue (the inline runner resumes the queue after an interrupt).
        """
        lock = self.lock
        while True:
            with lock:
                batch = self._claim_unpin_batch(pending)
            if not batch:
                return
            done: list[tuple[int, RuntimeCallError | None, float, bool]] = []
            recorded = 0
            try:
                recorded_at = time.perf_counter()
                for index, was_pinned in batch:
                    error, seconds = self._unregister_chunk(index)
                    done.append((index, error, seconds, was_pinned))
                    if time.perf_counter() - recorded_at >= RECORD_INTERVAL_SECONDS:
                        self._record_unpinned(done[recorded:])
                        recorded = len(done)
                        recorded_at = time.perf_counter()
            finally:
                with lock:
                    pending.extendleft(index for index, _ in reversed(batch[len(done) :]))
                self._record_unpinned(done[recorded:])

    def _claim_unpin_batch(self, pending: collections.deque[int]) -> list[tuple[int, bool]]:
        """Under the lock: the next chunks to unregister, each with whether it counts as pinned."""
        ledger = self.ledger
        share = -(-len(pending) // max(1, self.unpin_workers))
        batch: list[tuple[int, bool]] = []
        nbytes = 0
        while pending and nbytes < BATCH_BYTES and len(batch) < min(BATCH_ITEMS, max(1, share)):
            index = pending.popleft()
            batch.append((index, ledger.states[index] is ChunkState.REGISTERED))
            nbytes += ledger.chunks[index].nbytes
        return batch

    def _unregister_chunk(self, index: int) -> tuple[RuntimeCallError | None, float]:
        """Unregister one chunk; a chunk registered in pieces (retries, the stall budget) is
        unregistered piece by piece, each by its own base."""
        ledger, observer = self.ledger, self.observer
        chunk = ledger.chunks[index]
        error: RuntimeCallError | None = None
        started = time.perf_counter()
        for piece in reversed(ledger.pieces.get(index, (chunk,))):
            ptr = self.base_ptr + piece.offset
            observer.call_started()
            call_started = time.perf_counter()
            try:
                self.runtime.unregister(ptr)
            except BaseException as exc:  # anything, SystemExit included, fails this chunk only
                error = error or as_runtime_error(exc, "unregister", ptr, piece.nbytes)
            else:
                self.book.unregistered(index, chunk, piece)  # a piece whose unregister failed stays listed
            finally:
                observer.call_ended()
                observer.unregister_call_took(time.perf_counter() - call_started)
        return error, time.perf_counter() - started

    def _record_unpinned(self, done: Sequence[tuple[int, RuntimeCallError | None, float, bool]]) -> None:
        if not done:
            return
        ledger, observer = self.ledger, self.observer
        with self.lock:
            for index, error, _seconds, _was_pinned in done:
                if error is None:
                    ledger.unregistered(index)
                else:
                    ledger.unregister_failed(index, error)
        for index, error, seconds, was_pinned in done:
            chunk = ledger.chunks[index]
            if error is None:
                observer.chunk_unregistered(chunk, seconds, was_pinned=was_pinned)
            else:
                observer.chunk_failed(chunk, "unregister", error, seconds)


def _abandoned(pipeline: Pipeline) -> Callable[[Span], None]:
    return lambda span: pipeline.span_abandoned(span)


def _stopped(pipeline: Pipeline, pieces: list[Chunk]) -> Callable[[int], None]:
    return lambda index: pipeline.register_stopped(index, pieces)


def _in_pieces(pipeline: Pipeline, pieces: list[Chunk]) -> Callable[[int], int | None]:
    return lambda index: pipeline.registered_in_pieces(index, pieces)


def _partly(pipeline: Pipeline, pieces: list[Chunk], attempts: list[ChunkFailure]) -> Callable[..., None]:
    return lambda index, _error: pipeline.register_partly_failed(index, pieces, attempts)


def _failed_after(pipeline: Pipeline, attempts: list[ChunkFailure]) -> Callable[..., None]:
    return lambda index, error: pipeline.register_failed(index, error, attempts)
