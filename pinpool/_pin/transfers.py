"""The transfer registrars' calls, for the session's workers: a registration is one more item a worker takes
once its chunks are pinned (threads of the registrars' own, and pinning threads the pipeline has nothing for),
and undoing it one more item an unpinning worker takes, before any chunk of the runtime's. Decisions are the
books' (:mod:`.transfer_ledger`); this module makes the calls."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from .._errors import LedgerError, RuntimeCallError, between_calls_error
from .._observe import Observer
from .._plan.chunks import Chunk
from .._plan.prefix import PrefixTracker
from .._plan.transfers import TransferPlan
from .ledger import Ledger, StopCause
from .pipeline import WAIT, Batch, Landing, Pipeline, _Wait, take_batch
from .transfer_calls import TransferAnswer, call_registrar
from .transfer_ledger import Item, RunState, TransferLedger

if TYPE_CHECKING:
    from ..registrars import TransferRegistrar


class Transfers:
    """One pool's registrars and their books; every method but the calls and the reads (held, live) runs under the
    session's lock."""

    def __init__(
        self, plans: Sequence[TransferPlan], registrars: Sequence[TransferRegistrar], pipeline: Pipeline,
        prefix: PrefixTracker, *,
        base_ptr: int, observer: Observer, calls: dict[int, tuple[str, int, int, float]], raised: list[BaseException],
        lock: threading.Lock,
    ) -> None:  # fmt: skip
        self.books = TransferLedger(plans, prefix)
        self.pipeline = pipeline
        self.registrars = tuple(registrars)
        self.base_ptr, self.observer = base_ptr, observer
        self._calls, self._raised = calls, raised  # the session's: what teardown waits on, what to raise again
        self._lock, self._pid = lock, os.getpid()

    def live(self, index: int) -> list[tuple[Chunk, object]]:
        """Registrar ``index``'s registrations held now, with their handles (none in a forked child)."""
        if os.getpid() != self._pid:
            return []
        return self.books.live(index)  # without the lock: see held()

    def held(self, index: int, registrations: Iterable[int]) -> dict[int, object]:
        """The handles of those of registrar ``index``'s ``registrations`` (indices) held now (none in a forked
        child). Read without the session's lock, one list item at a time, state before handle (a handle is stored
        before its state says REGISTERED): a close() run by a signal handler while the main thread reads here
        takes that lock, and would wait for ever for a read it interrupted."""
        if os.getpid() != self._pid:
            return {}
        states, handles = self.books.states[index], self.books.handles[index]
        return {r: handles[r] for r in registrations if states[r] is RunState.REGISTERED}

    # -- pinning -------------------------------------------------------------------------------

    def next_work(self) -> Batch | _Wait | None:
        """A pinning worker's next batch: the pipeline's, else a registration whose chunks are all pinned."""
        work = self.pipeline.next_work()
        if isinstance(work, Batch) or self.pipeline.stopped or (item := self.books.claim()) is None:
            return work
        return Batch("transfer", (item,))

    def next_transfer(self) -> Batch | _Wait | None:
        """A transfer worker's next registration; WAIT until one is ready, None once none will be."""
        books, pipeline = self.books, self.pipeline
        if pipeline.stopped or books.complete:
            return None
        if (item := books.claim()) is not None:
            return Batch("transfer", (item,))
        if not (pipeline.in_flight or books.in_flight or not pipeline.handed_out):
            raise LedgerError("transfer registrations would wait forever: no chunk or registration is in flight")
        return WAIT

    def land(self, landing: Landing, ledger: Ledger) -> None:
        item = landing.item
        assert isinstance(item, tuple)
        if landing.stopped:
            self.books.unclaim(item)
        elif landing.error is None:
            self.books.registered(item, landing.handle)
        else:  # any registrar's failure rolls back every registration of every registrar
            ledger.failures.append(self.books.failed(item, landing.error, maybe=bool(landing.maybe)))
            ledger.stop(StopCause.FAILURE)

    def register(self, item: Item) -> Landing:
        answer = self._call(item, "register")
        if answer.error is None:
            return Landing(item, handle=answer.handle)
        return Landing(item, answer.error, maybe=(self.books.run(item),) if answer.maybe else ())

    def register_raised(self, item: Item, exc: BaseException) -> Landing:
        """pinpool raised around a register call (a bug): it may have registered, so it is undone."""
        error, run = self._between_calls(item, exc, "register"), self.books.run(item)
        self.observer.transfer_failed(self.registrars[item[0]].name, "register", run, error, 0.0)
        return Landing(item, error, maybe=(run,))

    # -- teardown ------------------------------------------------------------------------------

    def take_undo(
        self, pending: collections.deque[int | Item], share: int, wait: Callable[[], object] | None,
        chunk_bytes: Callable[[int], int],
    ) -> list[int | Item]:  # fmt: skip
        """The next batch of ``pending``: registrations (before any chunk), or chunks once no registrar's undo is
        out with a worker; ``wait()`` while neither may be taken, until the books close (a teardown given up).
        Without ``wait`` (a finalizer, which never waits on an earlier attempt's worker) none: what is left
        is booked leaked, and the runtime unpins nothing an engine may still hold."""
        books = self.books

        def blocked() -> bool:
            head = pending[0]
            return books.unpinning if not isinstance(head, tuple) else not books.may_undo(head)

        while pending and blocked() and not books.closed:
            if wait is None:
                return []
            wait()
        if not pending or not isinstance(pending[0], tuple):
            return take_batch(lambda: pending.popleft() if pending else None, chunk_bytes, share)  # type: ignore[arg-type]
        taken: set[int] = set()

        def take() -> Item | None:
            head = pending[0] if pending else None
            if not isinstance(head, tuple) or not books.may_undo(head, frozenset(taken)):
                return None
            taken.add(head[0])
            books.undoing[head[0]] += 1
            pending.popleft()
            return head

        return list(take_batch(take, books.run_bytes, share))  # type: ignore[arg-type]

    def unregister(self, item: Item) -> tuple[RuntimeCallError | None, float]:
        answer = self._call(item, "unregister")
        return answer.error, answer.seconds

    def unregister_raised(self, item: Item, exc: BaseException) -> RuntimeCallError:
        error = self._between_calls(item, exc, "unregister")
        self.observer.transfer_failed(self.registrars[item[0]].name, "unregister", self.books.run(item), error, 0.0)
        return error

    def land_undone(
        self, ledger: Ledger, done: Sequence[tuple[Item, RuntimeCallError | None]], put_back: Sequence[Item]
    ) -> None:
        """Undo calls returned (``done``), or were handed back unmade (``put_back``)."""
        books = self.books
        for item in (*(item for item, _ in done), *put_back):
            books.undoing[item[0]] -= 1
        for item, error in done:
            if error is None:
                books.unregistered(item)
            else:
                ledger.failures.append(books.unregister_failed(item, error))

    def give_up(self, ledger: Ledger, *, reason: str, why: str) -> None:
        """Teardown gives up: every registration still held is booked leaked; then the books close."""
        books = self.books
        for item in books.teardown_order():
            run = books.run(item)
            ledger.failures.append(books.unregister_failed(item, RuntimeCallError(
                op=f"{self.registrars[item[0]].name} unregister", code=-1, reason=reason,
                ptr=self.base_ptr + run.offset, nbytes=run.nbytes, message=f"never unregistered: {why}",
            )))  # fmt: skip
        books.close()

    # -- the calls -----------------------------------------------------------------------------

    def _call(self, item: Item, op: str) -> TransferAnswer:
        registrar, run = self.registrars[item[0]], self.books.run(item)
        ptr, nbytes, me = self.base_ptr + run.offset, run.nbytes, threading.get_ident()
        handle = self.books.handles[item[0]][item[1]]
        call = (lambda: registrar.register(ptr, nbytes)) if op == "register" else (
            lambda: registrar.unregister(ptr, nbytes, handle)
        )  # fmt: skip
        try:
            self._calls[me] = (f"{registrar.name} {op}", ptr, nbytes, time.perf_counter())
            answer = call_registrar(call, registrar.name, op, ptr, nbytes)
        finally:
            self._calls.pop(me, None)
        if answer.raised is not None:
            self._raised.append(answer.raised)
        return self._observed(registrar, op, run, answer)

    def _observed(self, registrar: TransferRegistrar, op: str, run: Chunk, answer: TransferAnswer) -> TransferAnswer:
        error, observer = answer.error, self.observer
        if error is None:
            done = observer.transfer_registered if op == "register" else observer.transfer_unregistered
            done(registrar.name, run, answer.seconds)
        elif op == "unregister" and not answer.maybe and error.code in registrar.limits.not_registered_codes:
            observer.transfer_unregistered(registrar.name, run, answer.seconds)  # nothing was held there
            return TransferAnswer(seconds=answer.seconds)
        else:
            observer.transfer_failed(registrar.name, op, run, error, answer.seconds)
        return answer

    def _between_calls(self, item: Item, exc: BaseException, op: str) -> RuntimeCallError:
        run = self.books.run(item)
        return between_calls_error(exc, f"{self.registrars[item[0]].name} {op}", self.base_ptr + run.offset, run.nbytes)
