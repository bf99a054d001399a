"""Who may drive a pool: one caller at a time enters or closes it (:class:`CloseGate`), and node
pacing admits it (:class:`PoolAdmission`: a slot while pinning, a budget share while anything is pinned).

``close()`` may come from any thread, even a signal handler on the holder's own thread. Taking the gate
is one C-level ``dict.setdefault``, so a signal handler sees no holder or a whole one."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

from .._errors import NodeBusyError, NodeWaitCancelled, PoolStateError
from .._node.pacing import BudgetHold, NodeAdmission, SlotHold
from .._observe import Observer
from .flag import Flag
from .outcome import Ran, RunThreads, Steps, admission_thread_error, closed_during_open

T = TypeVar("T")


class Parked(Protocol):
    """An async driver's hold on a lifecycle (``drivers._AsyncDrive``), as a gate sees it."""

    def stopped(self) -> bool: ...  # parked in an await of a closed event loop: it never drives again

    def take_over(self) -> Steps[None] | None: ...  # if stopped: the rest of its lifecycle, for the caller to run


DRIVING: contextvars.ContextVar[Parked | None] = contextvars.ContextVar("pinpool_driving", default=None)


@dataclass(frozen=True, eq=False)
class Driver:
    """The caller that holds the gate; ``drive``: its async driver (None: a sync one)."""

    thread: int
    role: str  # "enter" or "close"
    done: Flag = field(default_factory=Flag)
    drive: Parked | None = field(default_factory=DRIVING.get)

    def wait(self) -> None:
        """Until it lets go, or its async driver stopped for good (the waiter then takes over)."""
        drive = self.drive
        while not self.done.wait(None if drive is None else 0.05):
            if drive is not None and drive.stopped():
                return


class CloseGate:
    """One pool's gate. ``close_requested``: a ``close()`` was called (an entry then rolls back and raises)."""

    def __init__(self) -> None:
        self._held: dict[str, Driver] = {}
        self.close_requested = False

    def release(self, driver: Driver) -> None:
        """Let go, if ``driver`` holds the gate (an interrupt may have landed before it took it)."""
        if self._held.get("driver") is driver:  # only its holder changes a held gate
            del self._held["driver"]
        _DaemonCloses.running.pop(id(driver), None)
        driver.done.set()

    def take_over(self) -> Steps[bool]:
        """Finish the lifecycle of a holder whose async driver stopped for good (the finalizer); whether it did."""
        holder = self._held.get("driver")
        return (yield from _take_over(holder)) if holder is not None else False

    def enter(
        self, name: str, describe: str, enter: Callable[[], Steps[None]],
        exit: Callable[..., Steps[BaseException | None]],
    ) -> Steps[None]:  # fmt: skip
        """Run ``enter`` holding the gate; if a ``close()`` meanwhile did not stop it, ``exit`` closes it here."""
        mine = Driver(threading.get_ident(), "enter")
        try:
            if self._held.setdefault("driver", mine) is not mine:  # atomic: no handler lands inside it
                raise PoolStateError(
                    f"pool {name!r} is being entered or closed by another caller: a PinnedPool is entered once; "
                    "create a new PinnedPool to pin again"
                )
            yield from enter()
        except NodeWaitCancelled as exc:  # a foreground node-pacing wait that a close() cancelled
            if not self.close_requested:
                raise
            raise closed_during_open(describe) from exc
        finally:
            self.release(mine)
        if self.close_requested:  # read after letting go: a close from here on closes the pool itself
            unpinned = yield from exit(None, closing=True, raise_errors=False)
            raise closed_during_open(describe, unpinned)

    def close(
        self, name: str, close: Callable[[], Steps[T]], *, closing: bool, stop_entry: Callable[[], None]
    ) -> Steps[T | None]:
        """Run ``close`` (an exit, or ``closing``: ``close()``) holding the gate, once another holder lets
        go (an entry is asked to stop first); None at once where this very thread holds it."""
        if closing:
            self.close_requested = True  # before looking: an entry that ends now still sees it
        mine = Driver(threading.get_ident(), "close")
        try:
            while (holder := self._held.setdefault("driver", mine)) is not mine:
                if holder.drive is not None and holder.drive.stopped():
                    self._begin(mine)
                    yield from _take_over(holder)  # it lets go as its lifecycle ends
                    continue
                if holder.thread == mine.thread:
                    return None
                if holder.role == "enter":
                    if not closing:  # an exit (the end of a with block) of a pool whose entry has not returned
                        raise PoolStateError(f"pool {name!r} is being entered on another thread: exit it once entered")
                    stop_entry()
                ran = yield RunThreads(bodies=(holder.wait,), name=f"pinpool-{name}-close")
                if ran.interrupts:
                    raise ran.interrupts[0]
            self._begin(mine)
            return (yield from close())
        finally:
            self.release(mine)

    def _begin(self, mine: Driver) -> None:
        """A close starts its work; on a daemon thread once interpreter exit began, it never does."""
        if not _DaemonCloses.begin(mine):
            self.release(mine)
            threading.Event().wait()  # for good: the interpreter ends this thread as it finalizes


