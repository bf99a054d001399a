"""The pinning engine: one :class:`PinSession` per entered pool, the runtime calls its worker threads make.

Every call goes through :meth:`PinSession._call`, every worker runs the one batch loop
:meth:`PinSession._run`, and every outcome is booked inside the worker, under the session lock.
"""

from __future__ import annotations

import collections
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

from .._errors import ChunkFailure, LedgerError, RuntimeCallError, between_calls_error, foreign_text
from .._host.libc import MADV_POPULATE_WRITE, lower_this_thread
from .._host.mapping import populate_range
from .._observe import Observer
from .._plan.calls import CallSizer, Pacer
from .._plan.chunks import Chunk, Order, Span
from .._plan.plan import retry_splitter
from .._plan.prefix import PrefixTracker
from .._types import Capabilities
from ..runtimes import LocksOnFault, Populates, Runtime
from .flag import Flag
from .ledger import Phase, RegistrationBook, StopCause
from .pipeline import WAIT, Batch, Landing, Pipeline, _Wait, take_batch
from .transfer_ledger import Item
from .transfers import Transfers
from .untrusted import Answer, Op, untrusted_call

if TYPE_CHECKING:
    from .._plan.options import PoolOptions
    from .._plan.plan import Schedule
    from ..registrars import TransferRegistrar

T = TypeVar("T")
RECORD_INTERVAL_SECONDS = 0.01  # within a long batch of small calls, outcomes are booked at least this often


class Memory(Protocol):
    """The pool's memory: its own mapping, or a caller's tensor (pin())."""

    address: int

    def keep_forever(self) -> None: ...


@dataclass(frozen=True)
class _Unpinned:
    """What unregistering one chunk (all its pieces) did."""

    index: int | Item  # a chunk, or a transfer registration
    error: RuntimeCallError | None
    seconds: float
    released: tuple[tuple[Chunk, RuntimeCallError], ...] = ()  # someone else released them: not a failure
    absent: tuple[tuple[Chunk, RuntimeCallError], ...] = ()  # "maybe" pieces never registered: nothing to undo


R = TypeVar("R", Landing, _Unpinned)


@dataclass(frozen=True)
class _Work(Generic[T, R]):
    """What one kind of worker does, as data for the one batch loop (:meth:`PinSession._run`)."""

    take: Callable[[], Sequence[T] | None]  # the next batch, claimed; None or empty: the worker is done
    do: Callable[[T], R]  # one item's calls
    failed: Callable[[T, Exception], R]  # an item whose calls raised (a pinpool bug): its result, a failure
    keep: Callable[[R], None]  # right after an item's calls, once its result is kept
    land: Callable[[Sequence[R], Sequence[T]], None]  # results on the books; at a batch's end, its unstarted items
    stops: bool  # pinning: a failure, or pinning stopped, ends the batch after the current call


