"""A pool's rules, pure: its states (:data:`TRANSITIONS`), how pinning ends (:func:`decide`), what leaving
raises (:func:`deliver_exit`), the error texts and the unclosed warning; and the steps a lifecycle yields
to its driver and gets back (:class:`Ran`), so it is tested with scripted results, with no driver."""

from __future__ import annotations

import enum
import os
import sys
import warnings
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from .._errors import ChunkFailure, MemoryGoneError, PinError, PoolStateError, UnclosedPoolWarning, UnpinError
from .._plan.chunks import Chunk
from .._units import format_bytes
from .ledger import StopCause


class PoolState(enum.Enum):
    """Where a pool is in its life (``pool.state``).

    NEW: not entered. PINNING: entered, pinning (in the background pages ``[0, pool.pinned_pages)``
    are usable). READY: every chunk pinned. FAILED: background pinning ended early; ``pool.error``
    says why, and pages ``[0, pool.pinned_pages)`` stay pinned until exit. CLOSING: unpinning.
    CLOSED: nothing pinned.
    """

    NEW = "new"
    PINNING = "pinning"
    READY = "ready"
    FAILED = "failed"
    CLOSING = "closing"
    CLOSED = "closed"


_S = PoolState
# Every state change a pool may make (docs/concepts.md, A pool's states); anything else is a pinpool bug.
TRANSITIONS: dict[PoolState, frozenset[PoolState]] = {
    _S.NEW: frozenset({_S.PINNING, _S.CLOSED}),
    _S.PINNING: frozenset({_S.READY, _S.FAILED, _S.CLOSING, _S.CLOSED}),
    _S.READY: frozenset({_S.CLOSING, _S.CLOSED}),  # CLOSED: a forked child
    _S.FAILED: frozenset({_S.CLOSING, _S.CLOSED}),
    _S.CLOSING: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset(),
}


class TransitionError(AssertionError):
    """A pool was asked to move where the table says it cannot: a pinpool bug."""


def check_move(current: PoolState, to: PoolState) -> None:
    if to not in TRANSITIONS[current]:
        raise TransitionError(f"pool state {current.value} -> {to.value} is not a transition pinpool makes")


class Outcome(enum.Enum):
    """How one pinning step ended; ``cause``: the ``pinpool_rollbacks_total`` label and ``pool.rollback`` field."""

    READY = "ready"  # every chunk pinned: the pool opens
    FAILED = "failed"  # a runtime call failed, a worker crashed, or no thread could be started
    INTERRUPTED = "interrupted"  # cancellation, Ctrl-C, SystemExit, an exception from on_progress
    EXITED = "exited"  # background: the body left (or the interpreter exits) while the pool pinned
    ORPHANED = "orphaned"  # background: the pool was garbage-collected while it pinned

    @property
    def cause(self) -> str:
        by_value = {"ready": "", "failed": "failure", "interrupted": "cancelled", "exited": "exit"}
        return by_value.get(self.value, "collected")  # ORPHANED


def decide(*, interrupted: bool, pinned: bool, stop_cause: StopCause | None, orphaned: bool) -> Outcome:
    """The one outcome of a pinning step. ``interrupted``: the driver saw an interruption (or
    ``on_progress`` or opening raised); ``pinned``: every chunk registered and nothing asked to stop."""
    if interrupted:
        return Outcome.INTERRUPTED
    if pinned:
        return Outcome.ORPHANED if orphaned else Outcome.READY
    if stop_cause is StopCause.EXIT:
        return Outcome.EXITED
    if stop_cause is StopCause.COLLECTED:
        return Outcome.ORPHANED
    return Outcome.FAILED  # a call failed, a worker crashed or never started (CANCELLED without an interrupt too)


def deliver_exit(
    body_error: BaseException | None, failed: BaseException | None, unpinned: UnpinError | None,
    interrupts: list[BaseException], raise_errors: bool,
) -> BaseException | None:  # fmt: skip
    """What leaving a pool raises: an interruption first, else the unseen background failure, else the
    unpin error, the others as notes (a body's own error gets them all); ``raise_errors=False`` returns it."""
    notes = [f"pinpool: pinning in the background had failed: {failed}"] if failed is not None else []
    notes += [f"pinpool: {unpinned}"] if unpinned is not None else []
    target = interrupts[0] if interrupts else body_error
    if target is not None:
        for note in notes:
            target.add_note(note)
        if interrupts:
            raise interrupts[0]
        return None
    error = failed if failed is not None else unpinned
    if failed is not None and unpinned is not None:
        failed.add_note(f"pinpool: {unpinned}")
    if error is not None and raise_errors:
        raise error
    return error


