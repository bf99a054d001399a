"""Test helpers for pinpool and for code built on it (docs/testing.md is the guide): a pinning runtime
that pins nothing (:class:`FakeRuntime`), a stand-in for ``torch.cuda.cudart()`` (:class:`FakeCudart`),
a hand-made host (:func:`host_facts`), leak checks, and :func:`auto_runtime`, which makes
``runtime="auto"`` a test's fake for a server that builds its pool itself.
"""

from __future__ import annotations

import dataclasses
import errno
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

from ._errors import ConfigError, RuntimeCallError
from ._host import libc as _libc
from ._pin.outcome import PoolState
from ._plan.facts import HostFacts
from ._ranges import PINNED_RANGES, RangeBook
from ._types import Capabilities, MemoryReading, PsiLine, PsiReading, RegistrarLimits
from ._units import parse_size
from .runtimes._gpu import CUDA, HIP, GpuApi
from .runtimes._mlock import lock_range, page_span, unlock_range
from .runtimes._registry import auto_runtime

if TYPE_CHECKING:
    from ._pool.pool import PinnedPool

__all__ = [
    "CallHook",
    "FakeCudart",
    "FakePressure",
    "FakeRegistrar",
    "FakeRuntime",
    "assert_released",
    "auto_runtime",
    "host_facts",
    "locked_bytes",
]

# CUDA's codes, so code written against the fake sees what it would see on a GPU host.
_ALLOCATION_FAILED = (2, "cudaErrorMemoryAllocation")
_ALREADY_REGISTERED = (712, "cudaErrorHostMemoryAlreadyRegistered")
_NOT_REGISTERED = (713, "cudaErrorHostMemoryNotRegistered")
_ENOMEM = 12
_POPULATE_OP = "madvise(MADV_POPULATE_WRITE)"

_OPS = ("register", "unregister", "populate")

CallHook = Callable[[str, int, int], None]
"""``hook(op, ptr, nbytes)``: op is ``"populate"``, ``"register"`` or ``"unregister"`` (nbytes 0)."""


def _call_indices(value: int | Iterable[int] | None, what: str) -> frozenset[int]:
    if value is None:
        return frozenset()
    indices = frozenset([value]) if isinstance(value, int) else frozenset(value)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 1 for i in indices):
        raise ConfigError(f"{what}={value!r}: call indices are 1-based ints (an int or a set of them)")
    return indices