class PinSession:
    """The state of one pinning: pipeline and ledger, lock, runtime, and the memory it pins."""

    def __init__(
        self, plan: Schedule, options: PoolOptions, *, runtime: Runtime, caps: Capabilities, observer: Observer,
        memory: Memory, registrars: Sequence[TransferRegistrar] = (),
    ) -> None:  # fmt: skip
        order = plan.order
        # Workers begin once all are started: a thread's start (its stack is an mmap) waits behind a populate.
        self._go = Flag()
        self.prefix = PrefixTracker(plan.page_runs, plan.num_pages)
        # With registrars a page is usable once every one of them holds it: their books cover the prefix.
        self.pipeline = Pipeline(
            plan.pin_chunks, order=order, span_bytes=plan.span_bytes or 1, lookahead_bytes=plan.lookahead_bytes,
            register_workers=plan.register_workers, populate_workers=plan.populate_workers,
            prefix=None if registrars else self.prefix, spans=plan.spans,
        )  # fmt: skip
        self.ledger = self.pipeline.ledger
        self.lock = threading.Lock()
        self.calls: dict[int, tuple[str, int, int, float]] = {}  # by thread: op, ptr, nbytes, start
        self.raised: list[BaseException] = []  # what the runtime raised that is no Exception
        self.transfers = None if not registrars else Transfers(
            plan.transfers, registrars, self.pipeline, self.prefix, base_ptr=memory.address, observer=observer,
            calls=self.calls, raised=self.raised, lock=self.lock,
        )  # fmt: skip
        self.book = RegistrationBook(self.ledger.chunks)  # pool.registrations
        self._changed = threading.Condition(self.lock)
        self.base_ptr = memory.address
        self.observer = observer
        self.unpin_workers = plan.unpin_workers
        self.plan_threads, self.transfer_workers = plan.threads, plan.transfer_workers
        populate: Callable[[int, int], None] = (
            cast(Populates, runtime).populate
            if caps.populates
            else getattr(memory, "populate", None)  # a shared region's: names a truncation by another process
            or functools.partial(populate_range, advice=getattr(memory, "populate_advice", MADV_POPULATE_WRITE))
        )
        register = cast(LocksOnFault, runtime).lock_on_fault if order is Order.REGISTER_FIRST else runtime.register
        pacer = Pacer(plan.duty_cycle)  # rests only below duty 1: a background pool under a small CPU quota
        self._populate = Op("populate", populate, pacer.took, pacer.before)
        self._register = Op("register", register, pacer.took, pacer.before)
        self._unregister = Op("unregister", lambda ptr, _: runtime.unregister(ptr), observer.unregister_call_took)
        self.pid = os.getpid()
        self._cutter = retry_splitter(plan, options.min_chunk_bytes or 0)
        self._retryable = caps.retryable_codes if options.retry_codes is None else options.retry_codes
        self._not_registered = caps.not_registered_codes
        self._check_codes, self._already_registered = caps.stale_codes, caps.already_registered_codes
        self._max_depth = options.max_retries  # halvings below each planned chunk (per lineage, not per pool)
        self.retries = 0
        self._pin_started, self.pin_seconds, self.unpin_seconds = time.perf_counter(), 0.0, 0.0
        self._failed_before, self._teardown_started = 0, 0.0
        # A resumable teardown: its queue, the threads unpinning now, its failures once closed.
        self._unpin_queue: collections.deque[int | Item] | None = None
        self._unpinners: set[int] = set()
        self._teardown_failures: tuple[ChunkFailure, ...] = ()
        # The stall budget; an "auto" one that yields to an explicit chunk option leaves registrations as planned.
        budget = options.max_call_seconds
        self._register_sizer = CallSizer(budget) if budget and not options.budget_yields_to else None
        self._populate_sizer = CallSizer(budget) if budget else None
        self._pieces_follow_faulting = self._register_sizer is not None and order is Order.REGISTER_FIRST
        self._populate_unit = plan.align
        # pin_nice= (_host/libc.py), never on the thread that made the session: it may go on serving.
        self._pin_nice, self._owner_thread = options.pin_nice, threading.get_ident()

    def _run(self, work: _Work[T, R]) -> None:
        """One worker's batches until ``work.take`` has none left, landed at a batch's end and every
        RECORD_INTERVAL_SECONDS. An item whose calls raised is that item's failure."""
        while items := work.take():
            results: list[R] = []
            started = 0  # items whose calls were made
            try:
                recorded_at = time.perf_counter()
                for item in items:
                    if started and work.stops and self.pipeline.stopped:  # another worker failed, or a cancel
                        break
                    try:
                        result = work.do(item)
                    except Exception as exc:
                        result = work.failed(item, exc)
                    results.append(result)  # on the books before anything else can go wrong
                    started += 1
                    work.keep(result)
                    if work.stops and result.error is not None:
                        break
                    if time.perf_counter() - recorded_at >= RECORD_INTERVAL_SECONDS:
                        landed, results = results, []  # never recorded twice, whatever land raises
                        work.land(landed, ())
                        recorded_at = time.perf_counter()
            finally:
                work.land(results, items[started:])

    def _call(self, op: Op, offset: int, nbytes: int) -> tuple[Answer, float]:
        """One runtime call at ``offset``; a non-``Exception`` it raised is kept in :attr:`raised`."""
        ptr, observer = self.base_ptr + offset, self.observer
        op.before()
        observer.call_started()
        started, me = time.perf_counter(), threading.get_ident()
        try:
            self.calls[me] = (op.name, ptr, nbytes, started)
            answer = untrusted_call(op.call, op.name, ptr, nbytes)
        finally:
            self.calls.pop(me, None)
            observer.call_ended()
        if answer.raised is not None:
            self.raised.append(answer.raised)
        seconds = time.perf_counter() - started
        op.took(seconds)
        return answer, seconds

    def _next(self, take: Callable[[], T | _Wait | None]) -> T | None:
        """The next item of a role, sleeping while the pipeline says WAIT."""
        with self._changed:
            while True:
                try:
                    item = take()
                except BaseException:  # a scheduling bug must not leave the other workers asleep
                    self.ledger.cancel()
                    self._changed.notify_all()
                    raise
                if item is not WAIT:
                    return item
                self._changed.wait()

    def work(self, *, transfers: bool = False) -> None:
        """One pinning worker: populate spans and register chunks, as the pipeline hands them out (a ready
        transfer registration when it has none); with ``transfers``, registrations only."""
        if self._pin_nice > 0 and threading.get_ident() != self._owner_thread:
            lower_this_thread(self._pin_nice)  # a fresh thread that only pins: nothing to restore
        self._go.wait()
        take = self.transfers.next_transfer if transfers else self._next_pinning  # type: ignore[union-attr]
        self._run(_Work(
            take=functools.partial(self._take, take), do=self._pin, failed=self._pin_failed, keep=self._observe,
            land=self._land, stops=True,
        ))  # fmt: skip

    def worker_bodies(self) -> tuple[Callable[[], None], ...]:
        """What the pinning threads run: pinning workers, then the transfer registrars' own."""
        pinning = self.plan_threads - self.transfer_workers
        return (self.work,) * pinning + (functools.partial(self.work, transfers=True),) * self.transfer_workers

    def _next_pinning(self) -> Batch | _Wait | None:
        return self.transfers.next_work() if self.transfers else self.pipeline.next_work()

    def _take(self, take: Callable[[], Batch | _Wait | None]) -> tuple[int | Span | Item, ...] | None:
        batch = self._next(take)
        return None if batch is None else batch.items

    def _pin(self, item: int | Span | Item) -> Landing:
        if isinstance(item, tuple):
            return self.transfers.register(item)  # type: ignore[union-attr]
        return self._populate_span(item) if isinstance(item, Span) else self._register_chunk(item)

    def _pin_failed(self, item: int | Span | Item, exc: Exception) -> Landing:
        if isinstance(item, tuple):
            return self.transfers.register_raised(item, exc)  # type: ignore[union-attr]
        if isinstance(item, Span):
            error = between_calls_error(exc, "populate", self.base_ptr + item.offset, item.nbytes)
            return Landing(item, error, seconds=0.0)
        chunk = self.ledger.chunks[item]
        self.book.chunk_registered(item)  # its register call may have registered it: undone at teardown
        error = between_calls_error(exc, "register", self.base_ptr + chunk.offset, chunk.nbytes)
        return Landing(item, error, maybe=(chunk,), seconds=0.0)

    def _land(self, landings: Sequence[Landing], unstarted: Sequence[int | Span | Item]) -> None:
        """Put ``landings`` on the books, and ``unstarted`` items as stopped (their batch ended)."""
        with self._changed:
            before = self.ledger.pinned_bytes
            transfers, pinned = self.transfers, []
            for landing in (*landings, *(Landing(item, stopped=True) for item in unstarted)):
                if isinstance(landing.item, tuple):
                    transfers.land(landing, self.ledger)  # type: ignore[union-attr]
                elif (index := self.pipeline.land(landing)) is not None:
                    pinned.append(index)
                    if transfers is not None:  # its registrations may be made once all their chunks are pinned
                        transfers.books.chunk_pinned(self.ledger.chunks[index])
            moved = self.ledger.pinned_bytes - before
            self._changed.notify_all()  # the landings may have made work for waiting workers
        self.observer.pinned_moved(moved)
        for index in pinned:
            self.observer.chunk_pinned(self.ledger.chunks[index])

    def _populate_span(self, span: Span) -> Landing:
        sizer = self._populate_sizer
        if sizer is None:
            answer, seconds = self._call(self._populate, span.offset, span.nbytes)
            return Landing(span, answer.error, seconds=seconds)
        try:  # calls sized to the stall budget
            offset, end = span.offset, span.offset + span.nbytes
            while offset < end:
                if self.pipeline.stopped:  # stop between calls, not after the whole span
                    return Landing(span, stopped=True)
                nbytes = sizer.next_bytes(self._populate_unit, end - offset)
                answer, seconds = self._call(self._populate, offset, nbytes)
                sizer.record(nbytes, seconds)
                if answer.error is not None:
                    return Landing(span, answer.error, seconds=seconds)
                self.observer.span_populated(nbytes, seconds)
                if offset + nbytes < end:  # progress within the span (its landing records the rest)
                    self._land((Landing(span, pieces=(Chunk(offset, nbytes),), partial=True),), ())
                offset += nbytes
            return Landing(span)  # nan: observed call by call
        except BaseException as exc:  # a worker thread has no caller to raise to: the span's failure
            error = between_calls_error(exc, "populate", self.base_ptr + span.offset, span.nbytes)
            return Landing(span, error, seconds=0.0)  # 0.0, not nan: the worker observes it

    def _register_chunk(self, index: int) -> Landing:
        chunk = self.ledger.chunks[index]
        if self._register_sizer is not None:
            return self._register_pieces(index, chunk, [], [], paced=True)
        answer, seconds = self._register_call(chunk)
        error = answer.error
        if error is None or answer.maybe:  # maybe: booked for teardown too (never retried)
            self.book.chunk_registered(index)
        if error is None:
            return Landing(index, seconds=seconds)
        if answer.maybe:
            return Landing(index, error, maybe=(chunk,), seconds=seconds)
        halves = self._halves(chunk, 0, error, attempt=1)
        if halves is None:
            return Landing(index, error, seconds=seconds)
        self.observer.chunk_failed(chunk, "register", error, seconds, attempt=1)
        return self._register_pieces(index, chunk, halves, [ChunkFailure(chunk, "register", error)])

    def _register_call(self, piece: Chunk) -> tuple[Answer, float]:
        """One register call; where codes may be stale, a failed one is checked by an unregister ("maybe" if unsure)."""
        answer, seconds = self._call(self._register, piece.offset, piece.nbytes)
        error = answer.error
        if error is None or answer.maybe or not self._check_codes or error.code in self._already_registered:
            return answer, seconds
        check, _seconds = self._call(self._unregister, piece.offset, piece.nbytes)
        if check.error is None:  # it was registered despite its code, and is not now
            self.observer.registered_despite_code(piece, self.base_ptr + piece.offset, error)
        elif check.maybe or check.error.code not in self._not_registered:
            return Answer(error, maybe=True), seconds
        return answer, seconds

    def _halves(
        self, piece: Chunk, depth: int, error: RuntimeCallError, attempt: int
    ) -> list[tuple[Chunk, int]] | None:
        """Aligned halves to retry ``piece`` with, each with its depth, if its error and depth allow."""
        if error.code not in self._retryable or depth >= self._max_depth:
            return None
        halves = self._cutter.split(piece)
        if halves is None:
            return None
        with self.lock:
            self.retries += 1
        self.observer.chunk_retried(piece, error, halves, attempt)
        return [(half, depth + 1) for half in halves]

    def _register_pieces(
        self, index: int, chunk: Chunk, todo: list[tuple[Chunk, int]], attempts: list[ChunkFailure], *,
        paced: bool = False,
    ) -> Landing:  # fmt: skip
        """Register ``chunk`` as several calls: the halves of a failed call (``todo``, each with its
        depth), or under the stall budget (``paced``) pieces sized as the calls go."""
        done: list[Chunk] = []
        maybe: list[Chunk] = []  # a piece whose call failed untrusted: it may be registered (never retried)
        try:
            sizer, cutter = self._register_sizer, self._cutter
            offset = chunk.offset if paced else chunk.end  # where the pieces not yet cut begin
            while todo or offset < chunk.end:
                if todo:
                    piece, depth = todo.pop(0)
                else:
                    depth = 0  # a piece the stall budget cut: a planned size, not a retry
                    assert sizer is not None
                    if self.pipeline.stopped:  # stop between calls: the rollback undoes the pieces
                        return Landing(index, stopped=True, pieces=tuple(done))
                    rest = Chunk(offset, chunk.end - offset)
                    unit = cutter.unit_of(rest)
                    at_most = sizer.next_bytes(unit, rest.nbytes)
                    if self._pieces_follow_faulting:  # its munlock takes as long as its faulting
                        at_most = min(at_most, self._populate_sizer.hint(unit, rest.nbytes))  # type: ignore[union-attr]
                    piece = cutter.first_piece(rest, at_most)
                    offset = piece.end
                answer, took = self._register_call(piece)
                failure = answer.error
                if failure is None or answer.maybe:  # first: on the books, whatever raises
                    (done if failure is None else maybe).append(piece)
                    self.book.registered(index, chunk, piece)
                if sizer is not None:
                    sizer.record(piece.nbytes, took)
                if failure is None:
                    self.observer.chunk_registered(piece, took, attempt=len(attempts) + 1)
                    if paced and (todo or offset < chunk.end):  # progress within the chunk
                        self._land((Landing(index, pieces=(piece,), partial=True),), ())
                    continue
                attempts.append(ChunkFailure(piece, "register", failure))
                self.observer.chunk_failed(piece, "register", failure, took, attempt=len(attempts))
                again = None if answer.maybe else self._halves(piece, depth, failure, attempt=len(attempts))
                if again is None:  # registered pieces are undone by the rollback, from the books
                    return Landing(index, failure, pieces=tuple(done), maybe=tuple(maybe), attempts=tuple(attempts))
                todo[:0] = again
            return Landing(index, pieces=tuple(done))  # nan: observed call by call
        except BaseException as exc:  # a worker thread has no caller to raise to: land it, never lose `done`
            error = between_calls_error(exc, "register", self.base_ptr + chunk.offset, chunk.nbytes)
            attempts.append(ChunkFailure(chunk, "register", error))
            return Landing(index, error, pieces=tuple(done), maybe=tuple(maybe), attempts=tuple(attempts), seconds=0.0)

    def leaked(self) -> tuple[Chunk, ...]:
        """What may still be held: chunks the runtime may have pinned, registrations an engine may hold."""
        return self.ledger.leaked() + (self.transfers.books.leaked() if self.transfers is not None else ())

    def registrations(self) -> tuple[Chunk, ...]:
        """Every registration call live now, sorted (none in a forked child: the parent holds them)."""
        return self.book.snapshot() if os.getpid() == self.pid else ()

    def _observe(self, landing: Landing) -> None:
        if math.isnan(landing.seconds) or isinstance(landing.item, tuple):  # observed call by call (transfers too)
            return
        observer, item, error, seconds = self.observer, landing.item, landing.error, landing.seconds
        if isinstance(item, Span):
            if error is None:
                observer.span_populated(item.nbytes, seconds)
            else:
                observer.chunk_failed(self.ledger.chunks[item.chunk], "populate", error, seconds)
        elif error is None:
            observer.chunk_registered(self.ledger.chunks[item], seconds)
        else:
            observer.chunk_failed(self.ledger.chunks[item], "register", error, seconds)

    def take_raised(self) -> list[BaseException]:
        """What the runtime raised that is no Exception, each handed out once (teardown raises it)."""
        with self.lock:
            raised, self.raised = self.raised, []
        return raised

    def go(self) -> None:
        """Every pinning thread is started (or no more will be): workers may begin."""
        self._go.set()

    def cancel(self) -> None:
        self.stop(StopCause.CANCELLED)

    def stop(self, cause: StopCause) -> None:
        """Tell workers to stop after their current call, for ``cause`` (the first cause wins)."""
        # The C lock: an interrupt inside Condition.__enter__ (Python code) could leave it held.
        with self.lock:
            self.ledger.stop(cause)
            self._changed.notify_all()
        self._go.set()  # a worker still waiting to begin must see the stop, not wait forever

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no populate or register call is in flight; False if some still is after ``timeout``."""
        books = None if self.transfers is None else self.transfers.books
        with self._changed:
            return self._changed.wait_for(
                lambda: self.pipeline.in_flight == 0 and (books is None or books.in_flight == 0),
                timeout=timeout,
            )  # fmt: skip

    def finish_pinning(self) -> Phase:
        """Every pinning thread is done: close the pinning phase (PINNED, or ROLLED_BACK to undo)."""
        with self.lock:
            return self._finish_pinning_locked()

    def _finish_pinning_locked(self) -> Phase:
        self.pin_seconds = time.perf_counter() - self._pin_started
        books = None if self.transfers is None else self.transfers.books
        try:
            if books is not None and (books.in_flight or (not books.complete and self.ledger.stop_cause is None)):
                raise LedgerError("pinning ended with transfer registrations in flight or never made")
            return self.pipeline.finish()
        except LedgerError:  # a worker crashed mid-batch (a pinpool bug): roll back what is known
            if books is not None:
                books.abort()
            return self.ledger.abort()

    def begin_teardown(self, *, join: bool = True) -> tuple[Callable[[], None], ...]:
        """What the unpin threads run, from one queue in reverse offset order; called again, it resumes."""
        ledger = self.ledger
        with self.lock:  # the C lock, not the Condition: see stop()
            if ledger.phase is Phase.PINNING:
                self._finish_pinning_locked()
            if ledger.phase is Phase.CLOSED:
                return ()
            if os.getpid() != self.pid:
                ledger.disown()
                if self.transfers is not None:
                    self.transfers.books.disown()
                return ()
            if self._unpin_queue is None:
                self._failed_before = len(ledger.failures)
                self._teardown_started = time.perf_counter()
            busy = frozenset(self._unpinners)
            pending = self._unpin_queue
            if pending is None or not busy:
                if pending is not None:
                    pending.clear()  # a worker of an earlier attempt that starts only now finds nothing
                # Every registrar's registrations first: an engine never holds memory the runtime has unpinned.
                undo = self.transfers.books.teardown_order() if self.transfers is not None else []
                pending = self._unpin_queue = collections.deque([*undo, *ledger.teardown_order()])
            count = min(self.unpin_workers, len(pending))
        unpinning = _Work[int | Item, _Unpinned](
            take=functools.partial(self._claim_unpin_batch, pending, join), do=self._unregister_chunk,
            failed=self._unpin_failed, keep=lambda _: None, land=functools.partial(self._land_unpinned, pending),
            stops=False,
        )  # fmt: skip
        bodies = tuple(functools.partial(self._unpin, unpinning) for _ in range(count))
        return bodies + ((functools.partial(self._join_unpinners, busy),) if busy and join else ())

    def _unpin(self, work: _Work[int | Item, _Unpinned]) -> None:
        try:
            self._unpinners.add(threading.get_ident())  # one C call: on the books, or not at all
            self._run(work)
        finally:
            with self.lock:
                self._unpinners.discard(threading.get_ident())
                self._changed.notify_all()

    def _join_unpinners(self, busy: frozenset[int]) -> None:  # workers of an earlier attempt
        with self._changed:
            self._changed.wait_for(lambda: not busy & self._unpinners)

    def end_teardown(
        self, crashed: Sequence[BaseException] = (), *, abandoned: bool = False
    ) -> tuple[ChunkFailure, ...]:
        """Close the books once every unpin thread is done (or ``abandoned``): the unregister failures."""
        ledger = self.ledger
        with self.lock:
            if ledger.phase is Phase.CLOSED:
                return self._teardown_failures
            why = (
                "the teardown was abandoned (Ctrl-C) while an unregister call had not returned" if abandoned
                else "the finalizer found an unpin worker still in a call" if self._unpinners
                else f"an unpin worker crashed ({foreign_text(crashed, repr)})"
            )  # fmt: skip
            before = ledger.pinned_bytes
            for index in ledger.teardown_order():
                chunk = ledger.chunks[index]
                ledger.unregister_failed(index, RuntimeCallError(
                    op="unregister", code=-1, reason="Abandoned" if abandoned else "InternalError",
                    ptr=self.base_ptr + chunk.offset, nbytes=chunk.nbytes, message=f"never unregistered: {why}",
                ))  # fmt: skip
            if self._unpin_queue is not None:
                self._unpin_queue.clear()  # an abandoned worker whose call returns takes nothing more
            if self.transfers is not None:
                self.transfers.give_up(ledger, reason="Abandoned" if abandoned else "InternalError", why=why)
            ledger.close()
            self._changed.notify_all()  # a worker waiting for registrars to be undone finds the books closed
            self.unpin_seconds += time.perf_counter() - self._teardown_started
            failures = self._teardown_failures = tuple(ledger.failures[self._failed_before :])
            moved = ledger.pinned_bytes - before
        self.observer.pinned_moved(moved)
        return failures

    def _claim_unpin_batch(self, pending: collections.deque[int | Item], join: bool) -> list[int | Item]:
        chunks, transfers = self.ledger.chunks, self.transfers
        with self.lock:
            share = -(-len(pending) // max(1, self.unpin_workers))
            if transfers is not None:  # registrars' first; chunks once none is out (a finalizer never waits)
                wait = self._changed.wait if join else None
                return transfers.take_undo(pending, share, wait, lambda i: chunks[i].nbytes)
            return take_batch(lambda: pending.popleft() if pending else None, lambda i: chunks[i].nbytes, share)  # type: ignore[index]

    def _unregister_chunk(self, index: int | Item) -> _Unpinned:
        """Unregister one chunk, piece by piece where it was registered in pieces, each by its own base."""
        if isinstance(index, tuple):  # a registrar's registration
            return _Unpinned(index, *self.transfers.unregister(index))  # type: ignore[union-attr]
        chunk = self.ledger.chunks[index]
        error: RuntimeCallError | None = None
        released: list[tuple[Chunk, RuntimeCallError]] = []
        absent: list[tuple[Chunk, RuntimeCallError]] = []
        started = time.perf_counter()
        for piece in reversed(self.ledger.pieces.get(index, (chunk,))):
            answer, _seconds = self._call(self._unregister, piece.offset, piece.nbytes)
            failure = answer.error
            if failure is not None and failure.code in self._not_registered:  # nothing pinned there
                (absent if piece in self.ledger.maybe else released).append((piece, failure))
                failure = None
            if failure is None:
                self.book.unregistered(index, chunk, piece)  # a piece whose unregister failed stays listed
            else:  # anything, SystemExit included, fails this chunk only
                error = error or failure
        return _Unpinned(index, error, time.perf_counter() - started, tuple(released), tuple(absent))

    def _unpin_failed(self, index: int | Item, exc: Exception) -> _Unpinned:
        if isinstance(index, tuple):
            return _Unpinned(index, self.transfers.unregister_raised(index, exc), 0.0)  # type: ignore[union-attr]
        chunk = self.ledger.chunks[index]
        return _Unpinned(index, between_calls_error(exc, "unregister", self.base_ptr + chunk.offset, chunk.nbytes), 0.0)

    def _land_unpinned(
        self, pending: collections.deque[int | Item], done: Sequence[_Unpinned], unstarted: Sequence[int | Item]
    ) -> None:
        """Put ``done`` on the books; ``unstarted`` chunks go back to the queue."""
        ledger, observer, transfers = self.ledger, self.observer, self.transfers
        with self.lock:
            if ledger.phase is Phase.CLOSED:
                return  # abandoned: these chunks are booked leaked already, their memory kept
            pending.extendleft(reversed(unstarted))
            before = ledger.pinned_bytes
            if transfers is not None:
                undone = [(u.index, u.error) for u in done if isinstance(u.index, tuple)]
                transfers.land_undone(ledger, undone, [item for item in unstarted if isinstance(item, tuple)])
                done = [unpinned for unpinned in done if not isinstance(unpinned.index, tuple)]
                self._changed.notify_all()  # the runtime's chunks may be unpinned once no registrar holds them
            for unpinned in done:
                ledger.released_elsewhere.extend(piece for piece, _answer in unpinned.released)
                index = cast(int, unpinned.index)
                if unpinned.error is None:
                    ledger.unregistered(index)
                else:
                    ledger.unregister_failed(index, unpinned.error)
            moved = ledger.pinned_bytes - before
        if not done:
            return
        observer.pinned_moved(moved)
        for unpinned in done:
            for piece, answer in unpinned.released:
                observer.released_elsewhere(piece, self.base_ptr + piece.offset, answer)
            for piece, answer in unpinned.absent:
                observer.not_registered(piece, self.base_ptr + piece.offset, answer)
            chunk = ledger.chunks[cast(int, unpinned.index)]
            if unpinned.error is None:
                observer.chunk_unregistered(chunk, unpinned.seconds)
            else:
                observer.chunk_failed(chunk, "unregister", unpinned.error, unpinned.seconds)