def pin_error(
    *, describe: str, nbytes: int, chunk_limit: int, failures: Sequence[ChunkFailure], leaked: tuple[Chunk, ...],
    retries: int, cause: BaseException | None, crashed: bool, kept: str | None, gone: str | None = None,
) -> PinError:  # fmt: skip
    """The PinError of a failed pinning; ``kept``: what a background pool keeps (None: rolled back);
    ``gone``: why a background pool's memory is gone (then a MemoryGoneError)."""
    error_type = PinError if gone is None else MemoryGoneError
    if gone is not None:  # said once: a failed pre-fault's message names the truncation already
        why = "" if any(gone in f.error.message for f in failures) else f" ({gone})"
        ending = (
            f"; the pool's memory is gone{why}: no page of the pool may be touched (a touch is SIGBUS), so "
            "pinned_pages is 0. Nothing was unpinned: stop using the pool, then exit or close it"
        )
    elif kept is not None:
        ending = f"; {kept}"
    elif leaked:
        ending = f"; rolled back, {len(leaked)} chunk(s) could not be unregistered and may still be pinned: {leaked}"
    else:
        ending = "; every registered chunk was rolled back"
    if not failures:  # no runtime call failed: the threads did
        what = (
            f"a pinning thread failed ({type(cause).__name__}: {cause}; this is a pinpool bug, please report it)"
            if crashed
            else f"no pinning thread could be started ({type(cause).__name__}: {cause}); "
            "the process is out of threads: lower the worker counts or raise the thread limit"
        )
        return _caused(error_type(f"pinning {describe} failed: {what}{ending}", failures=(), leaked=leaked), cause)
    first = min(failures, key=lambda f: f.chunk.offset)
    message = (
        f"pinning {describe} failed at offset={first.chunk.offset} nbytes={first.chunk.nbytes} "
        f"total={nbytes} chunk_limit={chunk_limit}: {first.call} "
        f"rc={first.error.code} ({first.error.reason}): {first.error.message}"
    )
    if len(failures) > 1:
        message += f" [{len(failures)} calls failed, in {len({f.chunk for f in failures})} chunk(s)]"
    if retries:
        message += (
            f" [after {retries} retries with aligned halves, down to min_chunk_bytes or the max_retries "
            "budget; every attempt is in .failures]"
        )
    return _caused(error_type(message + ending, failures=tuple(failures), leaked=leaked), first.error)


def kept_text(
    pages: int, num_pages: int, pinned_bytes: int, registrations: Sequence[Chunk], maybe_bytes: int = 0
) -> str:
    """What a background pool keeps after a failure, in the pool's own figures."""
    registered = sum(chunk.nbytes for chunk in registrations)
    held = f"{format_bytes(pinned_bytes)} pinned, {len(registrations)} registration(s) of {format_bytes(registered)}"
    unfaulted = registered - pinned_bytes - maybe_bytes
    notes = []
    if unfaulted > 0:
        notes.append(f"{format_bytes(unfaulted)} of them locked on fault but not faulted in: not pinned")
    if maybe_bytes:
        notes.append(f"{format_bytes(maybe_bytes)} of them a register call that failed but may have registered")
    if notes:
        held += f" ({'; '.join(notes)})"
    return (
        f"nothing was unpinned: pages [0, {pages}) of {num_pages} ({held}) stay pinned "
        "and usable until the pool is exited or closed; stop using new pages, drain, and exit the pool"
    )


def _caused(error: PinError, cause: BaseException | None) -> PinError:
    error.__cause__ = cause
    return error


def thread_start_error(describe: str, exc: BaseException) -> PinError:
    message = (
        f"pinning {describe} in the background failed: its thread could not be started "
        f"({type(exc).__name__}: {exc}); nothing is pinned. Lower the worker counts or raise the thread limit"
    )
    return _caused(PinError(message, failures=(), leaked=()), exc)


