"""Test helpers for pinpool and for code built on it.

:class:`FakeRuntime` registers nothing for real; it keeps the books CUDA would keep, fails
on request, and records every call, so you can test failure, rollback and cancellation
paths of your own server without a GPU or locked memory::

    fake = FakeRuntime(fail_register_on=3)
    with pytest.raises(pinpool.PinError):
        with pinpool.PinnedPool(size="1GiB", chunk_bytes="128MiB", runtime=fake):
            ...
    assert fake.registered == {}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from ._errors import ConfigError, RuntimeCallError
from ._ranges import RangeBook

__all__ = ["FakeRuntime"]

# CUDA's codes, so code written against the fake sees what it would see on a GPU host.
_ALLOCATION_FAILED = (2, "cudaErrorMemoryAllocation")
_ALREADY_REGISTERED = (712, "cudaErrorHostMemoryAlreadyRegistered")
_NOT_REGISTERED = (713, "cudaErrorHostMemoryNotRegistered")


def _call_indices(value: int | Iterable[int] | None, what: str) -> frozenset[int]:
    if value is None:
        return frozenset()
    indices = frozenset([value]) if isinstance(value, int) else frozenset(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in indices):
        raise ConfigError(f"{what}={value!r}: call indices are 1-based ints (an int or a set of them)")
    return indices


class FakeRuntime:
    """A thread-safe stand-in for a pinning runtime, with fault injection.

    ``fail_register_on`` / ``fail_unregister_on``: 1-based indices (an int or a set) of the
    register / unregister calls that fail, counted over this runtime's lifetime.
    ``register_delay`` / ``unregister_delay``: seconds each call sleeps (outside the lock, so
    concurrent calls really overlap).

    Like CUDA, registering a range that overlaps a registered one fails with
    ``cudaErrorHostMemoryAlreadyRegistered`` (712), and unregistering anything but a
    registered base fails with ``cudaErrorHostMemoryNotRegistered`` (713). Injected failures
    report ``cudaErrorMemoryAllocation`` (2).

    Attributes: ``registered`` (base → nbytes now registered), ``register_calls`` (every
    ``(ptr, nbytes)`` asked, failed ones included), ``unregister_calls`` (every ptr asked),
    ``max_concurrent_registers`` (most register calls seen in flight at once).

    Pre-faulting (``populate=``, on by default) goes through :meth:`populate`, which touches no
    memory: ``fail_populate_on`` / ``populate_delay`` inject failures (reported as ENOMEM, as
    MADV_POPULATE_WRITE does) and latency; ``populate_calls`` records every ``(ptr, nbytes)``.
    ``lock_on_fault=True`` makes the fake behave like mlock: chunks are registered (through
    :meth:`lock_on_fault`) before they are faulted, instead of after (CUDA).
    ``events`` is every call in the order it started: ``("populate" | "register" |
    "unregister", ptr)``.
    """

    name = "fake"

    def __init__(
        self,
        *,
        fail_register_on: int | Iterable[int] | None = None,
        fail_unregister_on: int | Iterable[int] | None = None,
        fail_populate_on: int | Iterable[int] | None = None,
        register_delay: float = 0.0,
        unregister_delay: float = 0.0,
        populate_delay: float = 0.0,
        lock_on_fault: bool = False,
    ) -> None:
        self.fail_register_on = _call_indices(fail_register_on, "fail_register_on")
        self.fail_unregister_on = _call_indices(fail_unregister_on, "fail_unregister_on")
        self.fail_populate_on = _call_indices(fail_populate_on, "fail_populate_on")
        delays = (("register_delay", register_delay), ("unregister_delay", unregister_delay),
                  ("populate_delay", populate_delay))  # fmt: skip
        for what, delay in delays:
            if not isinstance(delay, int | float) or isinstance(delay, bool) or delay < 0:
                raise ConfigError(f"{what}={delay!r} must be a non-negative number of seconds")
        self.register_delay = float(register_delay)
        self.unregister_delay = float(unregister_delay)
        self.populate_delay = float(populate_delay)
        if not isinstance(lock_on_fault, bool):
            raise ConfigError(f"lock_on_fault={lock_on_fault!r} must be True or False")
        if lock_on_fault:
            self.lock_on_fault = self._lock_on_fault
        self._book = RangeBook()
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []
        self.populate_calls: list[tuple[int, int]] = []
        self.events: list[tuple[str, int]] = []
        self.max_concurrent_registers = 0
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def registered(self) -> dict[int, int]:
        """Base → nbytes of every range registered now."""
        return self._book.snapshot()

    def register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self.register_calls.append((ptr, nbytes))
            self.events.append(("register", ptr))
            call = len(self.register_calls)
            self._in_flight += 1
            self.max_concurrent_registers = max(self.max_concurrent_registers, self._in_flight)
        try:
            if self.register_delay:
                time.sleep(self.register_delay)
            if call in self.fail_register_on:
                raise self._error("cudaHostRegister", _ALLOCATION_FAILED, ptr, nbytes,
                                  f"injected failure (FakeRuntime register call #{call})")  # fmt: skip
            overlap = self._book.add(ptr, nbytes)
            if overlap is not None:
                raise self._error("cudaHostRegister", _ALREADY_REGISTERED, ptr, nbytes,
                                  f"overlaps registered [{overlap[0]:#x}, +{overlap[1]})")  # fmt: skip
        finally:
            with self._lock:
                self._in_flight -= 1

    def _lock_on_fault(self, ptr: int, nbytes: int) -> None:
        self.register(ptr, nbytes)

    def populate(self, ptr: int, nbytes: int) -> None:
        """Stand-in for pre-faulting ``[ptr, +nbytes)``; touches nothing."""
        with self._lock:
            self.populate_calls.append((ptr, nbytes))
            self.events.append(("populate", ptr))
            call = len(self.populate_calls)
        if self.populate_delay:
            time.sleep(self.populate_delay)
        if call in self.fail_populate_on:
            raise RuntimeCallError(
                op="madvise(MADV_POPULATE_WRITE)", code=12, reason="ENOMEM", ptr=ptr, nbytes=nbytes,
                message=f"injected failure (FakeRuntime populate call #{call})",
            )  # fmt: skip

    def unregister(self, ptr: int) -> None:
        with self._lock:
            self.unregister_calls.append(ptr)
            self.events.append(("unregister", ptr))
            call = len(self.unregister_calls)
        if self.unregister_delay:
            time.sleep(self.unregister_delay)
        if call in self.fail_unregister_on:
            raise self._error("cudaHostUnregister", _ALLOCATION_FAILED, ptr, 0,
                              f"injected failure (FakeRuntime unregister call #{call})")  # fmt: skip
        if self._book.pop(ptr) is None:
            raise self._error("cudaHostUnregister", _NOT_REGISTERED, ptr, 0,
                              "not the base of a registered range")  # fmt: skip

    @staticmethod
    def _error(op: str, code_name: tuple[int, str], ptr: int, nbytes: int, message: str) -> RuntimeCallError:
        code, reason = code_name
        return RuntimeCallError(op=op, code=code, reason=reason, message=message, ptr=ptr, nbytes=nbytes)
