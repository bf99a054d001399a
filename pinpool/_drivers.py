"""The drivers: run a lifecycle's steps with ``async with`` (anyio), ``with``, or inline (the finalizer).

A lifecycle (``_lifecycle.py``) is a generator that yields only the steps that need waiting,
each a :class:`RunThreads`, and takes back a :class:`Ran`. A driver's whole job is to run
those bodies on tracked threads and wait for *every one* of them, whatever arrives meanwhile:

* the first interruption (anyio or trio cancellation, asyncio's own ``Task.cancel()``,
  ``KeyboardInterrupt``, ``SystemExit``, an exception from ``on_tick``) calls the step's
  ``on_interrupt`` (pinning: stop after the current call) and is reported back, with any
  later ones;
* waiting goes on, shielded from anyio cancellation and absorbing native cancellations,
  until every thread is done. The lifecycle re-raises the interruption once its books are
  closed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import anyio.lowlevel

from ._threads import PROGRESS_INTERVAL_SECONDS, Threads

# The longest sleep between two looks at the threads while an async driver waits.
ASYNC_POLL_SECONDS = 0.02

T = TypeVar("T")


@dataclass(frozen=True)
class RunThreads:
    """Run each body on its own thread and wait for all of them.

    ``interruptible``: an interruption is expected to stop the work early (``on_interrupt``)
    and, under anyio, cancellation of the caller is noticed while the threads run; otherwise
    (teardown) the wait is shielded from the start. ``on_tick`` runs on the waiting thread
    about every PROGRESS_INTERVAL_SECONDS while the threads run.
    """

    bodies: tuple[Callable[[], None], ...]
    name: str
    interruptible: bool = False
    on_interrupt: Callable[[], None] = lambda: None
    on_tick: Callable[[], None] | None = None
    on_started: Callable[[], None] = lambda: None  # every thread is started (or no more will be)


@dataclass
class Ran:
    """What happened while a step ran: interruptions that arrived (first first), bodies that raised,
    and errors from starting threads (e.g. the host is out of threads)."""

    interrupts: list[BaseException] = field(default_factory=list)
    crashed: list[BaseException] = field(default_factory=list)
    start_errors: list[BaseException] = field(default_factory=list)
    started: int = 0


Lifecycle = Generator[RunThreads, Ran, T]


def _launch(step: RunThreads) -> tuple[Threads, Ran, Callable[[BaseException], None]]:
    """Start the step's threads; returns them, the report, and what to call on an interruption
    (the first one also calls the step's ``on_interrupt``). Both drivers begin a step this way."""
    threads, ran = Threads(), Ran()

    def interrupted(exc: BaseException) -> None:
        ran.interrupts.append(exc)
        if len(ran.interrupts) == 1:
            step.on_interrupt()

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


def run_sync(step: RunThreads) -> Ran:
    threads, ran, interrupted = _launch(step)
    while True:
        try:
            threads.wait(on_tick=step.on_tick if step.interruptible and not ran.interrupts else None)
            break
        except BaseException as exc:
            interrupted(exc)
    return _finish(step, threads, ran)


def drive_sync(lifecycle: Lifecycle[T]) -> T:
    """Run a lifecycle on the calling thread."""
    return _drive(lifecycle, run_sync)


def drive_inline(lifecycle: Lifecycle[T]) -> T:
    """Run a lifecycle with no threads at all (the finalizer: at interpreter exit none can be started)."""

    def run(step: RunThreads) -> Ran:
        ran = Ran()
        _run_inline_bodies(step, ran)
        return ran

    return _drive(lifecycle, run)


def _drive(lifecycle: Lifecycle[T], run: Callable[[RunThreads], Ran]) -> T:
    try:
        step = next(lifecycle)
        while True:
            step = lifecycle.send(run(step))
    except StopIteration as stop:
        result: T = stop.value
        return result


# -- async (anyio: asyncio and trio) --------------------------------------------------------------


async def run_async(step: RunThreads) -> Ran:
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


async def drive_async(lifecycle: Lifecycle[T]) -> T:
    """Run a lifecycle from a task of an anyio event loop (asyncio or trio)."""
    try:
        step = next(lifecycle)
        while True:
            step = lifecycle.send(await run_async(step))
    except StopIteration as stop:
        result: T = stop.value
        return result
