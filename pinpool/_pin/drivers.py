"""The drivers: run a lifecycle's steps with ``async with`` (anyio), ``with``, or inline (the finalizer).

A lifecycle (``_pin/lifecycle.py``) is a generator that yields only the steps that need waiting,
each a :class:`RunThreads`, and takes back a :class:`Ran`. A driver's whole job is to run
those bodies on tracked threads and wait for *every one* of them, whatever arrives meanwhile:

* the first interruption (anyio or trio cancellation, asyncio's own ``Task.cancel()``,
  ``KeyboardInterrupt``, ``SystemExit``, an exception from ``on_tick``) calls the step's
  ``on_interrupt`` (pinning: stop after the current call) and is reported back, with any
  later ones;
* waiting goes on, shielded from anyio cancellation and absorbing native cancellations,
  until every thread is done. The lifecycle re-raises the interruption once its books are
  closed.

A Ctrl-C never lands inside a driver's own book-keeping: each driver runs under
:func:`pinpool._pin.ki.guard` and is :func:`~pinpool._pin.ki.protected`, so a SIGINT is deferred
everywhere except at the safe point, the wait for pinning threads (which stops pinning), and is
replayed there or when the driver is done. An entry that completes with a Ctrl-C deferred is
undone (``undo``: the pool is exited) before the ``KeyboardInterrupt`` is raised: a ``with``
statement whose ``__enter__`` raises never calls ``__exit__``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from typing import TypeVar

import anyio
import anyio.lowlevel

from .ki import guard, protected, replay, safe
from .steps import Detach, Ran, RunThreads, Step
from .threads import PROGRESS_INTERVAL_SECONDS, Threads

# The longest sleep between two looks at the threads while an async driver waits.
ASYNC_POLL_SECONDS = 0.02

T = TypeVar("T")

Lifecycle = Generator[Step, Ran, T]


def _launch(step: RunThreads) -> tuple[Threads, Ran, Callable[[BaseException], None]]:
    """Start the step's threads; returns them, the report, and what to call on an interruption
    (the first one also calls the step's ``on_interrupt``). Both drivers begin a step this way."""
    threads, ran = Threads(), Ran()

    def interrupted(exc: BaseException) -> None:
        ran.interrupts.append(exc)
        if len(ran.interrupts) > 1:
            return
        # A second Ctrl-C can land inside on_interrupt (seen under trio, whose handler raises at
        # once outside its own code): it is recorded like any other, and the stop is asked again
        # (it is idempotent), so the interruption never leaves the driver's wait.
        while True:
            try:
                step.on_interrupt()
                return
            except BaseException as again:
                ran.interrupts.append(again)

    try:
        for i, body in enumerate(step.bodies):
            try:
                threads.start(body, name=f"{step.name}-{i}")
            except Exception as exc:  # e.g. "can't start new thread": fewer workers; none at all is reported
                ran.start_errors.append(exc)
                break
            except BaseException as exc:  # an interrupt inside Thread.start: that thread is accounted for
                interrupted(exc)
                break
    except BaseException as exc:  # an interrupt between two starts
        interrupted(exc)
    finally:
        while True:  # workers wait for this: an interrupt landing inside it must not skip it
            try:
                step.on_started()
                break
            except BaseException as exc:
                interrupted(exc)
    return threads, ran, interrupted


def _finish(step: RunThreads, threads: Threads, ran: Ran) -> Ran:
    ran.crashed = list(threads.errors)
    ran.started = threads.started
    if ran.started == 0 and step.bodies and not step.interruptible:
        # Teardown must happen even when no thread can be had (interpreter shutdown): inline.
        _run_inline_bodies(step, ran)
    return ran


def _run_inline_bodies(step: RunThreads, ran: Ran) -> None:
    for body in step.bodies:
        while True:
            try:
                body()
                break
            except BaseException as exc:  # bodies resume from shared queues: run it again
                ran.interrupts.append(exc)


# -- sync ----------------------------------------------------------------------------------------


def run_sync(step: Step) -> Ran:
    if isinstance(step, Detach):
        return _detach(step)
    threads, ran, interrupted = _launch(step)
    while True:
        try:
            if step.interruptible and not ran.interrupts:
                _wait_interruptibly(threads, step.on_tick)
            else:
                threads.wait()
            break
        except BaseException as exc:
            interrupted(exc)
    return _finish(step, threads, ran)


@safe
def _wait_interruptibly(threads: Threads, on_tick: Callable[[], object] | None) -> None:
    replay()  # a Ctrl-C deferred while the step was launched stops it now
    threads.wait(on_tick=on_tick)


@protected
def drive_sync(lifecycle: Lifecycle[T], undo: Callable[[], Lifecycle[object]] | None = None) -> T:
    """Run a lifecycle on the calling thread. ``undo``: what undoes it if a Ctrl-C was deferred
    until it completed (entry: the exit)."""
    with guard():
        result = _drive(lifecycle, run_sync)
        try:
            replay()
        except BaseException:
            if undo is not None:
                _drive(undo(), run_sync)
            raise
        return result


@protected
def drive_inline(lifecycle: Lifecycle[T]) -> T:
    """Run a lifecycle with no threads at all (the finalizer: at interpreter exit none can be started)."""

    def run(step: Step) -> Ran:
        ran = Ran()
        if isinstance(step, Detach):  # nothing can run beside it: the sequence runs here, to its end
            done = Threads()
            ran.detached = done
            _drive(step.steps, run)
            return ran
        _run_inline_bodies(step, ran)
        return ran

    return _drive(lifecycle, run)


def _drive(lifecycle: Lifecycle[T], run: Callable[[Step], Ran]) -> T:
    try:
        step = next(lifecycle)
        while True:
            step = lifecycle.send(run(step))
    except StopIteration as stop:
        result: T = stop.value
        return result


# -- async (anyio: asyncio and trio) --------------------------------------------------------------


async def run_async(step: Step) -> Ran:
    if isinstance(step, Detach):
        return _detach(step)  # starting a thread does not wait
    threads, ran, interrupted = _launch(step)
    # The wait polls (sleeps of 1 ms growing to ASYNC_POLL_SECONDS) instead of waiting on a
    # worker thread: a thread-pool wait abandoned by a cancellation outlives the event loop when
    # a second Ctrl-C aborts asyncio.run, and anyio's non-daemon worker then hangs interpreter
    # exit (seen: 1 run in ~25 of the real-signal test). Until the first interruption the sleep
    # is not shielded, so a cancellation of the caller lands here while the threads run.
    delay = 0.001
    last_tick = time.monotonic()
    while not threads.done:
        shielded = bool(ran.interrupts) or not step.interruptible
        try:
            if not shielded:
                replay()  # a Ctrl-C deferred while the step was launched stops it now
            with anyio.CancelScope(shield=shielded):
                await anyio.sleep(delay)
            delay = min(delay * 2, ASYNC_POLL_SECONDS)
            if step.on_tick is not None and not shielded and time.monotonic() - last_tick >= PROGRESS_INTERVAL_SECONDS:
                last_tick = time.monotonic()
                step.on_tick()
        except BaseException as exc:  # anyio/trio cancellation, Task.cancel(), Ctrl-C, on_tick
            interrupted(exc)
    if step.interruptible and not ran.interrupts:
        # Quick threads must not let a pending cancellation through: it still counts.
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:
            interrupted(exc)
    return _finish(step, threads, ran)


@protected
async def drive_async(lifecycle: Lifecycle[T], undo: Callable[[], Lifecycle[object]] | None = None) -> T:
    """Run a lifecycle from a task of an anyio event loop (asyncio or trio); ``undo`` as for
    :func:`drive_sync`. While it awaits, a Ctrl-C goes to the loop's own handler (its frames are
    not on the stack then): asyncio.run cancels the main task, trio raises at a checkpoint."""
    with guard():
        result = await _drive_async(lifecycle)
        try:
            replay()  # under asyncio.run this cancels the task instead: the body's first await sees it
        except BaseException:
            if undo is not None:
                await _drive_async(undo())
            raise
        return result


async def _drive_async(lifecycle: Lifecycle[T]) -> T:
    try:
        step = next(lifecycle)
        while True:
            step = lifecycle.send(await run_async(step))
    except StopIteration as stop:
        result: T = stop.value
        return result


# -- detached sequences (a background pool's conductor) --------------------------------------------

# What to call to stop each detached sequence still running when the interpreter starts to exit.
_RUNNING: dict[int, Callable[[], None]] = {}
_running_lock = threading.Lock()
_hooked = False


def _detach(step: Detach) -> Ran:
    """Start ``step.steps`` with the sync driver on a tracked thread. If this is interrupted, or no
    thread can be made, the thread is accounted for all the same (see Threads.start)."""
    global _hooked
    threads, ran = Threads(), Ran()
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
        if not _hooked:
            _hooked = _hook_interpreter_exit()
    try:
        threads.start(body, name=step.name)
        ran.started = 1
    except Exception as exc:  # e.g. "can't start new thread"
        ran.start_errors.append(exc)
    except BaseException as exc:  # an interrupt inside Thread.start: the thread may run or not
        ran.interrupts.append(exc)
    if threads.done:  # it never ran (or already ended): nothing to stop at exit
        with _running_lock:
            _RUNNING.pop(key, None)
    return ran


def _hook_interpreter_exit() -> bool:
    """Before Python waits for non-daemon threads at exit, stop every detached sequence (pinning
    stops after the current calls; what is pinned stays until the pool's finalizer unpins it)."""
    register = getattr(threading, "_register_atexit", None)  # what concurrent.futures uses
    if register is None:
        return True  # without it, exit waits for background pinning to finish, then unpins
    try:
        register(_stop_running)
    except RuntimeError:  # the interpreter is already shutting down
        pass
    return True


def _stop_running() -> None:
    with _running_lock:
        stops = list(_RUNNING.values())
    for stop in stops:
        try:
            stop()
        except Exception:  # one pool's stop must not keep the others pinning
            pass


@protected
def finalize_lifecycle(lifecycle: object) -> None:
    """A pool's finalizer: run its lifecycle's ``finalize`` sequence inline (no threads). A Ctrl-C
    landing in it is deferred until the unpinning is done, then ignored, as Python ignores any
    exception raised in a finalizer (inside a driver, the driver delivers it)."""
    with guard(drop=True):
        drive_inline(lifecycle.finalize())  # type: ignore[attr-defined]
