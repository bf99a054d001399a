"""The drivers: run a lifecycle's steps with ``async with`` (anyio), ``with``, or inline (the finalizer).

A driver runs a step's bodies on tracked threads (:mod:`.threads`) and waits for *every one*, however
often it is interrupted (the first calls ``on_interrupt``; all are reported back to the lifecycle).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from .._errors import PoolStateError
from .gates import DRIVING
from .outcome import Detach, Ran, RunThreads, Step, Steps
from .sigint import _Guard, guard, protected, replay, safe
from .threads import POLL_SECONDS, PROGRESS_INTERVAL_SECONDS, Threads, serving, serving_also

ASYNC_POLL_SECONDS = 0.02  # the longest sleep between two looks at the threads while an async driver waits
TRIES = 5  # a retry loop's tries; an exception that recurs every time (no stack left) is then raised
START_ERRORS = (RuntimeError, MemoryError)  # Thread.start's "no thread"; anything else is an interruption
T = TypeVar("T")
Lifecycle = Generator[Step, Ran, T]


def _holds(step: RunThreads) -> bool:
    """Whether this wait holds Ctrl-C: a teardown (``on_held``), on the main thread, under a guard."""
    return step.on_held is not None and _Guard.depth > 0 and threading.current_thread() is threading.main_thread()


def _held(step: RunThreads, seen: int) -> tuple[int, bool]:
    """``on_held`` hears of each new count of Ctrl-Cs held; the count seen and whether to abandon the wait."""
    held = _Guard.pending
    if step.on_held is None or held <= seen:
        return seen, False
    return held, bool(step.on_held(held))


def _launch(step: RunThreads, serving: frozenset[int]) -> tuple[Threads, Ran, Callable[[BaseException], None]]:
    """Start the step's threads (for the pools ``serving`` names); returns them, the report, and what to call on an
    interruption."""
    threads, ran = Threads(serving), Ran()

    def interrupted(exc: BaseException) -> None:
        first = not ran.interrupts
        _record(ran, exc)
        if first:  # a second Ctrl-C can land inside on_interrupt (trio): the stop is asked again
            _retry(step.on_interrupt, functools.partial(_record, ran))

    try:
        for i, body in enumerate(step.bodies):
            try:
                threads.start(body, name=f"{step.name}-{i}", daemon=step.on_held is not None)
            except START_ERRORS as exc:  # fewer workers; none at all is reported
                ran.start_errors.append(exc)
                break
    except BaseException as exc:  # an interrupt between two starts, or inside one (that thread is accounted for)
        interrupted(exc)
    finally:
        _retry(step.on_started, interrupted)  # workers wait for this: an interrupt landing inside it must not skip it
    return threads, ran, interrupted


def _retry(fn: Callable[[], object], record: Callable[[BaseException], None]) -> None:
    """``fn`` (idempotent) until it returns, each exception to ``record``; the last of TRIES raises."""
    for attempt in range(TRIES):
        try:
            fn()
            return
        except BaseException as exc:
            if attempt == TRIES - 1:
                raise
            record(exc)


def _record(ran: Ran, exc: BaseException) -> None:
    if len(ran.interrupts) < TRIES:  # the first few are enough to report; more would only grow
        ran.interrupts.append(exc)


def _finish(step: RunThreads, threads: Threads, ran: Ran) -> Ran:
    ran.crashed, ran.started = list(threads.errors), threads.started
    if ran.started == 0 and step.bodies and not step.interruptible:  # teardown with no thread to be had
        _run_inline_bodies(step, ran)
    return ran


def _run_inline_bodies(step: RunThreads, ran: Ran) -> None:
    for body in step.bodies:
        _retry(body, functools.partial(_record, ran))  # bodies resume from shared queues: run it again


def run_sync(step: Step, serving: frozenset[int] = frozenset()) -> Ran:
    if isinstance(step, Detach):
        return _detach(step, serving)
    threads, ran, interrupted = _launch(step, serving)
    recurring = _Recurring()
    while True:
        try:
            if step.interruptible and not ran.interrupts:
                _wait_interruptibly(threads, step.on_tick)
            else:
                ran.abandoned = not _wait_holding(step, threads)
            break
        except BaseException as exc:
            recurring.check(exc)
            interrupted(exc)
    return _finish(step, threads, ran)


class _Recurring:
    """Raises an exception that recurs at once, TRIES times in a row (no stack left, no memory)."""

    def __init__(self) -> None:
        self.count, self.last = 0, -1.0

    def check(self, exc: BaseException) -> None:
        if not isinstance(exc, Exception):
            return  # cancellations and Ctrl-Cs are absorbed however many come
        now = time.monotonic()
        self.count = self.count + 1 if now - self.last < POLL_SECONDS else 1
        self.last = now
        if self.count >= TRIES:
            raise exc


def _wait_holding(step: RunThreads, threads: Threads) -> bool:
    """Wait for the threads (Ctrl-C is held: this is protected code); False if ``on_held`` abandoned them."""
    seen, holds = 0, _holds(step)
    while not threads.wait_done(POLL_SECONDS):
        seen, abandon = _held(step, seen) if holds else (0, False)
        if abandon:
            return False
    return True


@safe
def _wait_interruptibly(threads: Threads, on_tick: Callable[[], object] | None) -> None:
    replay()  # a Ctrl-C deferred while the step was launched stops it now
    threads.wait(on_tick=on_tick)


def _serving(owner: object) -> frozenset[int]:
    """The pools a driver's threads serve: ``owner``'s (a pool's lifecycle), and those this thread serves (a
    conductor drives its pool's pinning on a worker thread)."""
    return serving() | ({id(owner)} if owner is not None else set())


@protected
def drive_sync(
    lifecycle: Lifecycle[T], undo: Callable[[], Lifecycle[object]] | None = None, *, owner: object = None
) -> T:
    """Run a lifecycle on the calling thread; ``undo`` undoes it if a Ctrl-C was deferred until it completed;
    ``owner``: the pool's lifecycle, whose close() on one of these threads must not wait for them."""
    run = functools.partial(run_sync, serving=_serving(owner))
    with guard():
        result = _drive(lifecycle, run)
        try:
            replay()
        except BaseException:
            if undo is not None:
                _drive(undo(), run)
            raise
        return result


@protected
def drive_inline(lifecycle: Lifecycle[T]) -> T:
    """Run a lifecycle with no threads at all (the finalizer: at interpreter exit none can be started)."""

    def run(step: Step) -> Ran:
        ran = Ran()
        if isinstance(step, Detach):  # nothing can run beside it: the sequence runs here, to its end
            ran.detached = Threads()
            _drive(step.steps, run)
            return ran
        _run_inline_bodies(step, ran)
        return ran

    return _drive(lifecycle, run)


def _drive(lifecycle: Lifecycle[T], run: Callable[[Step], Ran]) -> T:
    """Run ``lifecycle``'s steps; what running one raises is thrown in, and one left early is closed."""
    try:
        step = next(lifecycle)
        while True:
            try:
                ran = run(step)
            except BaseException as exc:
                step = lifecycle.throw(exc)
            else:
                step = lifecycle.send(ran)
    except StopIteration as stop:
        result: T = stop.value
        return result
    finally:
        lifecycle.close()


async def run_async(step: Step, drive: _AsyncDrive | None = None) -> Ran:
    serving = frozenset() if drive is None else drive.serving
    if isinstance(step, Detach):
        return _detach(step, serving)  # starting a thread does not wait
    threads, ran, interrupted = _launch(step, serving)
    parked = (step, threads, ran, interrupted)
    # It polls rather than wait on an anyio worker thread: one abandoned when a second Ctrl-C aborts
    # asyncio.run would hang exit. A teardown (on_held) holds every Ctrl-C meanwhile, even in the loop.
    holding = _holds(step) and (drive is None or not drive.abandonable())
    delay = 0.001
    last_tick = time.monotonic()
    seen, recurring = 0, _Recurring()
    if holding:
        _Guard.holding += 1
    try:
        while not threads.done:
            shielded = bool(ran.interrupts) or not step.interruptible
            try:
                if not shielded:
                    replay()  # a Ctrl-C deferred while the step was launched stops it now
                await _outside(drive, parked, _sleep, delay, shielded, keep_guard=holding)
                delay = min(delay * 2, ASYNC_POLL_SECONDS)
                tick = None if shielded else step.on_tick
                if tick is not None and time.monotonic() - last_tick >= PROGRESS_INTERVAL_SECONDS:
                    last_tick = time.monotonic()
                    tick()
                seen, abandon = _held(step, seen) if holding else (0, False)
                if abandon:
                    ran.abandoned = True
                    break
            except _Abandoned:
                raise
            except BaseException as exc:  # anyio/trio cancellation, Task.cancel(), Ctrl-C, on_tick
                recurring.check(exc)
                interrupted(exc)
    finally:
        if holding:
            _Guard.holding = max(0, _Guard.holding - 1)
    if step.interruptible and not ran.interrupts:
        # Quick threads must not let a pending cancellation through: it still counts.
        try:
            await _outside(drive, parked, anyio.lowlevel.checkpoint_if_cancelled)
        except _Abandoned:
            raise
        except BaseException as exc:
            interrupted(exc)
    return _finish(step, threads, ran)


async def _sleep(seconds: float, shielded: bool) -> None:
    with anyio.CancelScope(shield=shielded):
        await anyio.sleep(seconds)


async def _outside(
    drive: _AsyncDrive | None, parked: _Parked, fn: Callable[..., Any], *args: object, keep_guard: bool = False
) -> None:
    """Await ``fn(*args)`` with the drive parked (:class:`_AsyncDrive`) and, unless ``keep_guard``, its guard left."""
    if drive is None:  # a step run on its own (tests)
        await fn(*args)
        return
    if not keep_guard:
        drive.guard.pause()
    drive.slot["parked"] = parked  # one store: a closer may pop it once the loop is closed
    try:
        await fn(*args)
    finally:
        if drive.slot.pop("parked", None) is None:
            raise _Abandoned  # taken over: unwind without touching the lifecycle
        if not keep_guard:
            drive.guard.resume()


class _Abandoned(GeneratorExit):
    """Raised where an async driver resumes after a closer took its lifecycle over."""


_Parked = tuple[RunThreads, Threads, Ran, Callable[[BaseException], None]]


class _AsyncDrive:
    """A lifecycle driven from an anyio task, parked while it awaits: if its asyncio loop is closed
    meanwhile, a closer (or the finalizer) may finish it (:meth:`take_over`). Driver and closer each
    pop the parked step, one C-level call: exactly one of them goes on."""

    def __init__(self, lifecycle: Lifecycle[Any], held: guard, serving: frozenset[int] = frozenset()) -> None:
        self.lifecycle, self.guard, self.serving = lifecycle, held, serving
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # trio: its run never ends with a task still waiting
            self.loop = None
        self.slot: dict[str, _Parked] = {}

    def step(self, resume: Callable[[T], Step], value: T) -> Step:
        """``resume(value)`` (the lifecycle's ``send`` or ``throw``), this drive known to its gate."""
        token = DRIVING.set(self)  # read by the gate this lifecycle takes (gates.Driver)
        try:
            return resume(value)
        finally:
            DRIVING.reset(token)

    def abandonable(self) -> bool:
        """Whether its loop can be closed under it: one run by hand, not asyncio.run's nor trio.run's."""
        previous = _Guard.previous
        runner = getattr(getattr(previous, "func", None), "__self__", None)
        return self.loop is not None and not isinstance(runner, asyncio.Runner)

    def stopped(self) -> bool:
        """Parked in an await of a closed loop: it will never drive again."""
        return self.loop is not None and self.loop.is_closed() and "parked" in self.slot

    def take_over(self) -> Steps[None] | None:
        """The rest of the lifecycle, to be run by the caller's driver, if this drive :meth:`stopped`."""
        parked = self.slot.pop("parked", None) if self.stopped() else None
        return None if parked is None else self._continue(*parked)

    def _continue(
        self, step: RunThreads, threads: Threads, ran: Ran, interrupted: Callable[[BaseException], None]
    ) -> Steps[None]:
        interrupted(PoolStateError("the task driving it stopped: its event loop was closed while it awaited"))
        seen = list((yield RunThreads(bodies=(threads.join,), name=f"{step.name}-takeover")).interrupts)
        try:
            next_step = self.lifecycle.send(_finish(step, threads, ran))
            while True:
                got = yield next_step
                seen += got.interrupts
                next_step = self.lifecycle.send(got)
        except BaseException:  # how the abandoned entry or exit ended: nobody is left to hand it to
            pass
        if seen:  # the caller's own interruptions meanwhile
            raise seen[0]


@protected
async def drive_async(
    lifecycle: Lifecycle[T], undo: Callable[[], Lifecycle[object]] | None = None, *, owner: object = None
) -> T:
    """Run a lifecycle from an anyio task; ``undo`` and ``owner`` as for :func:`drive_sync`; the guard is held
    between awaits."""
    serving = _serving(owner)
    with guard() as held:
        result: T = await _drive_async(_AsyncDrive(lifecycle, held, serving))
        try:
            replay()  # under asyncio.run this cancels the task instead: the body's first await sees it
        except BaseException:
            if undo is not None:
                await _drive_async(_AsyncDrive(undo(), held, serving))
            raise
        return result


async def _drive_async(drive: _AsyncDrive) -> Any:
    """As :func:`_drive`, from an anyio task (a drive taken over by a closer is left to it)."""
    taken = False
    lifecycle = drive.lifecycle
    try:
        step = drive.step(next, lifecycle)
        while True:
            try:
                ran = await run_async(step, drive)
            except _Abandoned:
                taken = True
                raise
            except BaseException as exc:
                step = drive.step(lifecycle.throw, exc)
            else:
                step = drive.step(lifecycle.send, ran)
    except StopIteration as stop:
        return stop.value
    finally:
        if not taken:
            lifecycle.close()


_RUNNING: dict[int, Callable[[], None]] = {}  # the stop of each detached sequence running
_running_lock = threading.Lock()
_hooked = False


def _detach(step: Detach, serving: frozenset[int]) -> Ran:
    """Start ``step.steps`` with the sync driver on a tracked thread (accounted for even if interrupted)."""
    global _hooked
    threads, ran = Threads(serving), Ran()
    ran.detached = threads
    key = id(threads)

    def body() -> None:
        try:
            drive_sync(step.steps)
        finally:
            with _running_lock:
                _RUNNING.pop(key, None)

    with _running_lock:
        _RUNNING[key] = step.stop
        # Stop pinning before exit waits for non-daemon threads (else it waits for the whole pool to pin).
        register = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses
        if not _hooked and register is not None:
            with contextlib.suppress(RuntimeError):  # the interpreter is already shutting down
                register(_stop_running)
        _hooked = True
    try:
        threads.start(body, name=step.name)
        ran.started = 1
    except START_ERRORS as exc:
        ran.start_errors.append(exc)
    except BaseException as exc:  # an interrupt inside Thread.start: the thread may run or not
        ran.interrupts.append(exc)
    if threads.done:  # it never ran (or already ended): nothing to stop at exit
        with _running_lock:
            _RUNNING.pop(key, None)
    return ran


def _stop_running() -> None:
    with _running_lock:
        stops = list(_RUNNING.values())
    for stop in stops:
        try:
            stop()
        except Exception:  # one pool's stop must not keep the others pinning
            pass


def _forget_in_child() -> None:
    """A forked child has none of the parent's conductors (their stops could wait on a lock held at the fork)."""
    global _running_lock
    _RUNNING.clear()
    _running_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


@protected
def finalize_lifecycle(lifecycle: object) -> None:
    """A pool's finalizer: ``finalize`` inline; a Ctrl-C meanwhile is dropped (a finalizer's raise is ignored)."""
    with guard(drop=True), serving_also(lifecycle):
        drive_inline(lifecycle.finalize())  # type: ignore[attr-defined]
