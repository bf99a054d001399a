"""A runtime wrapper that times every register / unregister call, for the benchmark.

It is a runtime in its own right (pinpool's public runtime contract: ``name``,
``register(ptr, nbytes)``, ``unregister(ptr)``), and it declares the inner runtime's optional
abilities as its own, forwarding ``populate`` / ``lock_on_fault`` / ``find_pinned`` to it, so
that PinnedPool drives the wrapped runtime exactly as it drives the inner one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pinpool.runtimes import Capabilities, Runtime, capabilities_of


def _declared_abilities(inner: Runtime) -> tuple[Capabilities, bool, bool, bool]:
    """``(capabilities, populates, locks_on_fault, finds_pinned)`` as ``inner`` declares them."""
    declared = capabilities_of(inner)
    return declared, declared.populates, declared.locks_on_fault, declared.finds_pinned


class TimedRuntime:
    """Wraps a runtime and records the duration of every register / unregister call.

    ``register_seconds`` has one entry per ``register`` or ``lock_on_fault`` call (the
    registration calls a serving process waits behind), ``unregister_seconds`` one per
    ``unregister``. ``capabilities`` (where pinpool declares them) are the inner runtime's.
    """

    capabilities: Any

    def __init__(self, inner: Runtime) -> None:
        self.inner = inner
        self.name = inner.name
        self.register_seconds: list[float] = []
        self.unregister_seconds: list[float] = []
        self._lock = threading.Lock()
        declared, populates, locks_on_fault, finds_pinned = _declared_abilities(inner)
        if declared is not None:
            self.capabilities = declared
        # The optional calls exist on the wrapper exactly when the inner runtime has them.
        if populates:
            self.populate: Callable[[int, int], None] = self._populate
        if locks_on_fault:
            self.lock_on_fault: Callable[[int, int], None] = self._lock_on_fault
        if finds_pinned:
            self.find_pinned: Callable[[int, int], str | None] = self._find_pinned

    def _timed(self, into: list[float], call: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            call()
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                into.append(elapsed)

    def register(self, ptr: int, nbytes: int) -> None:
        self._timed(self.register_seconds, lambda: self.inner.register(ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self._timed(self.unregister_seconds, lambda: self.inner.unregister(ptr))

    def _lock_on_fault(self, ptr: int, nbytes: int) -> None:
        inner: Any = self.inner
        self._timed(self.register_seconds, lambda: inner.lock_on_fault(ptr, nbytes))

    def _populate(self, ptr: int, nbytes: int) -> None:
        inner: Any = self.inner
        inner.populate(ptr, nbytes)

    def _find_pinned(self, ptr: int, nbytes: int) -> str | None:
        inner: Any = self.inner
        found: str | None = inner.find_pinned(ptr, nbytes)
        return found
