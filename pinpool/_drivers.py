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

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from ._threads import PROGRESS_INTERVAL_SECONDS, Threads

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
        step.on_started()
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
    # Until the first interruption, the wait is not shielded, so a cancellation of the caller
    # lands here while the threads run. Waiting on a threading.Event has no side effect, so
    # that wait may be abandoned; the threads are not.
    while not threads.done:
        shielded = bool(ran.interrupts) or not step.interruptible
        interval = PROGRESS_INTERVAL_SECONDS if step.on_tick and not shielded else math.inf
        try:
            with anyio.CancelScope(shield=shielded):
                finished = await anyio.to_thread.run_sync(
                    threads.all_done.wait, min(interval, 1.0), abandon_on_cancel=True
                )
            if not finished and not shielded and step.on_tick is not None:
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
