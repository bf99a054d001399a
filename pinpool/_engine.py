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

from ._errors import ChunkFailure, RuntimeCallError
from ._ledger import Ledger, Phase
from ._memory import populate_range
from ._observe import Observer
from ._plan import Chunk
from .runtimes import Runtime


def as_runtime_error(exc: BaseException, op: str, ptr: int, nbytes: int) -> RuntimeCallError:
    """A runtime that raised something other than RuntimeCallError still gets a typed record."""
    if isinstance(exc, RuntimeCallError):
        return exc
    error = RuntimeCallError(op=op, code=-1, reason=type(exc).__name__, message=str(exc), ptr=ptr, nbytes=nbytes)
    error.__cause__ = exc
    return error


class PinSession:
    """The state of one pinning: ledger, lock, runtime, and the memory it pins."""

    def __init__(
        self,
        *,
        chunks: tuple[Chunk, ...],
        runtime: Runtime,
        base_ptr: int,
        populate: bool,
        observer: Observer,
    ) -> None:
        self.ledger = Ledger(chunks)
        self.lock = threading.Lock()
        self.runtime = runtime
        self.base_ptr = base_ptr
        self._populate = populate
        self.observer = observer
        self.pid = os.getpid()
        self._pin_started = time.perf_counter()
        self.pin_seconds = 0.0
        self.unpin_seconds = 0.0

    # -- worker bodies ---------------------------------------------------------------------

    def work(self) -> None:
        """One worker: claim, (populate,) register, record; until the ledger hands out nothing."""
        ledger, lock = self.ledger, self.lock
        while True:
            with lock:
                index = ledger.claim()
            if index is None:
                return
            chunk = ledger.chunks[index]
            ptr = self.base_ptr + chunk.offset
            observer = self.observer
            phase = "populate"
            observer.call_started()
            started = time.perf_counter()
            try:
                if self._populate:
                    populate_range(ptr, chunk.nbytes)
                    populated = time.perf_counter()
                    observer.chunk_populated(chunk, populated - started)
                    started = populated
                phase = "register"
                self.runtime.register(ptr, chunk.nbytes)
            except BaseException as exc:  # recorded, never lost; a worker thread has no caller to raise to
                error = as_runtime_error(exc, phase, ptr, chunk.nbytes)
                with lock:
                    ledger.failed(index, phase, error)
                observer.chunk_failed(chunk, phase, error, time.perf_counter() - started)
                if not isinstance(exc, Exception):
                    raise
            else:
                seconds = time.perf_counter() - started
                with lock:
                    ledger.registered(index)
                observer.chunk_registered(chunk, seconds)
            finally:
                observer.call_ended()

    def cancel(self) -> None:
        """Tell workers to stop after their current chunk."""
        with self.lock:
            self.ledger.cancel()

    def finish_pinning(self) -> Phase:
        with self.lock:
            return self._finish_pinning_locked()

    def _finish_pinning_locked(self) -> Phase:
        self.pin_seconds = time.perf_counter() - self._pin_started
        return self.ledger.finish_pinning()

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
        for index in order:
            chunk = ledger.chunks[index]
            ptr = self.base_ptr + chunk.offset
            self.observer.call_started()
            call_started = time.perf_counter()
            try:
                self.runtime.unregister(ptr)
            except Exception as exc:
                error = as_runtime_error(exc, "unregister", ptr, chunk.nbytes)
                with lock:
                    ledger.unregister_failed(index, error)
                self.observer.chunk_failed(chunk, "unregister", error, time.perf_counter() - call_started)
            else:
                with lock:
                    ledger.unregistered(index)
                self.observer.chunk_unregistered(chunk, time.perf_counter() - call_started)
            finally:
                self.observer.call_ended()
        with lock:
            ledger.close()
            self.unpin_seconds += time.perf_counter() - started
            return tuple(ledger.failures[failed_before:])
