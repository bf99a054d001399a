"""Worker threads a driver waits for: on the books before ``Thread.start`` (an exception can land inside it),
behind a gate decided by one ``dict.setdefault`` (the starter takes no lock); waited for through a C lock,
never ``Thread.join`` (bpo-45274) nor an Event (a raise inside ``Event.wait`` can leave its lock held)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

POLL_SECONDS = 0.05
_ON_WORKER = threading.local()  # .serving: the pools (ids) whose drivers wait for this thread, when it is a worker
PROGRESS_INTERVAL_SECONDS = 0.1
_PASSED, _CLOSED = "passed", "closed"


def serving() -> frozenset[int]:
    """The pools (their lifecycles' ids) whose drivers wait for this thread, one of their workers (a runtime's,
    registrar's or progress callback's caller), directly or through a conductor; empty off pinpool's workers."""
    pools: frozenset[int] = getattr(_ON_WORKER, "serving", frozenset())
    return pools


@contextlib.contextmanager
def serving_also(owner: object) -> Iterator[None]:
    """This thread serves ``owner``'s pool for the block: a driver running its steps inline (the finalizer), whose
    runtime's call a close() of that pool must not wait for."""
    before = serving()
    _ON_WORKER.serving = before | {id(owner)}
    try:
        yield
    finally:
        _ON_WORKER.serving = before


class Threads:
    """A set of worker threads, waited for with :meth:`wait_done`."""

    def __init__(self, serving: frozenset[int] = frozenset()) -> None:
        self.serving = serving  # what its workers serve (see serving())
        self._lock = threading.Lock()  # workers' own counts (no exception is raised into a worker)
        self._books: dict[int, tuple[threading.Thread, dict[str, str]]] = {}  # not done: may pass its gate, or did
        self._owner = threading.get_ident()  # the starter: only it reaps (it is never inside start then)
        self.started = 0  # threads whose body ran (or runs)
        self.errors: list[BaseException] = []
        self._idle = threading.Lock()  # held while the books are not empty: wakes a waiter at once

    def start(self, fn: Callable[[], object], *, name: str, daemon: bool = False) -> None:
        """Start ``fn`` on a new thread; if this raises, the thread runs ``fn`` and is waited for, or never runs it."""
        gate: dict[str, str] = {}
        key = id(gate)

        def run() -> None:
            if gate.setdefault("state", _PASSED) is not _PASSED:
                return  # its start was given up: it must not touch anything
            with self._lock:
                self.started += 1
            _ON_WORKER.serving = self.serving
            try:
                fn()
            except BaseException as exc:  # recorded for the lifecycle; a worker has no caller to raise to
                self.errors.append(exc)
            finally:
                self._drop(key)

        thread = threading.Thread(target=run, name=name, daemon=daemon)
        try:
            self._books[key] = (thread, gate)
            self._idle.acquire(blocking=False)
            thread.start()
        except BaseException:
            if gate.setdefault("state", _CLOSED) is _CLOSED:  # else its body already began: waited for
                self._drop(key)
            raise

    def _drop(self, key: int) -> None:
        self._books.pop(key, None)
        if not self._books and self._idle.locked():
            with contextlib.suppress(RuntimeError):  # released by another thread's drop meanwhile
                self._idle.release()

    def _reap(self) -> None:
        """Close the gate of a thread on the books that is not alive and never passed it."""
        if threading.get_ident() != self._owner:
            return
        for key, (thread, gate) in list(self._books.items()):
            if "state" not in gate and not thread.is_alive() and gate.setdefault("state", _CLOSED) is _CLOSED:
                self._drop(key)

    @property
    def done(self) -> bool:
        self._reap()
        return not self._books

    def wait_done(self, timeout: float) -> bool:
        """Whether every thread is done, waiting at most ``timeout`` seconds."""
        if self._books and self._idle.acquire(timeout=timeout):
            self._idle.release()
            if self._books:  # the lock missed a change (an exception between two stores): poll instead
                time.sleep(min(timeout, 0.005))
        return self.done

    def wait(self, on_tick: Callable[[], object] | None = None) -> None:
        """Wait until every thread is done, in timed waits (Ctrl-C is seen promptly), ticking ``on_tick``."""
        last_tick = time.monotonic()
        while not self.wait_done(POLL_SECONDS):
            if on_tick is not None and time.monotonic() - last_tick >= PROGRESS_INTERVAL_SECONDS:
                last_tick = time.monotonic()
                on_tick()

    join = wait  # a body that waits on behalf of an interruptible one
