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

from ._drivers import Ran, RunThreads, drive_inline
from ._engine import PinSession
from ._errors import ChunkFailure, PinError, PoolStateError, UnclosedPoolWarning, UnpinError
from ._ledger import Phase, StopCause
from ._observe import Observer
from ._ranges import PINNED_RANGES
from ._units import format_bytes

ProgressCallback = Callable[[int, int, int, int], object]


class PoolState(enum.Enum):
    NEW = "new"
    PINNING = "pinning"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Memory(Protocol):
    """The pool's memory: its own mapping, or a caller's tensor (pin())."""

    address: int

    def keep_forever(self) -> None: ...


Steps = Generator[RunThreads, Ran, None]


class Lifecycle:
    """One pool's state and its pin / rollback / teardown sequence.

    It holds no reference to the :class:`PinnedPool` façade (the finalizer runs it after the
    façade is gone), only what the sequence needs:

    acquire: maps the memory (or takes the caller's tensor) and claims its address range.
    start: opens a :class:`PinSession` over the memory's address and announces the pin.
    views: the layout's tensors over the memory, once it is pinned.
    describe: ``"pool 'x' (4 GiB, 16 chunks of <= 256 MiB, runtime mlock)"`` for messages.
    """

    def __init__(
        self,
        *,
        name: str,
        nbytes: int,
        chunk_limit: int,
        workers: int,
        describe: str,
        observer: Observer,
        on_progress: ProgressCallback | None,
        acquire: Callable[[], Memory],
        start: Callable[[Memory], PinSession],
        views: Callable[[Memory], Mapping[str, torch.Tensor]],
    ) -> None:
        self.name = name
        self.nbytes = nbytes
        self.chunk_limit = chunk_limit
        self.workers = workers
        self.describe = describe
        self.observer = observer
        self.on_progress = on_progress
        self._acquire = acquire
        self._start = start
        self._views = views
        self.state = PoolState.NEW
        self.session: PinSession | None = None
        self.memory: Memory | None = None
        self.tensors: Mapping[str, torch.Tensor] | None = None
        self._lock = threading.Lock()
        self._driven = False  # a driver is running enter() or exit(): the finalizer keeps off

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
        try:
            memory = self._acquire()
        except BaseException:
            self.state = PoolState.CLOSED
            raise
        try:
            session = self._start(memory)
        except BaseException:
            PINNED_RANGES.pop(memory.address)
            self.state = PoolState.CLOSED
            raise
        self.memory, self.session = memory, session
        ran = yield RunThreads(
            bodies=(session.work,) * self.workers,
            name=f"pinpool-{self.name}",
            interruptible=True,
            on_interrupt=session.cancel,
            on_tick=self._report_progress if self.on_progress else None,
        )
        error = self._after_pinning(session, ran)
        if error is None:
            return
        ledger = session.ledger
        failed = isinstance(error, _Failed) or ledger.stop_cause is StopCause.FAILURE
        cause = StopCause.FAILURE if failed else StopCause.CANCELLED
        self.observer.rollback(cause=cause.value, registered_chunks=ledger.chunks_done)
        failures, interrupts = yield from self._teardown(session)
        self._close(session, failures, rolled_back=True)
        if isinstance(error, _Failed):
            error = self._pin_error(session, error)
            if interrupts:  # an interruption during the rollback still propagates: it was asked for
                interrupts[0].add_note(f"pinpool: {error}")
                raise interrupts[0]
        raise error

    def _after_pinning(self, session: PinSession, ran: Ran) -> BaseException | _Failed | None:
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
                self.tensors = self._views(self.memory)
            except BaseException as exc:
                return exc
            self.state = PoolState.OPEN
            return None
        return _Failed(ran)

    def exit(self, body_error: BaseException | None) -> Steps:
        with self._lock:
            if self.state is not PoolState.OPEN or self.session is None:
                raise PoolStateError(
                    f"pool {self.name!r} is {self.state.value}: it can be exited once, after it was entered"
                )
            self.state = PoolState.CLOSING
            self._driven = True
        try:
            session = self.session
            failures, interrupts = yield from self._teardown(session)
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
    ) -> None:
        """Close the books after teardown, and let the memory go unless a chunk leaked (then it is
        kept mapped and its range stays claimed: part of it may still be pinned). After a rollback,
        unpin failures are reported by the PinError that follows (its ``leaked``), not raised here."""
        memory = self.memory
        was_open = self.state is PoolState.CLOSING
        self.state = PoolState.CLOSED
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
        else:
            PINNED_RANGES.pop(memory.address)
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
            self.on_progress(ledger.registered_bytes, self.nbytes, ledger.chunks_done, len(ledger.chunks))

    # -- the finalizer -------------------------------------------------------------------------------

    def finalize(self) -> None:
        """The façade was garbage-collected (or is alive at interpreter exit) without being exited."""
        with self._lock:
            session = self.session
            if self._driven or session is None or self.state not in (PoolState.OPEN, PoolState.PINNING):
                return  # a driver owns it (and will finish or roll back), or there is nothing to undo
            if os.getpid() != session.pid:
                return  # a forked child: the registrations are its parent's
            self.state = PoolState.CLOSING
            self._driven = True
        try:
            session.cancel()
            session.wait_idle()  # a driver that died mid-pin may have left workers finishing a call
            pinned = session.ledger.registered_bytes
            # Unpin first: a warning turned into an error must not keep memory pinned.
            drive_inline(self._finalize_steps(session))
        finally:
            self._driven = False
        warnings.warn(
            f"PinnedPool {self.name!r} was never exited; unpinned its {format_bytes(pinned)} in a finalizer. "
            "Use `async with` / `with` so teardown happens where you expect it",
            UnclosedPoolWarning,
            stacklevel=2,
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
