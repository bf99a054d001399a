"""An elastic pool's policy loop (``elastic=ElasticPolicy(...)``, issue 36 item 2): a thread that follows the
host's memory pressure and grows or shrinks the pool as the pure :func:`~pinpool._plan.decide` says.

While the pool is open, thread ``pinpool-<name>-elastic`` (a daemon: it never keeps the interpreter alive)
waits on a :class:`PressureSource` (the host's: a PSI trigger and cgroup v1 ``memory.pressure_level``
where they can be armed, else a reading every ``read_interval_seconds``; the ``elastic.started`` event
says which), reads pressure, decides, and acts: a shrink asks the server's ``on_give_up(nbytes)`` which
pages it gives up (pinpool never takes a page the server did not name), then shrinks by them; a grow pins
whole segments. The server asks for more with ``pool.want(pages=N)``. Every failure of the loop (a reading,
a grow's PinError, the callback raising) is an ``elastic.failed`` event and a count, never an exception in
the server. The pool's exit stops and joins the loop before any segment is torn down (the lifecycle's
``policy_loop`` hook), and the loop holds the pool only weakly, so an unexited pool is still collected.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from .._errors import ConfigError, PoolStateError, PressureError, foreign_text
from .._host.pressure import read_memory_pressure
from .._host.watch import PressureWatch, PsiTrigger
from .._observe import Observer
from .._plan.elastic import Action, Decision, ElasticPolicy, ElasticState, decide
from .._types import MemoryReading

if TYPE_CHECKING:
    from .._pin.elastic import Grown, Shrunk

__all__ = ["GiveUp", "HostPressure", "PolicyLoop", "PressureSource", "recorded", "recorded_async"]

T = TypeVar("T")
GiveUp = Callable[[int], "Sequence[range] | None"]
JOIN_SECONDS = 5.0  # a loop busy growing past this is left to the pool's teardown, which takes its segment over
V1_LEVEL = "low"  # the cgroup reclaims: the earliest v1 signal, before the costly "medium"


class ElasticPool(Protocol):
    """What the loop uses of the pool it follows (a PinnedPool; a protocol: pool.py imports this module)."""

    @property
    def name(self) -> str: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def pinned_runs(self) -> tuple[range, ...]: ...

    def grow_sync(self, *, pages: int | None = None, nbytes: int | str | None = None) -> Grown: ...

    def _shrink_sync(
        self, *, pages: Sequence[range] | None = None, to_pages: int | None = None, decided_at: float | None = None
    ) -> Shrunk: ...

    def _growing(self) -> bool: ...


@runtime_checkable
class PressureSource(Protocol):
    """Where a policy loop reads memory pressure (``pressure=``: the host's by default; a test injects its own).
    Used by one thread, except :meth:`wake`, which may come from any thread until :meth:`close`."""

    def describe(self) -> str:
        """How it waits, for the ``elastic.started`` event."""
        ...

    def read(self) -> MemoryReading:
        """One reading now."""
        ...

    def wait(self, timeout: float) -> str | None:
        """Block until pressure is signalled (return its source, e.g. ``"psi"``), :meth:`wake` or ``timeout``."""
        ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class HostPressure:
    """The host's memory pressure: :func:`read_memory_pressure` readings, woken by a :class:`PressureWatch`
    (PSI trigger, cgroup v1 ``memory.pressure_level``) where one can be armed, else only by the timeout."""

    def __init__(self, root: str = "/") -> None:
        self._root = root
        self._woken = threading.Event()
        self._watch: PressureWatch | None = None
        try:
            self._watch = PressureWatch(PsiTrigger(), V1_LEVEL, root=root)
            self._how = "notified by " + ", ".join(f"{e.source} ({e.path}, {e.level})" for e in self._watch.armed)
        except PressureError as exc:
            self._how = f"periodic readings: nothing can be armed ({exc})"

    def describe(self) -> str:
        return self._how

    def read(self) -> MemoryReading:
        return read_memory_pressure(self._root)

    def wait(self, timeout: float) -> str | None:
        if self._watch is None:
            self._woken.wait(timeout)
            self._woken.clear()
            return None
        event = self._watch.wait(timeout)
        return None if event is None else event.source

    def wake(self) -> None:
        if self._watch is None:
            self._woken.set()
        else:
            self._watch.wake()

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()


def check_policy(policy: object, on_give_up: object, pressure: object) -> None:
    """The request's checks of ``elastic=``, ``on_give_up=`` and ``pressure=`` (the pool checks the rest)."""
    if policy is not None and not isinstance(policy, ElasticPolicy):
        raise ConfigError(f"elastic={policy!r}: pass a pinpool.ElasticPolicy(...), or None for no policy loop")
    if on_give_up is not None and not callable(on_give_up):
        raise ConfigError(f"on_give_up={on_give_up!r} must be callable(nbytes) -> a sequence of page ranges")
    if pressure is not None and not isinstance(pressure, PressureSource):
        raise ConfigError(
            f"pressure={pressure!r} has not describe(), read(), wait(timeout), wake() and close(): pass a pressure "
            "source (pinpool.testing.FakePressure in a test), or None for the host's"
        )
    if policy is None and (on_give_up is not None or pressure is not None):
        given = "on_give_up=" if on_give_up is not None else "pressure="
        raise ConfigError(f"{given} is for a policy loop: give elastic=ElasticPolicy(...) too, or leave it out")
    if policy is not None and on_give_up is None:
        raise ConfigError(
            "elastic= needs on_give_up=callable(nbytes) -> page ranges: pinpool gives back only pages the server "
            "says it no longer uses (return the tail, or runs its allocator freed; [] gives nothing)"
        )


class PolicyLoop:
    """The policy loop of one pool (module docstring): :meth:`start` after entry; the lifecycle calls
    :meth:`stop`, then :meth:`join` when it says so, before the teardown."""

    def __init__(
        self, pool: ElasticPool, policy: ElasticPolicy, on_give_up: GiveUp, *, observer: Observer,
        page_bytes: int, floor_pages: int, source: PressureSource | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        policy.check(pool.num_pages * page_bytes)
        self._pool = weakref.ref(pool)  # never the pool itself: an unexited pool must still be collected
        self.policy, self.on_give_up, self.observer = policy, on_give_up, observer
        self.page_bytes, self.floor_bytes = page_bytes, floor_pages * page_bytes
        self.reserved = pool.num_pages * page_bytes
        self.name = pool.name
        self._given, self._clock = source, clock
        self._source: PressureSource | None = None
        # wake() against the loop closing the source. Re-entrant: a close() run by a signal handler on a thread inside
        # a wake (the server's want()) wakes again; ``_waking`` counts, per thread, the wakes it is inside.
        self._source_lock = threading.RLock()
        self._waking = threading.local()
        self._stop = threading.Event()
        self._asked_lock = threading.Lock()
        self._asked = 0  # bytes the server asked for and no grow has given it yet
        self.thread: threading.Thread | None = None
        self.last_grow_at: float | None = None
        self.last_shrink_at: float | None = None
        self._at_floor = False  # told about this episode of pressure at the floor already
        self._futile_at: float | None = None  # a shrink this episode gave nothing back (another process maps it)
        self.decisions = 0  # readings decided (acted on or held): a test waits on it

    # -- from the server's thread -------------------------------------------------------------

    def start(self) -> None:
        if self._stop.is_set():  # closed from another thread before the entry came back: nothing to follow
            return
        source = self._given if self._given is not None else HostPressure()
        with self._source_lock:
            self._source = source
        self.thread = threading.Thread(target=self._run, name=f"pinpool-{self.name}-elastic", daemon=True)
        self.thread.start()

    def ask(self, nbytes: int) -> None:
        """The server needs ``nbytes`` more than it has: the next decision grows for it (unless pressed)."""
        with self._asked_lock:
            self._asked = nbytes
        self._wake()

    @property
    def asked(self) -> int:
        with self._asked_lock:
            return self._asked

    def stop(self) -> bool:
        """Tell the loop to end (at once, from any thread); whether :meth:`join` must wait for it."""
        self._stop.set()
        self._wake()
        thread = self.thread
        # Called inside this thread's own wake (a signal handler's close() during want()), the loop cannot end
        # before that wake does: it closes its source under the same lock. Not waited for: the pool's teardown
        # takes over whatever it grows or shrinks, as for a loop that outlives the join.
        inside_wake = getattr(self._waking, "depth", 0) > 0
        return thread is not None and thread.is_alive() and thread is not threading.current_thread() and not inside_wake

    def join(self) -> None:
        thread = self.thread
        if thread is None:
            return
        thread.join(JOIN_SECONDS)
        if thread.is_alive():
            self.observer.elastic_event(
                "warning", "elastic.stop_late", seconds=JOIN_SECONDS,
                note="the loop is still growing or shrinking; the pool's teardown takes its segment over",
            )  # fmt: skip

    def _wake(self) -> None:
        self._waking.depth = getattr(self._waking, "depth", 0) + 1  # before the lock: a handler may land at once
        try:
            with self._source_lock:
                if self._source is not None:
                    self._source.wake()
        finally:
            self._waking.depth -= 1

    # -- the loop's thread --------------------------------------------------------------------

    def _run(self) -> None:
        source = self._source
        assert source is not None
        try:
            self.observer.elastic_event(
                "info", "elastic.started", pressure=source.describe(), floor_bytes=self.floor_bytes,
                reserved_bytes=self.reserved, read_interval_seconds=self.policy.read_interval_seconds,
            )  # fmt: skip
            while not self._stop.is_set():
                try:
                    woke = source.wait(self.policy.read_interval_seconds)
                except Exception as exc:  # a watched cgroup went away: keep reading, at the interval
                    self._failed("read", exc)
                    self._stop.wait(self.policy.read_interval_seconds)
                    woke = None
                if self._stop.is_set():
                    break
                if woke is not None:
                    self.observer.pressure_woke(woke)
                pool = self._pool()
                if pool is None:
                    break
                try:
                    self._step(pool, source)
                finally:
                    del pool  # between steps the loop holds nothing of the pool
        except BaseException as exc:  # the server must never lose its pool to its policy
            self._failed("loop", exc)
        finally:
            with self._source_lock:
                self._source = None
                try:
                    source.close()
                except Exception as exc:
                    self._failed("read", exc)
            self.observer.elastic_event("info", "elastic.stopped", decisions=self.decisions)

    def _failed(self, kind: str, exc: BaseException, **fields: object) -> None:
        """Counted and logged, with the error's notes: they say what stayed (pages grown before a failed segment,
        chunks left registered by a rollback or a shrink whose unregister failed), and no one else will see them."""
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, list) and notes:
            fields["notes"] = foreign_text("; ".join(map(str, notes)), limit=2000)
        self.observer.elastic_failed(kind, exc, **fields)

    def _usable_bytes(self, pool: ElasticPool) -> int:
        return sum(len(r) for r in pool.pinned_runs) * self.page_bytes

    def _step(self, pool: ElasticPool, source: PressureSource) -> None:
        now = self._clock()
        try:  # an injected source (pressure=) may answer anything: a reading decide() cannot take is a failed read
            reading = source.read()
            if not isinstance(reading, MemoryReading):
                raise ConfigError(f"{source.describe()}.read() returned {reading!r}: return a pinpool MemoryReading")
            state = ElasticState(
                self.reserved, min(self.reserved, self._usable_bytes(pool)), self.floor_bytes, self.last_grow_at,
                self.last_shrink_at,
            )  # fmt: skip
            decision = decide(self.policy, state, reading, now, self.asked)
            self.observer.pressure_read(None if reading.psi is None else reading.psi.some.avg10)
        except Exception as exc:
            self._failed("read", exc)
            return
        self.decisions += 1
        if self._stop.is_set():  # the pool exits meanwhile: a grow now would only hold its close up
            return
        if decision.action is Action.GROW and pool._growing():  # the server's own grow: it is being served
            return
        if decision.action is Action.GROW:
            self._grow(pool, decision, now)
        elif decision.action in (Action.SHRINK, Action.SHRINK_TO_FLOOR) and not self._futile(now):
            self._shrink(pool, decision, now)
        if not decision.pressure:  # calm again: the next pressure may find the region alone
            self._futile_at = None
        if decision.at_floor and not self._at_floor:
            self.observer.at_floor(decision.reason)
        self._at_floor = decision.at_floor or (self._at_floor and decision.pressure)

    def _futile(self, now: float) -> bool:
        """Whether a shrink now would likely free nothing again: one did, within ``cooldown_seconds``, this episode
        of pressure (after that, one more try: the other process may have let go of the region)."""
        return self._futile_at is not None and now - self._futile_at < self.policy.cooldown_seconds

    def _grow(self, pool: ElasticPool, decision: Decision, now: float) -> None:
        self.observer.elastic_event("info", "elastic.decided", action=decision.action.value, bytes=decision.nbytes,
                                    reason=decision.reason)  # fmt: skip
        try:
            grown = pool.grow_sync(pages=max(1, math.ceil(decision.nbytes / self.page_bytes)))
        except Exception as exc:  # the pool's grow already counted it by outcome; it rolled back what failed
            self._failed("grow", exc, bytes=decision.nbytes)
            return
        finally:
            self.last_grow_at = now
        with self._asked_lock:
            self._asked = max(0, self._asked - grown.num_pages * self.page_bytes)

    def _shrink(self, pool: ElasticPool, decision: Decision, now: float) -> None:
        self.observer.elastic_event("warning", "elastic.decided", action=decision.action.value,
                                    bytes=decision.nbytes, reason=decision.reason)  # fmt: skip
        self.last_shrink_at = now  # whatever the server answers: ask it again only after shrink_interval_seconds
        try:
            given = self.on_give_up(decision.nbytes)
            pages = [] if given is None else list(given)
            if not all(isinstance(r, range) for r in pages):
                raise ConfigError(f"on_give_up({decision.nbytes}) returned {given!r}: return a sequence of ranges")
        except BaseException as exc:  # SystemExit too: the server's callback must not end the policy for good
            self._failed("give_up", exc, bytes=decision.nbytes)
            return
        if self._stop.is_set():  # the pool exits (the callback may have closed it): its teardown takes every page
            return
        if not pages:
            self.observer.shrank("declined", 0, self._clock() - now, asked_bytes=decision.nbytes,
                                 note="on_give_up gave up no page: nothing was taken")  # fmt: skip
            return
        try:
            shrunk = pool._shrink_sync(pages=pages, decided_at=now)
        except Exception as exc:  # counted by outcome in the pool's shrink; nothing changed or it is booked
            self._failed("shrink", exc, bytes=decision.nbytes)
            return
        if (shrunk.released or shrunk.recovered) and not given_back_pages(shrunk):
            # Another process maps the shared region: unpinning gave no memory back, and more shrinks would only
            # take the server's pages for nothing. None within cooldown_seconds while the pressure lasts.
            self._futile_at = now
            self.observer.elastic_event(
                "warning", "elastic.shrink_futile", bytes=sum(len(r) for r in shrunk.released) * self.page_bytes,
                reason="the pages stay in the shared region another process maps; next shrink after cooldown_seconds",
            )  # fmt: skip


# -- grows and shrinks counted, whoever asked (the server's calls and the loop's alike) -------------


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, ConfigError | PoolStateError):
        return "refused"
    return "failed" if isinstance(exc, Exception) else "cancelled"


