"""A pool's life, written once: pin → (body) → teardown, or pin → rollback.

:class:`Lifecycle` imports no driver: it yields to one the steps that wait or need a thread, so every
rule (docs/concepts.md, Cancellation) holds for every driver.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ChunkFailure, MemoryGoneError, NodeWaitCancelled, PoolStateError, UnpinError
from .._node.pacing import NodeAdmission
from .._observe import Observer
from .._ranges import PINNED_RANGES
from .._units import format_bytes
from .engine import Memory, PinSession
from .flag import Flag
from .gates import CloseGate, PoolAdmission
from .ledger import Phase, StopCause
from .outcome import (
    Detach,
    Joinable,
    Outcome,
    PoolState,
    Ran,
    RunThreads,
    Steps,
    check_move,
    closed_during_open,
    covered_bytes,
    decide,
    deliver_exit,
    kept_text,
    pin_error,
    thread_start_error,
    unpin_error,
    warn_unclosed,
)
from .teardown import tear_down

if TYPE_CHECKING:
    from .._plan.options import PoolOptions
    from .._plan.plan import Schedule
    from .._types import Capabilities
    from ..registrars import TransferRegistrar
    from ..runtimes import Runtime
    from .elastic import Elastic
    from .memory_source import PoolMemory

ProgressCallback = Callable[[int, int, int, int], object]


class PolicyLoop(Protocol):
    """An elastic pool's policy loop (pinpool._pool.follow), stopped before the teardown: ``stop()`` at once
    from any thread, saying whether ``join()`` must then wait for its thread (not when it is this one)."""

    def stop(self) -> bool: ...

    def join(self) -> None: ...


class Lifecycle:
    """One pool's state and its pin / rollback / teardown sequence; no reference to the façade (the
    finalizer runs it after the façade is gone). In the background a :class:`Detach`-ed conductor pins."""

    def __init__(
        self, plan: Schedule, options: PoolOptions, *, runtime: Runtime, caps: Capabilities, observer: Observer,
        source: PoolMemory, admission: NodeAdmission | None = None, on_progress: ProgressCallback | None = None,
        created_at: tuple[str, int] = ("<unknown>", 0), registrars: Sequence[TransferRegistrar] = (),
        elastic: Elastic | None = None,
    ) -> None:  # fmt: skip
        self.plan, self.options, self.runtime, self.caps = plan, options, runtime, caps
        self.registrars = registrars
        self.elastic = elastic  # an elastic pool's segments above the floor (``plan``): torn down before it
        self.policy_loop: PolicyLoop | None = None  # stopped and joined before any segment is torn down
        self.observer, self.source, self.on_progress = observer, source, on_progress
        self.name, self.nbytes, self.background = options.name, plan.nbytes, options.background
        self.describe = (
            f"pool {self.name!r} ({format_bytes(plan.nbytes)}, {len(plan.chunks)} chunks of "
            f"<= {format_bytes(plan.chunk_bytes)}, runtime {runtime.name}"
            + "".join(f", registrar {registrar.name}" for registrar in registrars)
            + ")"
        )
        self.created_at = created_at  # where the user made the pool: where warnings point
        self.state = PoolState.NEW
        self.session: PinSession | None = None
        self.memory: Memory | None = None
        self.tensors: Mapping[str, Any] | None = None
        self.error: BaseException | None = None  # why background pinning ended early (state FAILED)
        self._error_seen = False  # a waiter (or pool.error) has handed it to the user
        self._lock = threading.RLock()
        self._closed = Flag()  # set once CLOSED: an exit waits for the finalizer's teardown
        self.gate = CloseGate()  # one caller at a time enters or closes; close() from anywhere
        self._pid: int | None = None  # the process that entered (a forked child lets go instead)
        self._driven = False  # a driver is running enter() or exit(): the finalizer keeps off
        self._handed_out = False  # the body was given the pool (ready, or background entered)
        self._conductor: Joinable | None = None  # background: the thread finishing the pinning step
        self._conducting = False  # background: the conductor has not yet decided how pinning ended
        self._orphaned = False  # background: the façade was collected while pinning; the conductor cleans up
        self.pacing = PoolAdmission(
            admission, name=self.name, nbytes=self.nbytes, describe=self.describe, observer=observer
        )

    def _move(self, to: PoolState) -> None:
        """The only place ``state`` changes."""
        with self._lock:
            check_move(self.state, to)
            self.state = to
            if to is PoolState.CLOSED:
                self._closed.set()

    def enter(self) -> Steps[None]:
        yield from self.gate.enter(self.name, self.describe, self._enter_gated, self.exit)

    def _enter_gated(self) -> Steps[None]:
        mine = False  # set with _driven, inside the try: whatever is raised lets go of the pool
        try:
            with self._lock:
                if self.state is not PoolState.NEW:
                    raise PoolStateError(
                        f"pool {self.name!r} is {self.state.value}: a PinnedPool is entered once; "
                        "create a new PinnedPool to pin again"
                    )
                self._move(PoolState.PINNING)
                mine = self._driven = True
                self._pid = os.getpid()
            yield from self._enter()
        finally:
            if mine:
                self._driven = False

    def _enter(self) -> Steps[None]:
        memory: Memory | None = None
        try:
            if not self.background:
                yield from self.pacing.admit()
            memory = self.source.acquire()
            session = self._open_session(memory)
        except BaseException:
            if memory is not None:
                PINNED_RANGES.pop(memory.address)
            self._close_empty()
            raise
        self.memory, self.session = memory, session
        pinning = RunThreads(
            bodies=session.worker_bodies(), name=f"pinpool-{self.name}", interruptible=True,
            on_interrupt=session.cancel, on_tick=self._tick, on_started=session.go,
        )  # fmt: skip
        if self.background:
            yield from self._enter_background(session, pinning)
            return
        ran = yield pinning
        self.pacing.release_slot()  # another rank may start while this one opens or rolls back
        outcome, error = self._end_pinning(session, ran)
        if outcome is Outcome.READY:
            self._handed_out = True
            return
        _, interrupts = yield from self._unpin_all(session)
        if outcome is Outcome.FAILED:
            failed = self._failure(session, ran, kept=None)
            if interrupts:  # an interruption during the rollback still propagates: it was asked for
                interrupts[0].add_note(f"pinpool: {failed}")
                raise interrupts[0]
            raise failed
        assert error is not None  # INTERRUPTED (EXITED and ORPHANED are background outcomes)
        raise error

    def _open_session(self, memory: Memory) -> PinSession:
        plan = self.plan
        session = PinSession(
            plan, self.options, runtime=self.runtime, caps=self.caps, observer=self.observer, memory=memory,
            registrars=self.registrars,
        )  # fmt: skip
        self.observer.pin_started(
            nbytes=plan.nbytes, chunks=len(plan.chunks), chunk_bytes=plan.chunk_bytes, granularity=plan.granularity,
            order=plan.order.value, register_workers=plan.register_workers, populate_workers=plan.populate_workers,
            pin_nice=self.options.pin_nice, max_call_seconds=self.options.max_call_seconds,
            budget_yields_to=self.options.budget_yields_to, cpu_budget=plan.cpu_budget, cpu_quota=plan.cpu_quota,
            duty_cycle=plan.duty_cycle,
        )  # fmt: skip
        return session

    def _close_empty(self) -> None:
        """Entry failed before anything was pinned (admission, mapping, or the session)."""
        self.pacing.release_slot()
        self.pacing.release_budget()
        self.memory = None
        self.source.release()
        self._move(PoolState.CLOSED)

    def _end_pinning(self, session: PinSession, ran: Ran) -> tuple[Outcome, BaseException | None]:
        """Every pinning thread is done: the outcome (the pool opened if ready), and the interruption to raise."""
        crashed = bool(ran.crashed) or ran.started == 0
        if crashed:
            session.stop(StopCause.FAILURE)
        phase = session.finish_pinning()
        interruption = ran.interrupts[0] if ran.interrupts else None
        pinned = phase is Phase.PINNED and interruption is None
        if pinned:
            try:
                self._tick()  # the final 100%; raising from it stops like an interruption
                self.observer.pinned(nbytes=self.nbytes, chunks=len(session.ledger.chunks), seconds=session.pin_seconds)
                assert self.memory is not None
                if self.tensors is None:
                    self.tensors = self.source.views(self.memory)
            except BaseException as exc:
                interruption = exc
        with self._lock:
            if interruption is None and not self.background and self.gate.close_requested:
                interruption = closed_during_open(self.describe)  # rolled back and raised, as an interruption is
            outcome = decide(
                interrupted=interruption is not None,
                pinned=pinned,
                stop_cause=None if crashed else session.ledger.stop_cause,
                orphaned=self._orphaned,
            )
            if outcome is Outcome.READY:
                self._move(PoolState.READY)
                return outcome, None
        kept = session.ledger.pinned_bytes if self.background and outcome is not Outcome.ORPHANED else 0
        self.observer.rollback(cause=outcome.cause, registered_chunks=session.ledger.chunks_done, kept_bytes=kept)
        return outcome, interruption

    def _failure(self, session: PinSession, ran: Ran, kept: str | None, gone: str | None = None) -> BaseException:
        ledger = session.ledger
        causes = ran.crashed or ran.start_errors
        return pin_error(
            describe=self.describe, nbytes=self.nbytes, chunk_limit=self.plan.chunk_limit,
            failures=ledger.failures_in("populate", "register"), leaked=session.leaked(), retries=session.retries,
            cause=causes[0] if causes else None, crashed=bool(ran.crashed), kept=kept, gone=gone,
        )  # fmt: skip

    def _enter_background(self, session: PinSession, pinning: RunThreads) -> Steps[None]:
        assert self.memory is not None
        try:
            self.tensors = self.source.views(self.memory)  # pages [0, pinned_pages) are usable at once
        except BaseException:
            session.stop(StopCause.CANCELLED)
            yield from self._unpin_all(session)
            raise
        self._conducting = True
        ran = yield Detach(
            steps=self._conduct(session, pinning), name=f"pinpool-{self.name}-pin",
            stop=functools.partial(self._stop, session, StopCause.EXIT),
        )  # fmt: skip
        self._conductor = ran.detached
        problems = ran.interrupts or ran.start_errors
        if not problems:
            self._handed_out = True
            return
        # The conductor could not start, or an interrupt landed in Thread.start: stop it, undo what it pinned.
        first = problems[0]
        yield from self._stop_conductor(session, StopCause.CANCELLED)
        with self._lock:
            self._conducting = False
        yield from self._unpin_all(session)
        if isinstance(first, Exception):
            raise thread_start_error(self.describe, first)
        raise first

    def _conduct(self, session: PinSession, pinning: RunThreads) -> Steps[None]:
        try:
            yield from self.pacing.admit()
        except BaseException as exc:  # fail-fast pacing (NodeBusyError), no thread for the wait, or
            # NodeWaitCancelled: stopped by exit, collection or interpreter exit (nothing was pinned)
            cancelled = isinstance(exc, NodeWaitCancelled)
            error, ran = (None if cancelled else exc), Ran()
            stop_cause = session.ledger.stop_cause if cancelled else None  # None: FAILED
            outcome = decide(interrupted=False, pinned=False, stop_cause=stop_cause, orphaned=self._orphaned)
            self.observer.rollback(cause=outcome.cause, registered_chunks=0)
        else:
            ran = yield pinning
            self.pacing.release_slot()
            outcome, error = self._end_pinning(session, ran)
        yield from self._deliver_in_background(session, outcome, error, ran)

    def _deliver_in_background(
        self, session: PinSession, outcome: Outcome, error: BaseException | None, ran: Ran
    ) -> Steps[None]:
        """Nothing is unpinned under the body: only a pool nobody can exit (orphaned) is torn down here."""
        if outcome is Outcome.FAILED and error is None:
            # From the books at rest: the text and pool.pinned_pages / registrations say the same.
            pages, pinned = session.prefix.pages, session.ledger.pinned_bytes
            maybe = sum(chunk.nbytes for chunk in session.ledger.maybe)
            kept = kept_text(pages, self.plan.num_pages, pinned, session.registrations(), maybe)
            error = self._failure(session, ran, kept=kept, gone=self.source.gone(self.memory))  # gone: SIGBUS to touch
        mine = False  # set with _driven, inside the try: whatever is raised lets go of the pool
        try:
            with self._lock:  # decided under the lock the finalizer decides under: one of them cleans up
                self._conducting = False
                if outcome is Outcome.READY or (error is None and not self._orphaned):
                    return  # READY; EXITED, or stopped by the thread that entered: the stopper tears down
                if self._orphaned:
                    mine = self._driven = True  # a close() meanwhile waits for it
                else:  # FAILED, or INTERRUPTED by on_progress: kept until exit, told to the waiters
                    self.error = error  # before the state says FAILED: a waiter reads the state, then the error
                    self._move(PoolState.FAILED)
            if mine:
                yield from self._unpin_everything(session)
            elif error is not None:
                self.observer.failed_in_background(error)
        finally:
            if mine:
                self._driven = False

    def _stop(self, session: PinSession, cause: StopCause) -> None:
        """Stop pinning after the current calls, and a node-pacing wait."""
        self.pacing.cancel.set()
        session.stop(cause)

    def _stop_conductor(self, session: PinSession, cause: StopCause) -> Generator[RunThreads, Ran, list[BaseException]]:
        """Stop background pinning and wait until the conductor is done."""
        conductor = self._conductor
        if conductor is None or conductor.done:
            return []
        self._stop(session, cause)
        ran = yield RunThreads(bodies=(conductor.join,), name=f"pinpool-{self.name}-join")
        return ran.interrupts

    def exit(
        self, body_error: BaseException | None, *, closing: bool = False, raise_errors: bool = True
    ) -> Steps[BaseException | None]:
        """Leave the pool (idempotent, from any thread); ``closing``: ``pool.close()``; ``raise_errors=False``:
        an unseen error is returned, not raised."""
        if self._pid is not None and os.getpid() != self._pid:
            self._let_go_in_child()  # takes no lock: one may have been held by a thread at fork
            return None
        leave = functools.partial(self._leave, body_error, closing, raise_errors)
        return (yield from self.gate.close(self.name, leave, closing=closing, stop_entry=self.pacing.cancel.set))

    def _leave(
        self, body_error: BaseException | None, closing: bool, raise_errors: bool
    ) -> Steps[BaseException | None]:
        mine = False  # set with _driven, inside the try: whatever is raised lets go of the pool
        try:
            while not mine:
                with self._lock:
                    state = self.state
                    if state is PoolState.CLOSED:
                        return None
                    if state is PoolState.NEW:
                        if not closing:
                            raise PoolStateError(
                                f"pool {self.name!r} is new: it can be exited only after it was entered"
                            )
                        self.source.release()
                        self._move(PoolState.CLOSED)
                        return None
                    if not self._driven:  # CLOSING too: a teardown something raised in resumes here
                        mine = self._driven = True
                        continue
                # The finalizer (or an orphan's conductor) tears it down: wait until it is closed, or lets go.
                ran = yield RunThreads(bodies=(self._wait_undriven,), name=f"pinpool-{self.name}-close")
                if ran.interrupts:
                    raise ran.interrupts[0]
            session = self.session
            if session is None:  # an entry interrupted before its session existed, and its cleanup too
                self._close_empty()
                return None
            interrupts: list[BaseException] = []
            loop = self.policy_loop
            if loop is not None and loop.stop():  # it grows and shrinks the segments: ended before they go
                interrupts += (yield RunThreads(bodies=(loop.join,), name=f"pinpool-{self.name}-elastic")).interrupts
            if self.background:
                interrupts += yield from self._stop_conductor(session, StopCause.EXIT)
            failed = self.take_error(unseen=True) if self.state is PoolState.FAILED else None
            unpinned, more = yield from self._unpin_everything(session)
            interrupts += more
            return deliver_exit(body_error, failed, unpinned, interrupts, raise_errors)
        finally:
            if mine:
                self._driven = False

    def _wait_undriven(self) -> None:
        while not self._closed.wait(0.05) and self._driven:
            pass

    def _let_go_in_child(self) -> None:
        """A forked child drops its copy of the parent's pool (its book of pinned ranges started empty)."""
        session = self.session
        if session is not None:
            session.ledger.stop_cause = session.ledger.stop_cause or StopCause.EXIT
        self.memory = self.tensors = None
        if self.elastic is not None:
            self.elastic.let_go_in_child()
        self.source.release()
        if self.state is not PoolState.CLOSED:
            check_move(self.state, PoolState.CLOSED)  # as _move does, without its lock
            self.state = PoolState.CLOSED
            self._closed.set()

    def take_error(self, *, unseen: bool = False) -> BaseException | None:
        """The background failure for a waiter that raises it, marked seen (exit then does not raise it);
        ``unseen``: only if none has. ``pool.error`` reads, never takes."""
        error = None if unseen and self._error_seen else self.error
        if error is not None:
            self._error_seen = True
        return error

    @property
    def pinned_pages(self) -> int:
        """Pages ``[0, k)`` pinned now in every buffer (an elastic pool: usable, the floor then its segments)."""
        floor = self._floor_pages()
        return floor if self.elastic is None else self.elastic.pinned_pages(floor)

    def _floor_pages(self) -> int:
        state = self.state
        if state is PoolState.READY:
            return self.plan.num_pages
        session = self.session
        gone = state is PoolState.FAILED and isinstance(self.error, MemoryGoneError)  # SIGBUS to touch
        if state not in (PoolState.PINNING, PoolState.FAILED) or session is None or gone:
            return 0
        return session.prefix.pages

    def reached(self, pages: int | None) -> bool:
        """Whether the pool is ready (``pages`` None) or has its first ``pages`` pinned; raises if it never will."""
        state = self.state
        if state is PoolState.READY:
            return pages is None or self.elastic is None or self.pinned_pages >= pages
        if state is PoolState.PINNING:
            return pages is not None and self.pinned_pages >= pages
        error = self.take_error() if state is PoolState.FAILED else None
        if error is not None:
            raise error
        if state is PoolState.NEW:
            raise PoolStateError(f"pool {self.name!r} is new: enter it (async with / with) before waiting for it")
        raise PoolStateError(f"pool {self.name!r} is {state.value}: it was exited before it was ready")

    def _unpin_everything(
        self, session: PinSession, *, join: bool = True
    ) -> Generator[RunThreads, Ran, tuple[UnpinError | None, list[BaseException]]]:
        """An elastic pool's segments (highest first), then the floor's session: :meth:`_unpin_all`."""
        if self.elastic is None:
            return (yield from self._unpin_all(session, join=join))
        segments, interrupts = yield from self.elastic.teardown(join=join)
        unpinned, more = yield from self._unpin_all(session, join=join)
        if unpinned is None or segments is None:
            return unpinned or segments, interrupts + more
        unpinned.add_note(f"pinpool: {segments}")
        return unpinned, interrupts + more

    def _unpin_all(
        self, session: PinSession, *, join: bool = True
    ) -> Generator[RunThreads, Ran, tuple[UnpinError | None, list[BaseException]]]:
        """Teardown or rollback, then :meth:`_close`: its UnpinError and the interruptions. What is raised
        meanwhile resumes it, TEARDOWN_TRIES times, then is raised with the pool CLOSING."""
        if self.state is not PoolState.CLOSING:
            self._move(PoolState.CLOSING)
        return (yield from tear_down(
            session, self.observer, f"pinpool-{self.name}-unpin", functools.partial(self._close, session), join=join
        ))  # fmt: skip

    def _close(self, session: PinSession, failures: tuple[ChunkFailure, ...]) -> UnpinError | None:
        """Close the books and let the memory go, unless a chunk leaked; the UnpinError of a handed-out pool."""
        memory, handed_out = self.memory, self._handed_out
        leaked = session.leaked() + (self.elastic.leaked_chunks if self.elastic is not None else ())
        if memory is not None:  # None: a first try got this far (each step below may be taken twice)
            self.observer.unpinned(
                nbytes=self.nbytes, seconds=session.unpin_seconds, failures=len(failures),
                leaked_bytes=covered_bytes(leaked), pinned=handed_out,
            )  # fmt: skip
            if leaked:
                memory.keep_forever()  # its bytes may still be pinned: the budget share stays counted too
            else:
                PINNED_RANGES.pop(memory.address)
            self.pacing.release_budget(keep=bool(leaked))
            self.tensors = self.memory = None
        del memory
        self.source.release()  # after this the pool holds nothing of the caller's
        if self.state is not PoolState.CLOSED:
            self._move(PoolState.CLOSED)
        if not failures or not handed_out:
            return None
        return unpin_error(self.name, failures, leaked)

    def _tick(self) -> None:
        """About every 0.1 s while pinning: on_progress; a close() stops an entry."""
        session = self.session
        if self.gate.close_requested and not self.background and session is not None:
            session.stop(StopCause.CANCELLED)
        if self.on_progress is not None and session is not None:
            ledger = session.ledger
            self.on_progress(ledger.pinned_bytes, self.nbytes, ledger.chunks_done, len(ledger.chunks))

    def finalize(self) -> Steps[None]:
        """The façade was collected (or is alive at interpreter exit) without being exited; run inline."""
        if self._pid is None:
            return  # never entered: nothing to undo
        if os.getpid() != self._pid:
            self._let_go_in_child()  # a forked child: the registrations are its parent's
            return
        if (yield from self.gate.take_over()):  # its async driver stopped half-way: finished here
            warn_unclosed(self.name, self.created_at, "was left half-entered or half-exited by a task whose event "
                          "loop was closed; its finalizer finished that")  # fmt: skip
        mine = False  # set with _driven, inside the try: whatever is raised lets go of the pool
        try:
            with self._lock:
                session = self.session
                state = self.state
                if self._driven or session is None or state in (PoolState.NEW, PoolState.CLOSED):
                    return  # a driver owns it (and will finish or roll back), or there is nothing to undo
                orphaned = state is PoolState.PINNING and self._conducting
                if orphaned:  # its conductor undoes it (a wait here could run on the conductor's thread)
                    self._orphaned = True
                else:
                    if state is not PoolState.CLOSING:  # CLOSING: a teardown something raised in, resumed here
                        self._move(PoolState.CLOSING)
                    mine = self._driven = True
            if orphaned:
                self._stop(session, StopCause.COLLECTED)
                warn_unclosed(self.name, self.created_at, "is unpinning what it pinned in the background")
                return
            unseen = self.take_error(unseen=True) if state is PoolState.FAILED else None
            session.stop(StopCause.COLLECTED)
            session.wait_idle()  # a driver that died mid-pin may have left workers finishing a call
            pinned = session.ledger.pinned_bytes
            if self.elastic is not None:
                pinned += sum(segment.ledger.pinned_bytes for _index, segment in self.elastic.live_sessions())
            yield from self._unpin_everything(session, join=False)  # before warning: -W error must not keep it pinned
        finally:
            if mine:
                self._driven = False
        if unseen is not None:
            warn_unclosed(
                self.name, self.created_at, f"had failed to pin in the background, and nobody saw why: {unseen}"
            )
        warn_unclosed(self.name, self.created_at, f"unpinned its {format_bytes(pinned)} in a finalizer")
