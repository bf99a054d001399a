"""A pool's life, written once: pin → (body) → teardown, or pin → rollback.

:class:`Lifecycle` is synchronous and has no threads or awaits of its own: its :meth:`enter`
and :meth:`exit` are generators that do the quick, synchronous steps themselves (map the
memory, open and close the books, report) and yield only the steps that need waiting, as
:class:`~pinpool._drivers.RunThreads`. The drivers (``_drivers.py``: ``async with``, ``with``
and the finalizer's inline one) run those and send back what happened. So every rule below
holds for every driver, because there is only one copy of it:

* once a teardown or rollback starts, it finishes before control returns, whatever arrives
  meanwhile; the interruption is re-raised after the books are closed;
* the finalizer never starts a teardown while a driver is running one (or is pinning);
* a worker that crashed, or threads that could not be started, end in a typed
  :class:`PinError` / :class:`UnpinError` after a full rollback; internal invariant errors
  never reach users as themselves.
"""

from __future__ import annotations

import enum
import os
import threading
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import Protocol

import torch

from ._drivers import Ran, RunThreads, drive_inline, drive_sync
from ._engine import PinSession
from ._errors import ChunkFailure, PinError, PoolStateError, UnclosedPoolWarning, UnpinError
from ._ledger import Phase, StopCause
from ._node import BudgetHold, NodeAdmission, NodeBusyError, NodeWaitCancelled, SlotHold
from ._observe import Observer
from ._ranges import PINNED_RANGES
from ._threads import Threads
from ._units import format_bytes

ProgressCallback = Callable[[int, int, int, int], object]


class PoolState(enum.Enum):
    """Where a pool is in its life (``pool.state``).

    NEW: constructed, not entered. PINNING: entered, chunks being pinned (with
    ``background=True`` the body already runs; pages ``[0, pool.pinned_pages)`` are usable).
    READY: every chunk pinned. FAILED: pinning in the background failed and was rolled back;
    the :class:`PinError` is ``pool.error`` and every waiter raises it. CLOSING: unpinning on
    exit. CLOSED: exited, nothing pinned.
    """

    NEW = "new"
    PINNING = "pinning"
    READY = "ready"
    FAILED = "failed"
    CLOSING = "closing"
    CLOSED = "closed"


class Memory(Protocol):
    """The pool's memory: its own mapping, or a caller's tensor (pin())."""

    address: int

    def keep_forever(self) -> None: ...


Steps = Generator[RunThreads, Ran, None]

# Budget shares of pools whose chunks leaked: never released while this process lives.
_KEPT_HOLDS: list[BudgetHold | None] = []


