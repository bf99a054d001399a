"""The pinning engine: the synchronous bodies that worker threads run, shared by both drivers.

One :class:`PinSession` per entered pool. Workers are long-lived calls of
:meth:`PinSession.work` that pull chunks from the ledger until it says stop, so a pool
pays one thread hop per worker, not per chunk. Every outcome is recorded in the ledger
inside the worker, under the session lock, so a host that was cancelled while waiting
still knows exactly what to roll back.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ._errors import ChunkFailure, RuntimeCallError
from ._ledger import ChunkState, Phase
from ._memory import populate_range
from ._observe import Observer
from ._pipeline import WAIT, Order, Pipeline, Span, _Wait
from ._plan import Chunk
from ._threads import Threads
from .runtimes import Runtime

T = TypeVar("T")
# How one call ended: (its error or None, the pipeline method that records it, the item).
Outcome = tuple[RuntimeCallError | None, Callable[..., int | None], Any]


def as_runtime_error(exc: BaseException, op: str, ptr: int, nbytes: int) -> RuntimeCallError:
    """A runtime that raised something other than RuntimeCallError still gets a typed record."""
    if isinstance(exc, RuntimeCallError):
        return exc
    error = RuntimeCallError(op=op, code=-1, reason=type(exc).__name__, message=str(exc), ptr=ptr, nbytes=nbytes)
    error.__cause__ = exc
    return error


class PinSession:
    """The state of one pinning: pipeline and ledger, lock, runtime, and the memory it pins."""

    def __init__(
        self,
        *,
        chunks: tuple[Chunk, ...],
        runtime: Runtime,
        base_ptr: int,
        order: Order,
        span_bytes: int,
        lookahead_bytes: int,
        register_workers: int,
        populate_workers: int,
        unpin_workers: int,
        observer: Observer,
    ) -> None:
        self.pipeline = Pipeline(
            chunks, order=order, span_bytes=span_bytes, lookahead_bytes=lookahead_bytes,
            register_workers=register_workers, populate_workers=populate_workers,
        )  # fmt: skip
        self.ledger = self.pipeline.ledger
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        self.runtime = runtime
        self.base_ptr = base_ptr
        self.observer = observer
        self.unpin_workers = unpin_workers
        self._populate: Callable[[int, int], None] = getattr(runtime, "populate", None) or populate_range
        self._register: Callable[[int, int], None] = (
            runtime.lock_on_fault if order is Order.REGISTER_FIRST else runtime.register  # type: ignore[attr-defined]
        )
        self.pid = os.getpid()
        self._pin_started = time.perf_counter()
        self.pin_seconds = 0.0
        self.unpin_seconds = 0.0

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

        A batch's outcomes are recorded together, under one lock hold, when the batch ends (its
        items stay in flight until then, so a rollback waits for them); a failure ends the
        batch at once, so the other workers hear of it after one call, not one batch.
        """
        pipeline = self.pipeline
        while (batch := self._next(pipeline.next_work)) is not None:
            items = batch.items
            outcomes: list[Outcome] = []
            try:
                for item in items:
                    if outcomes and pipeline.stopped:  # another worker failed, or the caller cancelled
                        break
                    outcome = self._populate_span(item) if isinstance(item, Span) else self._register_chunk(item)
                    outcomes.append(outcome)
                    if outcome[0] is not None:
                        break
            finally:
                pinned: list[int] = []
                with self._changed:
                    for error, record, item in outcomes:
                        if error is None:
                            if (index := record(item)) is not None:
                                pinned.append(index)
                        else:
                            record(item, error)
                    pipeline.batch_done(batch.role, items[len(outcomes) :])
                    self._changed.notify_all()  # the landings may have made work for waiting workers
                for index in pinned:
                    self.observer.chunk_pinned(self.ledger.chunks[index])
            failure = outcomes[-1][0] if outcomes else None
            if failure is not None and not isinstance(failure.__cause__ or failure, Exception):
                raise failure.__cause__ or failure

    def _populate_span(self, span: Span) -> Outcome:
        pipeline, observer = self.pipeline, self.observer
        ptr = self.base_ptr + span.offset
        observer.call_started()
        started = time.perf_counter()
        try:
            self._populate(ptr, span.nbytes)
        except BaseException as exc:  # recorded, never lost; a worker thread has no caller to raise to
            error = as_runtime_error(exc, "populate", ptr, span.nbytes)
            observer.chunk_failed(self.ledger.chunks[span.chunk], "populate", error, time.perf_counter() - started)
            return (error, pipeline.populate_failed, span)
        else:
            observer.span_populated(span.nbytes, time.perf_counter() - started)
            return (None, pipeline.populated, span)
        finally:
            observer.call_ended()

    def _register_chunk(self, index: int) -> Outcome:
        pipeline, observer = self.pipeline, self.observer
        chunk = self.ledger.chunks[index]
        ptr = self.base_ptr + chunk.offset
        observer.call_started()
        started = time.perf_counter()
        try:
            self._register(ptr, chunk.nbytes)
        except BaseException as exc:
            error = as_runtime_error(exc, "register", ptr, chunk.nbytes)
            observer.chunk_failed(chunk, "register", error, time.perf_counter() - started)
            return (error, pipeline.register_failed, index)
        else:
            observer.chunk_registered(chunk, time.perf_counter() - started)
            return (None, pipeline.registered, index)
        finally:
            observer.call_ended()

    def cancel(self) -> None:
        """Tell workers to stop after their current call."""
        with self._changed:
            self.pipeline.cancel()
            self._changed.notify_all()

    def finish_pinning(self) -> Phase:
        with self.lock:
            return self._finish_pinning_locked()

    def _finish_pinning_locked(self) -> Phase:
        self.pin_seconds = time.perf_counter() - self._pin_started
        return self.pipeline.finish()

    def teardown(self) -> tuple[ChunkFailure, ...]:
        """Unregister every registered chunk base in reverse offset order; idempotent.

        In a forked child nothing is unregistered: the registrations belong to the parent.
        Returns the unregister failures of this teardown.
        """
        ledger, lock = self.ledger, self.lock
        with lock:
            if ledger.phase is Phase.PINNING:
                self._finish_pinning_locked()
            if os.getpid() != self.pid:
                ledger.disown()
                return ()
            order = ledger.teardown_order()
            failed_before = len(ledger.failures)
        started = time.perf_counter()
        pending = iter(order)  # claimed in reverse offset order, by however many workers run
        helpers = Threads()
        for _ in range(min(self.unpin_workers, len(order)) - 1):
            try:
                helpers.start(lambda: self._unregister_work(pending), name="pinpool-unpin")
            except RuntimeError:  # no new threads at interpreter shutdown: fewer workers, same result
                break
        self._unregister_work(pending)
        interrupt = helpers.wait_uninterruptibly()  # the books close only once every helper is done
        with lock:
            ledger.close()
            self.unpin_seconds += time.perf_counter() - started
            failures = tuple(ledger.failures[failed_before:])
        if interrupt is not None:
            raise interrupt
        return failures

    def _unregister_work(self, pending: Iterator[int]) -> None:
        """One unpin worker: unregister chunk bases from the shared reverse-order queue."""
        ledger, lock, observer = self.ledger, self.lock, self.observer
        while True:
            with lock:
                index = next(pending, None)
                was_pinned = index is not None and ledger.states[index] is ChunkState.REGISTERED
            if index is None:
                return
            chunk = ledger.chunks[index]
            ptr = self.base_ptr + chunk.offset
            observer.call_started()
            call_started = time.perf_counter()
            try:
                self.runtime.unregister(ptr)
            except Exception as exc:
                error = as_runtime_error(exc, "unregister", ptr, chunk.nbytes)
                with lock:
                    ledger.unregister_failed(index, error)
                observer.chunk_failed(chunk, "unregister", error, time.perf_counter() - call_started)
            else:
                with lock:
                    ledger.unregistered(index)
                observer.chunk_unregistered(chunk, time.perf_counter() - call_started, was_pinned=was_pinned)
            finally:
                observer.call_ended()