def admission_thread_error(describe: str, exc: BaseException) -> PinError:
    message = f"pinning {describe}: the node-pacing wait could not start a thread ({exc})"
    return _caused(PinError(message, failures=(), leaked=()), exc)


def closed_during_open(describe: str, unpinned: BaseException | None = None) -> PoolStateError:
    """What ``open()`` / ``with`` raises when ``close()`` was called while the pool was being entered."""
    error = PoolStateError(
        f"{describe} was closed while it was being opened (pool.close() on another thread or from a "
        "signal handler): pinning stopped and what it had pinned was unpinned; create a new PinnedPool to pin again"
    )
    if unpinned is not None:  # the close's own unpin failure (logged and counted as well)
        error.add_note(f"pinpool: {unpinned}")
    return error


def unpin_error(name: str, failures: Sequence[ChunkFailure], leaked: tuple[Chunk, ...]) -> UnpinError:
    return UnpinError(
        f"unpinning pool {name!r}: {len(failures)} chunk(s) failed to unregister "
        f"({', '.join(f'{_whose(f)}offset={f.chunk.offset} rc={f.error.code} ({f.error.reason})' for f in failures)}); "
        f"{format_bytes(sum(c.nbytes for c in leaked))} may still be pinned; the memory is kept mapped",
        failures=tuple(failures),
        leaked=leaked,
    )


def _whose(failure: ChunkFailure) -> str:
    return "" if failure.registrar is None else f"{failure.registrar}: "


def caller_outside_pinpool() -> tuple[str, int]:
    """(file, line) of the first frame outside pinpool: where the user made the pool."""
    frame = sys._getframe(1)
    package = os.path.dirname(os.path.dirname(__file__))  # pinpool/, not pinpool/_pin/
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame = frame.f_back  # type: ignore[assignment]
    return ("<unknown>", 0) if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def warn_unclosed(name: str, created_at: tuple[str, int], what: str) -> None:
    """Warn at ``created_at`` (:func:`caller_outside_pinpool`): a finalizer has no caller of its own to point at."""
    filename, lineno = created_at
    message = (
        f"PinnedPool {name!r} was never exited; {what}. "
        "Use `async with` / `with`, or pool.close(), so teardown happens where you expect it"
    )
    if filename.startswith("<"):  # python -c, a REPL: no file to point at (warn_explicit drops those)
        warnings.warn(message, UnclosedPoolWarning, stacklevel=2)
        return
    warnings.warn_explicit(message, UnclosedPoolWarning, filename, lineno)


T = TypeVar("T")


class Joinable(Protocol):
    """A detached sequence running on its own thread (see :class:`Detach`)."""

    @property
    def done(self) -> bool: ...

    def join(self) -> None: ...


@dataclass(frozen=True)
class RunThreads:
    """Run each body on its own thread and wait for all; ``interruptible``: an interruption stops them early."""

    bodies: tuple[Callable[[], object], ...]
    name: str
    interruptible: bool = False
    on_interrupt: Callable[[], None] = lambda: None
    on_tick: Callable[[], None] | None = None
    on_started: Callable[[], None] = lambda: None  # every thread is started (or no more will be)
    # A teardown: told the count of Ctrl-Cs held at each new one; True abandons the wait (daemon threads).
    on_held: Callable[[int], bool] | None = None


@dataclass(frozen=True)
class Detach:
    """Run ``steps`` on a new thread and return at once; ``stop`` is called as the interpreter starts to exit."""

    steps: Generator[RunThreads | Detach, Ran, None]
    name: str
    stop: Callable[[], None] = lambda: None


@dataclass
class Ran:
    """What happened while a step ran (what the driver could not finish is thrown into the lifecycle)."""

    interrupts: list[BaseException] = field(default_factory=list)
    crashed: list[BaseException] = field(default_factory=list)
    start_errors: list[BaseException] = field(default_factory=list)
    started: int = 0
    detached: Joinable | None = None
    abandoned: bool = False  # on_held gave up waiting: threads may still be in a runtime call


Step = RunThreads | Detach
Steps = Generator[Step, Ran, T]