class Lifecycle:
    """One pool's state and its pin / rollback / teardown sequence.

    It holds no reference to the :class:`PinnedPool` façade (the finalizer runs it after the
    façade is gone), only what the sequence needs:

    acquire: maps the memory (or takes the caller's tensor) and claims its address range.
    start: opens a :class:`PinSession` over the memory's address and announces the pin.
    views: the layout's tensors over the memory, once it is pinned (or at once, in the background).
    describe: ``"pool 'x' (4 GiB, 16 chunks of <= 256 MiB, runtime mlock)"`` for messages.
    background: entering returns once pinning has started; a conductor thread runs the rest
    of the pinning step (wait, open or roll back) with the sync driver, and exit stops it.
    """

    def __init__(
        self,
        *,
        name: str,
        nbytes: int,
        num_pages: int,
        chunk_limit: int,
        workers: int,
        describe: str,
        observer: Observer,
        on_progress: ProgressCallback | None,
        acquire: Callable[[], Memory],
        start: Callable[[Memory], PinSession],
        views: Callable[[Memory], Mapping[str, torch.Tensor]],
        background: bool = False,
        admission: NodeAdmission | None = None,
    ) -> None:
        self.name = name
        self.nbytes = nbytes
        self.num_pages = num_pages
        self.chunk_limit = chunk_limit
        self.workers = workers
        self.describe = describe
        self.observer = observer
        self.on_progress = on_progress
        self.background = background
        self._acquire = acquire
        self._start = start
        self._views = views
        self.state = PoolState.NEW
        self.session: PinSession | None = None
        self.memory: Memory | None = None
        self.tensors: Mapping[str, torch.Tensor] | None = None
        self.error: BaseException | None = None  # why background pinning failed (state FAILED)
        self.error_delivered = False  # a waiter (or pool.error) has handed it to the user
        self._lock = threading.Lock()
        self._driven = False  # a driver is running enter() or exit(): the finalizer keeps off
        self._conductor: Threads | None = None  # background: the thread finishing the pinning step
        self._orphaned = False  # background: the façade was collected while pinning; the conductor cleans up
        # Node pacing: a slot while pinning, a share of the host's budget while anything is pinned.
        self.admission = admission
        self._admit_cancel = threading.Event()
        self._slot: SlotHold | None = None
        self._budget: BudgetHold | None = None

    # -- the sequence ----------------------------------------------------------------------------

    def enter(self) -> Steps:
        with self._lock:
            if self.state is not PoolState.NEW:
                raise PoolStateError(
                    f"pool {self.name!r} is {self.state.value}: a PinnedPool is entered once; "
                    "create a new PinnedPool to pin again"
                )
            self.state = PoolState.PINNING
            self._driven = True
        try:
            yield from self._enter()
        finally:
            self._driven = False

    def _enter(self) -> Steps:
        if not self.background:
            try:
                yield from self._admit()
            except BaseException:
                self.state = PoolState.CLOSED
                raise
        try:
            memory = self._acquire()
        except BaseException:
            self._release_budget()
            self.state = PoolState.CLOSED
            raise
        try:
            session = self._start(memory)
        except BaseException:
            PINNED_RANGES.pop(memory.address)
            self._release_budget()
            self.state = PoolState.CLOSED
            raise
        self.memory, self.session = memory, session
        pinning = RunThreads(
            bodies=(session.work,) * self.workers,
            name=f"pinpool-{self.name}",
            interruptible=True,
            on_interrupt=session.cancel,
            on_tick=self._report_progress if self.on_progress else None,
            on_started=session.go,
        )
        if self.background:
            yield from self._enter_background(session, pinning)
            return
        ran = yield pinning
        self._release_slot()  # pinning is over: another rank may start while this one opens or rolls back
        error = self._after_pinning(session, ran)
        if error is None:
            return
        assert not isinstance(error, _Orphaned)  # only a background pool outlives its façade while pinning
        failures, interrupts = yield from self._roll_back(session, error)
        self._close(session, failures, rolled_back=True)
        if isinstance(error, _Failed):
            error = self._pin_error(session, error)
            if interrupts:  # an interruption during the rollback still propagates: it was asked for
                interrupts[0].add_note(f"pinpool: {error}")
                raise interrupts[0]
        raise error

    def _roll_back(
        self, session: PinSession, error: BaseException | _Failed
    ) -> Generator[RunThreads, Ran, tuple[tuple[ChunkFailure, ...], list[BaseException]]]:
        ledger = session.ledger
        failed = isinstance(error, _Failed) or ledger.stop_cause is StopCause.FAILURE
        cause = StopCause.FAILURE if failed else StopCause.CANCELLED
        self.observer.rollback(cause=cause.value, registered_chunks=ledger.chunks_done)
        return (yield from self._teardown(session))

    def _after_pinning(self, session: PinSession, ran: Ran) -> BaseException | _Failed | _Orphaned | None:
        """Every pinning thread is done: open the pool, or say what to raise after the rollback."""
        if ran.crashed or ran.started == 0:
            session.stop(StopCause.FAILURE)
        phase = session.finish_pinning()
        if ran.interrupts:
            return ran.interrupts[0]
        if phase is Phase.PINNED:
            try:
                self._report_progress()  # the final 100%; raising from it rolls back
                self.observer.pinned(nbytes=self.nbytes, chunks=len(session.ledger.chunks), seconds=session.pin_seconds)
                assert self.memory is not None
                if self.tensors is None:
                    self.tensors = self._views(self.memory)
            except BaseException as exc:
                return exc
            with self._lock:
                if self._orphaned:  # background, and the façade is gone: nobody will exit it
                    return _Orphaned()
                self.state = PoolState.READY
            return None
        return _Failed(ran)

    # -- background pinning --------------------------------------------------------------------------

    def _enter_background(self, session: PinSession, pinning: RunThreads) -> Steps:
        """Hand the pinning step to a conductor thread and return: the body runs while it pins."""
        assert self.memory is not None
        try:
            self.tensors = self._views(self.memory)  # pages [0, pinned_pages) are usable at once
        except BaseException as exc:
            yield from self._close_unpinned(session)
            raise exc
        conductor = self._conductor = Threads()
        try:
            conductor.start(lambda: drive_sync(self._conduct(session, pinning)), name=f"pinpool-{self.name}-pin")
            return
        except BaseException as exc:
            first = exc
        # The conductor could not be started, or an interrupt landed in Thread.start: it either
        # never runs or runs (maybe waiting for node pacing) and is stopped and waited for; then
        # whatever it pinned is undone.
        interrupts = yield from self._wait_conductor(session)
        if self.state is PoolState.PINNING:  # it never ran: nothing was pinned
            interrupts += yield from self._close_unpinned(session)
        else:
            interrupts += yield from self._close_after_conductor(session)
        if isinstance(first, Exception):
            error = PinError(
                f"pinning {self.describe} in the background failed: its thread could not be started "
                f"({type(first).__name__}: {first}); nothing is pinned. Lower the worker counts or raise the "
                "thread limit",
                failures=(),
                leaked=(),
            )
            raise error from first
        raise first

    def _conduct(self, session: PinSession, pinning: RunThreads) -> Steps:
        """The conductor's sequence: admission (node pacing); pin; then open, or roll back and keep
        the error for waiters."""
        try:
            yield from self._admit()
        except BaseException as exc:  # cancelled by exit, or fail-fast pacing: nothing was pinned
            if isinstance(exc, NodeWaitCancelled):
                yield from self._close_unpinned(session)
                return
            self.error = exc  # before the state says FAILED: a waiter reads the state, then the error
            yield from self._close_unpinned(session, final=PoolState.FAILED)
            self.observer.failed_in_background(exc)
            return
        ran = yield pinning
        self._release_slot()
        outcome = self._after_pinning(session, ran)
        if outcome is None:
            return
        if isinstance(outcome, _Orphaned):
            self.state = PoolState.CLOSING
            failures, _ = yield from self._teardown(session)
            self._close(session, failures, rolled_back=True)
            return
        failures, _ = yield from self._roll_back(session, outcome)
        if isinstance(outcome, _Failed) and session.ledger.stop_cause is StopCause.CANCELLED:
            self._close(session, failures, rolled_back=True)  # stopped by exit: not a failure
            return
        if isinstance(outcome, _Failed):
            error: BaseException = self._pin_error(session, outcome)
        else:  # on_progress raised, or opening the pool did (a conductor thread sees no signals)
            error = PinError(
                f"pinning {self.describe} stopped: {type(outcome).__name__}: {outcome} (raised by on_progress "
                "or while opening the pool); every registered chunk was rolled back",
                failures=(),
                leaked=session.ledger.leaked(),
            )
            error.__cause__ = outcome
        self.error = error
        self._close(session, failures, rolled_back=True, final=PoolState.FAILED)
        self.observer.failed_in_background(error)

    def _close_unpinned(
        self, session: PinSession, final: PoolState = PoolState.CLOSED
    ) -> Generator[RunThreads, Ran, list[BaseException]]:
        """Close a pool whose pinning never started: the books close with nothing to undo."""
        session.stop(StopCause.CANCELLED)
        failures, interrupts = yield from self._teardown(session)
        self._close(session, failures, rolled_back=True, final=final)
        return interrupts

    def _wait_conductor(self, session: PinSession) -> Generator[RunThreads, Ran, list[BaseException]]:
        """Stop background pinning after its current calls and wait until the conductor is done."""
        conductor = self._conductor
        if conductor is None or conductor.done:
            return []
        self._admit_cancel.set()
        session.cancel()
        ran = yield RunThreads(bodies=(conductor.join,), name=f"pinpool-{self.name}-join")
        return ran.interrupts

    def _close_after_conductor(self, session: PinSession) -> Generator[RunThreads, Ran, list[BaseException]]:
        """The conductor is done: unpin a pool it opened; a failed one is closed (its error stays)."""
        if self.state is PoolState.READY:
            self.state = PoolState.CLOSING
            failures, interrupts = yield from self._teardown(session)
            self._close(session, failures, rolled_back=True)
            return interrupts
        if self.state is PoolState.FAILED:
            self.state = PoolState.CLOSED
        return []

    # -- exit --------------------------------------------------------------------------------------

    def exit(self, body_error: BaseException | None) -> Steps:
        with self._lock:
            exitable = (PoolState.READY, PoolState.PINNING, PoolState.FAILED) if self.background else (PoolState.READY,)
            if self.state not in exitable or self.session is None:
                raise PoolStateError(
                    f"pool {self.name!r} is {self.state.value}: it can be exited once, after it was entered"
                )
            if self.state is PoolState.READY and not self.background:
                self.state = PoolState.CLOSING
            self._driven = True
        try:
            session = self.session
            interrupts: list[BaseException] = []
            if self.background:
                interrupts += yield from self._wait_conductor(session)
                if self.state is PoolState.FAILED:
                    self.state = PoolState.CLOSED
                    self._deliver_on_exit(body_error, interrupts)
                    return
                if self.state is not PoolState.READY:  # stopped by this exit and rolled back
                    if interrupts:
                        raise interrupts[0]
                    return
                self.state = PoolState.CLOSING
            failures, more = yield from self._teardown(session)
            interrupts += more
            try:
                self._close(session, failures, body_error=body_error)
            except UnpinError as error:
                if not interrupts:
                    raise
                interrupts[0].add_note(f"pinpool: {error}")
            if interrupts:
                raise interrupts[0]
        finally:
            self._driven = False

    def _deliver_on_exit(self, body_error: BaseException | None, interrupts: list[BaseException]) -> None:
        """Leaving a pool whose background pinning failed: its error is raised unless the user
        already has it (a waiter raised it, or ``pool.error`` was read), never silently dropped."""
        error = self.error
        if interrupts:
            if error is not None and not self.error_delivered:
                interrupts[0].add_note(f"pinpool: {error}")
            raise interrupts[0]
        if error is None or self.error_delivered:
            return
        self.error_delivered = True
        if body_error is not None:
            body_error.add_note(f"pinpool: pinning in the background had failed: {error}")
            return
        raise error

    # -- node pacing -------------------------------------------------------------------------------

    def _admit(self) -> Generator[RunThreads, Ran, None]:
        """Wait for this host's pacing to admit the pool: a share of the node budget, then a
        pinning slot. Run as a thread step, so every driver's interrupt rules apply to the wait."""
        admission = self.admission
        if admission is None:
            return
        cancel = self._admit_cancel

        def admit() -> None:
            if admission.pacing.budget_bytes is not None:
                self._budget = admission.reserve_budget_sync(self.nbytes, cancelled=cancel.is_set)
            self._slot = admission.acquire_slot_sync(cancelled=cancel.is_set)

        ran = yield RunThreads(
            bodies=(admit,), name=f"pinpool-{self.name}-admit", interruptible=True, on_interrupt=cancel.set
        )
        if not (ran.interrupts or ran.crashed or ran.start_errors):
            for kind, hold in (("budget", self._budget), ("slot", self._slot)):
                if hold is not None and not hold.released:
                    self.observer.node_admitted(kind=kind, seconds=hold.waited_seconds)
            return
        self._release_slot()
        self._release_budget()
        if ran.interrupts:
            raise ran.interrupts[0]
        if ran.crashed:
            error = ran.crashed[0]
            if isinstance(error, NodeBusyError):
                self.observer.node_busy(kind=error.kind)
            raise error
        raise PinError(
            f"pinning {self.describe}: the node-pacing wait could not start a thread ({ran.start_errors[0]})",
            failures=(),
            leaked=(),
        ) from ran.start_errors[0]

    def _release_slot(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()

    def _release_budget(self) -> None:
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.release()

    # -- readiness ---------------------------------------------------------------------------------

    @property
    def pinned_pages(self) -> int:
        """Pages ``[0, k)`` pinned now in every buffer."""
        if self.state is PoolState.READY:
            return self.num_pages
        session = self.session
        if self.state is not PoolState.PINNING or session is None or session.prefix is None:
            return 0
        return session.prefix.pages

    def reached(self, pages: int | None) -> bool:
        """Whether the pool is ready (``pages`` None) or has its first ``pages`` pages pinned;
        raises the background failure, or PoolStateError for a pool that can no longer get there."""
        state = self.state
        if state is PoolState.READY:
            return True
        if state is PoolState.PINNING:
            return pages is not None and self.pinned_pages >= pages
        if state is PoolState.FAILED and self.error is not None:
            self.error_delivered = True
            raise self.error
        if state is PoolState.NEW:
            raise PoolStateError(f"pool {self.name!r} is new: enter it (async with / with) before waiting for it")
        raise PoolStateError(f"pool {self.name!r} is {state.value}: it was exited before it was ready")

    def _teardown(
        self, session: PinSession
    ) -> Generator[RunThreads, Ran, tuple[tuple[ChunkFailure, ...], list[BaseException]]]:
        bodies = session.begin_teardown()
        ran = yield RunThreads(bodies=bodies, name=f"pinpool-{self.name}-unpin")
        return session.end_teardown(ran.crashed), ran.interrupts

    def _close(
        self,
        session: PinSession,
        failures: tuple[ChunkFailure, ...],
        *,
        body_error: BaseException | None = None,
        rolled_back: bool = False,
        final: PoolState = PoolState.CLOSED,
    ) -> None:
        """Close the books after teardown, and let the memory go unless a chunk leaked (then it is
        kept mapped and its range stays claimed: part of it may still be pinned). After a rollback,
        unpin failures are reported by the PinError that follows (its ``leaked``), not raised here."""
        memory = self.memory
        was_open = self.state is PoolState.CLOSING
        self.state = final
        self.tensors = None
        self.memory = None
        assert memory is not None
        leaked = session.ledger.leaked()
        self.observer.unpinned(
            nbytes=self.nbytes, seconds=session.unpin_seconds, failures=len(failures),
            leaked_bytes=sum(c.nbytes for c in leaked), pinned=was_open,
        )  # fmt: skip
        if leaked:
            memory.keep_forever()
            _KEPT_HOLDS.append(self._budget)  # those bytes may still be pinned: they stay counted
        else:
            PINNED_RANGES.pop(memory.address)
            self._release_budget()
        if not failures or rolled_back:
            return
        error = UnpinError(
            f"unpinning pool {self.name!r}: {len(failures)} chunk(s) failed to unregister "
            f"({', '.join(f'offset={f.chunk.offset} rc={f.error.code} ({f.error.reason})' for f in failures)}); "
            f"{format_bytes(sum(c.nbytes for c in leaked))} may still be pinned; the memory is kept mapped",
            failures=failures,
            leaked=leaked,
        )
        if body_error is not None:
            body_error.add_note(f"pinpool: {error}")
            return
        raise error

    def _pin_error(self, session: PinSession, failed: _Failed) -> PinError:
        ledger = session.ledger
        failures = ledger.failures_in("populate", "register")
        leaked = ledger.leaked()
        rolled = (
            f"; rolled back, {len(leaked)} chunk(s) could not be unregistered and may still be pinned: {leaked}"
            if leaked
            else "; every registered chunk was rolled back"
        )
        if not failures:  # no runtime call failed: the threads did
            ran = failed.ran
            causes = ran.crashed or ran.start_errors
            cause = causes[0] if causes else None
            what = (
                f"a pinning thread failed ({type(cause).__name__}: {cause}; this is a pinpool bug, please report it)"
                if ran.crashed
                else f"no pinning thread could be started ({type(cause).__name__}: {cause}); "
                "the process is out of threads: lower the worker counts or raise the thread limit"
            )
            error = PinError(f"pinning {self.describe} failed: {what}{rolled}", failures=(), leaked=leaked)
            error.__cause__ = cause
            return error
        first = min(failures, key=lambda f: f.chunk.offset)
        message = (
            f"pinning {self.describe} failed at offset={first.chunk.offset} nbytes={first.chunk.nbytes} "
            f"total={self.nbytes} chunk_limit={self.chunk_limit}: {first.phase} "
            f"rc={first.error.code} ({first.error.reason}): {first.error.message}"
        )
        if len(failures) > 1:
            message += f" [{len(failures)} calls failed, in {len({f.chunk for f in failures})} chunk(s)]"
        if session.retries:
            message += (
                f" [after {session.retries} retries with aligned halves, down to min_chunk_bytes or the max_retries "
                "budget; every attempt is in .failures]"
            )
        error = PinError(message + rolled, failures=failures, leaked=leaked)
        error.__cause__ = first.error
        return error

    def _report_progress(self) -> None:
        session = self.session
        if self.on_progress is not None and session is not None:
            ledger = session.ledger
            self.on_progress(session.pipeline.pinned_bytes, self.nbytes, ledger.chunks_done, len(ledger.chunks))

    # -- the finalizer -------------------------------------------------------------------------------

    def finalize(self) -> None:
        """The façade was garbage-collected (or is alive at interpreter exit) without being exited."""
        with self._lock:
            session = self.session
            state = self.state
            if self._driven or session is None or state not in (PoolState.READY, PoolState.PINNING, PoolState.FAILED):
                return  # a driver owns it (and will finish or roll back), or there is nothing to undo
            if os.getpid() != session.pid:
                return  # a forked child: the registrations are its parent's
            conductor = self._conductor
            orphaned = state is PoolState.PINNING and conductor is not None and not conductor.done
            if orphaned:
                # Background pinning goes on: its conductor undoes it when done. Waiting for it
                # here could deadlock (a collection may run on the conductor's own thread).
                self._orphaned = True
            elif state is PoolState.FAILED:
                self.state = PoolState.CLOSED
            else:
                self.state = PoolState.CLOSING
                self._driven = True
        if orphaned:
            session.cancel()
            self._warn_unclosed("is unpinning what it pinned in the background")
            return
        if state is PoolState.FAILED:
            if not self.error_delivered:
                self._warn_unclosed(f"had failed to pin in the background, and nobody saw why: {self.error}")
            return
        try:
            session.cancel()
            session.wait_idle()  # a driver that died mid-pin may have left workers finishing a call
            pinned = session.ledger.registered_bytes
            # Unpin first: a warning turned into an error must not keep memory pinned.
            drive_inline(self._finalize_steps(session))
        finally:
            self._driven = False
        self._warn_unclosed(f"unpinned its {format_bytes(pinned)} in a finalizer")

    def _warn_unclosed(self, what: str) -> None:
        warnings.warn(
            f"PinnedPool {self.name!r} was never exited; {what}. "
            "Use `async with` / `with` so teardown happens where you expect it",
            UnclosedPoolWarning,
            stacklevel=3,
        )

    def _finalize_steps(self, session: PinSession) -> Steps:
        failures, _interrupts = yield from self._teardown(session)
        self._close(session, failures, rolled_back=True)  # nobody to raise to: logged and counted


class _Failed:
    """Pinning ended without an interruption and without opening: a runtime call failed, a worker
    crashed, or no worker could be started. The PinError is built after the rollback, when what
    leaked is known."""

    def __init__(self, ran: Ran) -> None:
        self.ran = ran


class _Orphaned:
    """Background pinning finished after the façade was collected: nobody will exit the pool, so
    the conductor unpins it."""