class FakeRuntime:
    """A thread-safe stand-in for a pinning runtime that keeps CUDA's books and rules and records every
    call, with fault injection; docs/testing.md (FakeRuntime) has the options and the books."""

    name = "fake"

    def __init__(
        self,
        *,
        fail_register_on: int | Iterable[int] | None = None,
        fail_unregister_on: int | Iterable[int] | None = None,
        fail_populate_on: int | Iterable[int] | None = None,
        fail_register_larger_than: int | str | None = None,
        register_delay: float = 0.0,
        unregister_delay: float = 0.0,
        populate_delay: float = 0.0,
        lock_on_fault: bool = False,
        exact_ranges: bool = True,
        before_call: CallHook | None = None,
        after_call: CallHook | None = None,
    ) -> None:
        self.fail_register_on = _call_indices(fail_register_on, "fail_register_on")
        self.fail_unregister_on = _call_indices(fail_unregister_on, "fail_unregister_on")
        self.fail_populate_on = _call_indices(fail_populate_on, "fail_populate_on")
        cap = fail_register_larger_than
        self.fail_register_larger_than = None if cap is None else parse_size(cap, what="fail_register_larger_than")
        for op, delay in zip(_OPS, (register_delay, unregister_delay, populate_delay), strict=True):
            if not isinstance(delay, int | float) or isinstance(delay, bool) or delay < 0:
                raise ConfigError(f"{op}_delay={delay!r} must be a non-negative number of seconds")
        self.register_delay = float(register_delay)
        self.unregister_delay = float(unregister_delay)
        self.populate_delay = float(populate_delay)
        for what, flag in (("lock_on_fault", lock_on_fault), ("exact_ranges", exact_ranges)):
            if not isinstance(flag, bool):
                raise ConfigError(f"{what}={flag!r} must be True or False")
        self.capabilities = Capabilities(
            populates=True,
            locks_on_fault=lock_on_fault,
            exact_ranges=exact_ranges,
            retryable_codes=frozenset({2}),
            not_registered_codes=frozenset({_NOT_REGISTERED[0]}),
            resident=False,  # it touches no memory: the pre-flight charges nothing, so tests may plan any size
        )
        for what, hook in (("before_call", before_call), ("after_call", after_call)):
            if hook is not None and not callable(hook):
                raise ConfigError(f"{what}={hook!r} must be None or a callable hook(op, ptr, nbytes)")
        self.before_call = before_call
        self.after_call = after_call
        self._book = RangeBook()
        self._pages = None if exact_ranges else RangeBook()  # page-rounded ranges, for exact_ranges=False
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[int] = []
        self.populate_calls: list[tuple[int, int]] = []
        self.events: list[tuple[str, int]] = []
        self.max_concurrent_registers = 0
        self._in_flight = 0
        self._fail_next = dict.fromkeys(_OPS, 0)
        self._lock = threading.Lock()

    @property
    def registered(self) -> dict[int, int]:
        """Base → nbytes of every range registered now."""
        return self._book.snapshot()

    def fail_next(self, k: int, op: str = "register") -> None:
        """Make the next ``k`` calls of ``op`` fail (register and unregister with 2, populate with
        ENOMEM), whichever thread makes them; replaces what is pending for ``op``, ``k=0`` disarms."""
        if op not in _OPS:
            raise ConfigError(f"op={op!r} is not a FakeRuntime call; choose one of {', '.join(map(repr, _OPS))}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"k={k!r} must be a non-negative int (the number of {op} calls to fail)")
        with self._lock:
            self._fail_next[op] = k

    def _start(self, op: str, ptr: int, nbytes: int, calls: list[Any], fail_on: frozenset[int]) -> tuple[int, str]:
        """Book a call, then wait its delay: its 1-based index, and the injected failure's source ("": none)."""
        with self._lock:
            calls.append((ptr, nbytes) if op != "unregister" else ptr)
            self.events.append((op, ptr))
            call, armed = len(calls), self._fail_next[op] > 0
            self._fail_next[op] -= armed
            if op == "register":
                self._in_flight += 1
                self.max_concurrent_registers = max(self.max_concurrent_registers, self._in_flight)
        delay = getattr(self, f"{op}_delay")
        if delay:
            time.sleep(delay)
        return call, "FakeRuntime " if call in fail_on else "FakeRuntime.fail_next, " if armed else ""

    def _around(self, op: str, ptr: int, nbytes: int, call: Callable[[], None]) -> None:
        """``before_call`` may prevent the call; ``after_call`` runs whether it failed or not."""
        before = self.before_call
        if before is not None:
            before(op, ptr, nbytes)
        try:
            call()
        finally:
            after = self.after_call
            if after is not None:
                after(op, ptr, nbytes)

    def register(self, ptr: int, nbytes: int) -> None:
        self._around("register", ptr, nbytes, lambda: self._register(ptr, nbytes))

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:  # used when lock_on_fault=True declares it
        self.register(ptr, nbytes)

    def populate(self, ptr: int, nbytes: int) -> None:  # touches nothing
        self._around("populate", ptr, nbytes, lambda: self._populate(ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self._around("unregister", ptr, 0, lambda: self._unregister(ptr))

    def _register(self, ptr: int, nbytes: int) -> None:
        try:
            call, how = self._start("register", ptr, nbytes, self.register_calls, self.fail_register_on)
            if how:
                raise self._error("cudaHostRegister", _ALLOCATION_FAILED, ptr, nbytes,
                                  f"injected failure ({how}register call #{call})")  # fmt: skip
            cap = self.fail_register_larger_than
            if cap is not None and nbytes > cap:
                raise self._error("cudaHostRegister", _ALLOCATION_FAILED, ptr, nbytes,
                                  f"injected failure: {nbytes} bytes is over the fake driver's per-call cap of "
                                  f"{cap} (FakeRuntime fail_register_larger_than)")  # fmt: skip
            overlap = self._book.add(ptr, nbytes)
            if overlap is not None:
                raise self._error("cudaHostRegister", _ALREADY_REGISTERED, ptr, nbytes,
                                  f"overlaps registered [{overlap[0]:#x}, +{overlap[1]})")  # fmt: skip
            if self._pages is not None:
                lo, hi = page_span(ptr, nbytes)
                shared = self._pages.add(lo, hi - lo)
                if shared is not None:
                    self._book.pop(ptr)
                    raise self._error("cudaHostRegister", _ALREADY_REGISTERED, ptr, nbytes,
                                      f"shares an OS page with registered pages [{shared[0]:#x}, +{shared[1]}) "
                                      "(FakeRuntime(exact_ranges=False) pins whole pages)")  # fmt: skip
        finally:
            with self._lock:
                self._in_flight -= 1

    def _populate(self, ptr: int, nbytes: int) -> None:
        call, how = self._start("populate", ptr, nbytes, self.populate_calls, self.fail_populate_on)
        if how:
            raise RuntimeCallError(
                op=_POPULATE_OP, code=_ENOMEM, reason="ENOMEM", ptr=ptr, nbytes=nbytes,
                message=f"Cannot allocate memory: injected failure ({how}populate call #{call}); "
                "the host is probably short of memory",
            )  # fmt: skip

    def _unregister(self, ptr: int) -> None:
        call, how = self._start("unregister", ptr, 0, self.unregister_calls, self.fail_unregister_on)
        if how:
            raise self._error("cudaHostUnregister", _ALLOCATION_FAILED, ptr, 0,
                              f"injected failure ({how}unregister call #{call})")  # fmt: skip
        if self._book.pop(ptr) is None:
            raise self._error("cudaHostUnregister", _NOT_REGISTERED, ptr, 0,
                              "not the base of a registered range")  # fmt: skip
        if self._pages is not None:
            self._pages.pop(page_span(ptr, 1)[0])

    @staticmethod
    def _error(op: str, code: tuple[int, str], ptr: int, nbytes: int, message: str) -> RuntimeCallError:
        return RuntimeCallError(op=op, code=code[0], reason=code[1], message=message, ptr=ptr, nbytes=nbytes)


_NO_REGISTRATION = (404, "NotRegistered")  # FakeRegistrar's answer to an unregister of nothing


class FakeRegistrar:
    """A thread-safe stand-in for a transfer engine (``registrars=``) that keeps books of what it holds and
    records every call, with fault injection: ``fail_register_on`` / ``fail_unregister_on`` (1-based call
    indices answer a typed error: nothing done), ``raise_on_register`` (indices that raise a plain
    ``RuntimeError`` *after* registering: pinpool must undo it), delays, and ``before_call(op, ptr, nbytes)``."""

    def __init__(
        self, name: str = "fake-engine", *, max_bytes: int | None = None, preferred_bytes: int | None = None,
        page_table_entries: int | None = None, parallel: bool = True,
        fail_register_on: int | Iterable[int] | None = None, fail_unregister_on: int | Iterable[int] | None = None,
        raise_on_register: int | Iterable[int] | None = None, register_delay: float = 0.0,
        unregister_delay: float = 0.0, before_call: CallHook | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.limits = RegistrarLimits(
            max_bytes=max_bytes, preferred_bytes=preferred_bytes, page_table_entries=page_table_entries,
            not_registered_codes=frozenset({_NO_REGISTRATION[0]}), parallel=parallel,
        )  # fmt: skip
        self.fail_register_on = _call_indices(fail_register_on, "fail_register_on")
        self.fail_unregister_on = _call_indices(fail_unregister_on, "fail_unregister_on")
        self.raise_on_register = _call_indices(raise_on_register, "raise_on_register")
        self.register_delay, self.unregister_delay = float(register_delay), float(unregister_delay)
        self.before_call = before_call
        self._book = RangeBook()
        self._handles: dict[int, object] = {}
        self.register_calls: list[tuple[int, int]] = []
        self.unregister_calls: list[tuple[int, int]] = []
        self.events: list[tuple[str, int]] = []
        self.max_concurrent = 0
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def registered(self) -> dict[int, int]:
        """Base → nbytes of every range it holds now."""
        return self._book.snapshot()

    def _start(self, op: str, ptr: int, nbytes: int, calls: list[tuple[int, int]]) -> int:
        if self.before_call is not None:
            self.before_call(op, ptr, nbytes)
        with self._lock:
            calls.append((ptr, nbytes))
            self.events.append((op, ptr))
            self._in_flight += 1
            self.max_concurrent = max(self.max_concurrent, self._in_flight)
        delay = self.register_delay if op == "register" else self.unregister_delay
        if delay:
            time.sleep(delay)
        return len(calls)

    def _error(self, op: str, code: tuple[int, str], ptr: int, nbytes: int, message: str) -> RuntimeCallError:
        return RuntimeCallError(op=op, code=code[0], reason=code[1], message=message, ptr=ptr, nbytes=nbytes)

    def register(self, ptr: int, nbytes: int) -> object:
        try:
            call = self._start("register", ptr, nbytes, self.register_calls)
            if call in self.fail_register_on:
                raise self._error("register", (5, "Injected"), ptr, nbytes, f"injected failure (register call #{call})")
            overlap = self._book.add(ptr, nbytes)
            if overlap is not None:
                raise self._error("register", (17, "Overlaps"), ptr, nbytes, f"overlaps held {overlap}")
            handle = self._handles[ptr] = ("fake-handle", self.name, call)
            if call in self.raise_on_register:
                raise RuntimeError(f"injected untyped failure after registering (register call #{call})")
            return handle
        finally:
            with self._lock:
                self._in_flight -= 1

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        try:
            call = self._start("unregister", ptr, nbytes, self.unregister_calls)
            if call in self.fail_unregister_on:
                raise self._error("unregister", (5, "Injected"), ptr, nbytes, f"injected failure (unregister #{call})")
            held = self._book.get(ptr)
            if held is None:
                raise self._error("unregister", _NO_REGISTRATION, ptr, nbytes, "nothing is registered there")
            if held != nbytes or (handle is not None and self._handles.get(ptr) != handle):
                given = f"holds {held} B, handle {self._handles.get(ptr)!r}; given {nbytes} B, {handle!r}"
                raise self._error("unregister", (22, "Mismatch"), ptr, nbytes, given)
            self._book.pop(ptr)
            self._handles.pop(ptr, None)
        finally:
            with self._lock:
                self._in_flight -= 1


_HOST = HostFacts(
    cpus=8, page_size=4096, huge_page_size=2 << 20, thp_mode="madvise", populate_write=True, memlock_soft=None,
    memlock_hard=None, cap_ipc_lock=True, cgroup_memory_limit=None, mem_available=64 << 30, hugetlb_free=0,
    hugetlb_total=0, numa_nodes=(0,), address_space_bytes=1 << 47, torch_cuda=None, torch_hip=None,
    nvidia_driver=False, amd_kfd=False,
)  # fmt: skip


def host_facts(**changes: Any) -> HostFacts:
    """The healthy Linux host above (64 GiB available, one NUMA node, no GPU driver) with ``changes``
    (HostFacts fields), for planning and pre-flight tests that must not depend on the machine."""
    return dataclasses.replace(_HOST, **changes)


def locked_bytes() -> int:
    """This process's locked memory (``VmLck`` in /proc/self/status), in bytes."""
    return _libc.vm_locked_bytes()


def assert_released(
    pool: PinnedPool,
    fake: FakeRuntime | None = None,
    *,
    claims_before: Mapping[int, int] | None = None,
    locked_before: int | None = None,
    timeout: float = 5.0,
) -> None:
    """Assert that ``pool`` is closed and left nothing behind: ``fake`` (when given) holds nothing; the
    range claims are ``claims_before`` (without it: none holds a range ``fake`` registered); no thread
    ``pinpool-<name>...`` outlives ``timeout``; with ``locked_before``, VmLck is back to it."""
    if fake is not None:
        assert fake.registered == {}, f"still registered: {fake.registered}"
    claims = PINNED_RANGES.snapshot()
    if claims_before is not None:
        assert claims == claims_before, "a range claim left behind"
    elif fake is not None:
        held = [(b, n) for b, n in claims.items() if any(b <= ptr < b + n for ptr, _ in fake.register_calls)]
        assert not held, f"range claims left behind: {held}"
    assert pool.state is PoolState.CLOSED, f"pool {pool.name!r} is {pool.state.value}"
    prefix = f"pinpool-{pool.name}"

    def alive() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == prefix or t.name.startswith(prefix + "-")]

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.002)
    assert not alive(), f"pinpool threads still alive: {alive()}"
    if locked_before is not None:
        assert locked_bytes() == locked_before, f"VmLck is {locked_bytes()} bytes, was {locked_before}"


# -- FakeCudart ---------------------------------------------------------------------------------------

_APIS: dict[str, GpuApi] = {"cuda": CUDA, "rocm": HIP}
# Per platform: (already registered, not registered, out of memory, invalid value).
_CODES: dict[str, tuple[int, int, int, int]] = {"cuda": (712, 713, 2, 1), "rocm": (1061, 1062, 2, 1)}
# What the runtimes' cudaGetErrorString answers (CUDA's and HIP's texts are the same for these).
_TEXTS: dict[int, str] = {
    0: "no error",
    1: "invalid argument",
    2: "out of memory",
    **dict.fromkeys((712, 1061), "part or all of the requested memory range is already mapped"),
    **dict.fromkeys((713, 1062), "pointer does not correspond to a registered memory region"),
}
# What each library's GetErrorName answers for a code it does not know.
_UNKNOWN_NAME = {"cuda": b"unrecognized error code", "rocm": b"hipErrorUnknown"}
_UNKNOWN_TEXT = {"cuda": "unrecognized error code", "rocm": "unknown error"}
_CUDART_OPS = ("register", "unregister")

When = Callable[[int, int], bool]


@dataclasses.dataclass(frozen=True, slots=True)
class _ErrorValue:
    """What ``cudaError(code)`` gives: a value ``cudaGetErrorString`` accepts (torch's is a pybind11 enum)."""

    value: int

    def __post_init__(self) -> None:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            raise TypeError(f"cudaError({self.value!r}): an error code is an int")

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"cudaError({self.value})"


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()`` and the runtime library torch loaded, thread-safe; with
    ``lock=True`` it really locks pages (docs/testing.md, FakeCudart). An injected failure changes no books."""

    def __init__(self, *, platform: str = "cuda", lock: bool = True) -> None:
        if platform not in _APIS:
            raise ConfigError(f"platform={platform!r} is not one of 'cuda', 'rocm' (whose error codes the fake uses)")
        if not isinstance(lock, bool):
            raise ConfigError(f"lock={lock!r} must be True (mlock what is registered) or False (books only)")
        self.platform = platform
        self.lock = lock
        self._api = _APIS[platform]
        self._already, self._not_registered, self._oom, self._invalid = _CODES[platform]
        self._book = RangeBook()
        self._calls: list[tuple[str, int, int, int]] = []
        self._cap: tuple[int, int] | None = None  # refuse_above: (nbytes, rc)
        self._faults: list[tuple[str, int, int, When | None, bool]] = []  # op, rc, times left, when, applied
        self._sticky = threading.local()
        self._mutex = threading.Lock()

    def __repr__(self) -> str:
        return f"FakeCudart(platform={self.platform!r}, lock={self.lock})"

    @property
    def cudaError(self) -> Callable[[int], Any]:  # as torch's binding's enum
        return _ErrorValue

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        with self._mutex:  # held across the mlock: the books and the locks agree for every observer
            rc, applied = self._injected("register", ptr, nbytes)
            if not rc or applied:
                rc = self._register(ptr, nbytes) or rc
            return self._record("register", ptr, nbytes, rc)

    def cudaHostUnregister(self, ptr: int) -> int:
        with self._mutex:
            nbytes = self._book.get(ptr) or 0
            rc, applied = self._injected("unregister", ptr, nbytes)
            if not rc or applied:
                rc = self._unregister(ptr) or rc
            return self._record("unregister", ptr, nbytes, rc)

    def cudaGetErrorString(self, error: Any) -> str:
        return _TEXTS.get(int(error), _UNKNOWN_TEXT[self.platform])

    def cudaGetLastError(self) -> int:  # the calling thread's sticky last error, cleared
        code: int = getattr(self._sticky, "code", 0)
        self._sticky.code = 0
        return code

    def cudaGetErrorName(self, code: int) -> bytes:
        known = self._api.errors.get(int(code))
        return known[0].encode() if known else _UNKNOWN_NAME[self.platform]

    # The same calls under HIP's names, so the fake also stands in for libamdhip64 (library=fake).
    hipGetLastError = cudaGetLastError
    hipGetErrorName = cudaGetErrorName

    @property
    def registered(self) -> dict[int, int]:
        """Base → nbytes of every live registration (a copy)."""
        with self._mutex:
            return self._book.snapshot()

    @property
    def calls(self) -> list[tuple[str, int, int, int]]:
        """Every call so far, ``(op, ptr, nbytes, rc)`` with op ``"register"`` or ``"unregister"`` (a copy)."""
        with self._mutex:
            return list(self._calls)

    def refuse_above(self, nbytes: int, rc: int = 1) -> None:
        """Every later register call for more than ``nbytes`` returns ``rc`` (a driver's per-call cap)."""
        _check_count(nbytes, "nbytes", minimum=0)
        _check_code(rc)
        with self._mutex:
            self._cap = (nbytes, rc)

    def fail(self, op: str, rc: int, *, times: int = 1, when: When | None = None, applied: bool = False) -> None:
        """The next ``times`` calls of ``op`` for which ``when(ptr, nbytes)`` holds (``None``: every call)
        return ``rc``; a call takes the first matching rule, in the order given. ``applied=True``: the
        call does its work first (a code left by earlier asynchronous work, as CUDA documents)."""
        if op not in _CUDART_OPS:
            raise ConfigError(f"op={op!r} is not a FakeCudart call; choose 'register' or 'unregister'")
        _check_code(rc)
        _check_count(times, "times", minimum=1)
        if when is not None and not callable(when):
            raise ConfigError(f"when={when!r} must be None or a callable when(ptr, nbytes) -> bool")
        if not isinstance(applied, bool):
            raise ConfigError(f"applied={applied!r} must be True or False")
        with self._mutex:
            self._faults.append((op, rc, times, when, applied))

    def _injected(self, op: str, ptr: int, nbytes: int) -> tuple[int, bool]:
        """The code to answer, and whether the call does its work anyway."""
        for i, (fault_op, rc, left, when, applied) in enumerate(self._faults):
            if fault_op == op and (when is None or when(ptr, nbytes)):
                if left > 1:
                    self._faults[i] = (fault_op, rc, left - 1, when, applied)
                else:
                    del self._faults[i]
                return rc, applied
        if op == "register" and self._cap is not None and nbytes > self._cap[0]:
            return self._cap[1], False
        return 0, False

    def _register(self, ptr: int, nbytes: int) -> int:
        if nbytes <= 0 or ptr <= 0:
            return self._invalid
        if self._book.add(ptr, nbytes) is not None:
            return self._already
        if self.lock:
            err = lock_range(ptr, nbytes)
            if err:
                self._book.pop(ptr)
                return self._invalid if err == errno.EINVAL else self._oom
        return 0

    def _unregister(self, ptr: int) -> int:
        nbytes = self._book.pop(ptr)
        if nbytes is None:
            return self._not_registered
        if self.lock and unlock_range(ptr, nbytes):
            self._book.add(ptr, nbytes)  # still locked: still registered
            return self._invalid
        return 0

    def _record(self, op: str, ptr: int, nbytes: int, rc: int) -> int:
        self._calls.append((op, ptr, nbytes, rc))
        if rc:
            self._sticky.code = rc
        return rc


def _check_code(rc: object) -> None:
    if isinstance(rc, bool) or not isinstance(rc, int) or rc <= 0:
        raise ConfigError(f"rc={rc!r} must be a positive int error code (0 is success)")


def _check_count(value: object, what: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what}={value!r} must be an int of at least {minimum}")


class FakePressure:
    """A pressure source for an elastic pool's policy loop (``PinnedPool(..., pressure=FakePressure())``): it
    reads what the test last :meth:`set` (at first: no pressure, nothing known), and each :meth:`set` wakes
    the loop at once; :meth:`fail_reads` makes reads raise ``error`` (None: read again). ``closed`` tells
    whether the loop let go of it."""

    def __init__(self) -> None:
        self._lock, self._signal = threading.Lock(), threading.Event()
        self._reading, self._error = MemoryReading(), cast("Exception | None", None)
        self.reads = 0
        self.closed = False

    @staticmethod
    def reading(psi: float | None = None, *, used: int | None = None, limit: int | None = None) -> MemoryReading:
        """A reading: PSI ``some`` avg10 ``psi`` (percent), a cgroup v2 using ``used`` of ``limit`` bytes."""
        line = None if psi is None else PsiReading("fake", PsiLine(psi, psi, psi, 0), None)
        return MemoryReading(psi=line, cgroup_version=None if used is None else 2, usage_bytes=used, limit_bytes=limit)

    def set(self, reading: MemoryReading) -> None:
        with self._lock:
            self._reading = reading
        self._signal.set()

    def fail_reads(self, error: Exception | None) -> None:
        with self._lock:
            self._error = error
        self._signal.set()

    def describe(self) -> str:
        return "pinpool.testing.FakePressure"

    def read(self) -> MemoryReading:
        with self._lock:
            self.reads += 1
            if self._error is not None:
                raise self._error
            return self._reading

    def wait(self, timeout: float) -> str | None:
        fired = self._signal.wait(timeout)
        self._signal.clear()
        return "fake" if fired else None

    def wake(self) -> None:
        self._signal.set()

    def close(self) -> None:
        self.closed = True