def _ended(
    observer: Observer, kind: str, result: object, error: BaseException | None, before: int, after: int,
    page_bytes: int, seconds: float,
) -> None:  # fmt: skip
    if kind == "grow":
        nbytes = getattr(result, "num_pages", 0) * page_bytes if error is None else max(0, after - before)
        outcome = "grown" if error is None else _outcome(error)
        observer.grew(outcome, nbytes, seconds, **({} if error is None else {"error_type": type(error).__name__}))
        return
    released = sum(len(r) for r in getattr(result, "released", ())) * page_bytes
    nbytes = given_back_pages(result) * page_bytes if error is None else max(0, before - after)
    outcome = ("shrunk" if released else "kept") if error is None else _outcome(error)
    observer.shrank(outcome, nbytes, seconds, **({} if error is None else {"error_type": type(error).__name__}))


def given_back_pages(shrunk: object) -> int:
    """Pages a shrink gave back to the host: those it released or finished (``recovered``) less ``unreturned``
    (the pages of either whose give-back failed or was kept for another process)."""
    pages = [*getattr(shrunk, "released", ()), *getattr(shrunk, "recovered", ())]
    return sum(len(r) for r in pages) - sum(len(r) for r in getattr(shrunk, "unreturned", ()))


def recorded(
    observer: Observer, kind: str, usable: Callable[[], int], page_bytes: int, call: Callable[[], T],
    started: float | None = None,
) -> T:  # fmt: skip
    """``call()`` (a grow or a shrink of ``kind``), counted by outcome with its bytes and seconds (from
    ``started``, a decision's monotonic time, else now); ``usable``: usable bytes, for a partial result."""
    started = time.monotonic() if started is None else started
    before = usable()
    try:
        result = call()
    except BaseException as exc:
        _ended(observer, kind, None, exc, before, usable(), page_bytes, time.monotonic() - started)
        raise
    _ended(observer, kind, result, None, before, 0, page_bytes, time.monotonic() - started)
    return result


async def recorded_async(
    observer: Observer, kind: str, usable: Callable[[], int], page_bytes: int, call: Awaitable[T]
) -> T:
    """:func:`recorded` for a driver's awaitable."""
    started, before = time.monotonic(), usable()
    try:
        result = await call
    except BaseException as exc:
        _ended(observer, kind, None, exc, before, usable(), page_bytes, time.monotonic() - started)
        raise
    _ended(observer, kind, result, None, before, 0, page_bytes, time.monotonic() - started)
    return result