def _take_over(holder: Driver) -> Steps[bool]:
    taken = holder.drive.take_over() if holder.drive is not None else None
    if taken is None:  # it is driving (or another caller took it over first)
        return False
    yield from taken
    return True


class _DaemonCloses:
    """Closes under way on daemon threads, waited for at interpreter exit (one stopped mid-teardown can
    abort the process); once exit began none starts."""

    lock = threading.Lock()
    exiting = False
    hooked = False
    running: ClassVar[dict[int, Driver]] = {}

    @classmethod
    def begin(cls, driver: Driver) -> bool:
        """Whether the close may go on (on a daemon thread: not once exit began)."""
        if not threading.current_thread().daemon:
            return True  # the interpreter waits for the others anyway
        with cls.lock:
            if not cls.hooked:
                try:
                    threading._register_atexit(cls.wait)  # type: ignore[attr-defined]  # as concurrent.futures
                except RuntimeError:  # exit has begun
                    cls.exiting = True
                cls.hooked = True
            if not cls.exiting:
                cls.running[id(driver)] = driver
            return not cls.exiting

    @classmethod
    def wait(cls) -> None:
        with cls.lock:
            cls.exiting = True
            running = list(cls.running.values())
        for driver in running:
            driver.done.wait()


_KEPT_HOLDS: list[BudgetHold] = []  # budget shares of pools whose chunks leaked: held while this process lives


class PoolAdmission:
    """The node pacing of one pool (``admission`` None: none, every call is a no-op)."""

    def __init__(
        self, admission: NodeAdmission | None, *, name: str, nbytes: int, describe: str, observer: Observer
    ) -> None:
        self.admission, self.name, self.nbytes = admission, name, nbytes
        self.describe, self.observer = describe, observer
        self.cancel = Flag()  # set: give up the wait (exit, collection, interpreter exit)
        self.slot: SlotHold | None = None
        self.budget: BudgetHold | None = None

    def admit(self) -> Generator[RunThreads, Ran, None]:
        """Wait for a share of the node budget, then a pinning slot; a failed wait lets go of both and raises."""
        admission = self.admission
        if admission is None:
            return
        cancel = self.cancel

        def admit() -> None:
            if admission.pacing.budget_bytes is not None:
                self.budget = admission.reserve_budget(self.nbytes, cancelled=cancel.is_set)
            self.slot = admission.acquire_slot(cancelled=cancel.is_set)

        ran = yield RunThreads(
            bodies=(admit,), name=f"pinpool-{self.name}-admit", interruptible=True, on_interrupt=cancel.set
        )
        if not (ran.interrupts or ran.crashed or ran.start_errors):
            for kind, hold in (("budget", self.budget), ("slot", self.slot)):
                if hold is not None and not hold.released:
                    self.observer.node_admitted(kind=kind, seconds=hold.waited_seconds)
            return
        self.release_slot()
        self.release_budget()
        if ran.interrupts:
            raise ran.interrupts[0]
        if ran.crashed:
            error = ran.crashed[0]
            if isinstance(error, NodeBusyError):
                self.observer.node_busy(kind=error.kind)
            raise error
        raise admission_thread_error(self.describe, ran.start_errors[0])

    def release_slot(self) -> None:
        """Pinning is over (or never began): another rank may start pinning."""
        slot, self.slot = self.slot, None
        if slot is not None:
            slot.release()

    def release_budget(self, *, keep: bool = False) -> None:
        """Nothing of the pool is pinned any more; ``keep``: chunks leaked, the share stays counted."""
        budget, self.budget = self.budget, None
        if budget is not None and keep:
            _KEPT_HOLDS.append(budget)
        elif budget is not None:
            budget.release()
