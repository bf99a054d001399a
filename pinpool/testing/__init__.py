"""Test helpers for pinpool and for code built on it.

:class:`FakeRuntime` registers nothing for real; it keeps the books CUDA would keep, fails
on request, and records every call, so you can test failure, rollback and cancellation
paths of your own server without a GPU or locked memory::

    fake = FakeRuntime(fail_register_on=3)
    with pytest.raises(pinpool.PinError):
        with pinpool.PinnedPool(size="1GiB", chunk_bytes="128MiB", runtime=fake, max_retries=0):
            ...
    assert fake.registered == {}

Injected register failures report code 2, which the fake declares retryable as CUDA does, so
a pool would retry a failed chunk of two alignment units or more as halves, down to one; pass
``max_retries=0`` to test the plain failure path, or keep retries on to test them.

:class:`FakeCudart` stands in for ``torch.cuda.cudart()`` instead: it keeps CUDA's
registration books (712, 713, the sticky last error) and really locks pages, so pinpool's own
CUDA runtime code (``CudaRuntime.from_binding(FakeCudart())``) and a server's own pinning code
run on CPU side by side (see docs/testing.md).

:func:`host_facts` builds a hand-made host for planning tests; :func:`assert_released` checks a
closed pool left nothing behind; :func:`locked_bytes` reads this process's locked memory.
"""

from __future__ import annotations

import dataclasses
import errno
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._errors import ConfigError, RuntimeCallError
from .._host import libc as _libc
from .._host.facts import HostFacts
from .._ranges import PINNED_RANGES, RangeBook
from .._types import Capabilities
from .._units import parse_size
from ..runtimes._gpu import CUDA, HIP, GpuApi
from ..runtimes._mlock import lock_range, unlock_range

if TYPE_CHECKING:
    from .._pool.pool import PinnedPool

__all__ = ["CallHook", "FakeCudart", "FakeRuntime", "assert_released", "host_facts", "locked_bytes"]

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


def _check_hook(hook: object, what: str) -> None:
    if hook is not None and not callable(hook):
        raise ConfigError(f"{what}={hook!r} must be None or a callable hook(op, ptr, nbytes)")


class FakeRuntime:
    """A thread-safe stand-in for a pinning runtime, with fault injection (docs/testing.md has the tables).

    ``fail_register_on`` / ``fail_unregister_on`` / ``fail_populate_on``: 1-based indices (an int
    or a set) of the calls that fail, counted over this runtime's lifetime; :meth:`fail_next`
    fails the next ``k`` calls of one op, whenever they come. ``fail_register_larger_than``: a
    size over which register calls fail, as a driver's per-call cap does. ``*_delay``: seconds
    each call sleeps, outside the lock, so concurrent calls really overlap.

    CUDA's rules: registering over a registered byte fails with 712, unregistering anything but
    a registered base with 713; injected failures report 2 (retryable, as on CUDA; populate:
    ENOMEM); a failed register leaves nothing registered, a failed unregister leaves it
    registered. ``exact_ranges=False`` books whole pages instead (as ROCm is treated), so a
    register sharing an OS page with a registered one fails with 712. ``lock_on_fault=True``
    declares ``locks_on_fault`` (as mlock): chunks are registered before they are faulted.
    Populate touches no memory and ``resident`` is False, so the pre-flight charges nothing.

    ``before_call`` / ``after_call``: None or ``hook(op, ptr, nbytes)`` (nbytes 0 for
    unregister), run in the calling thread outside the lock around every call; ``before_call``
    runs before the call is recorded (raising, it prevents the call), ``after_call`` once the
    books are updated, failed or not (raising after a successful register, it leaves the range
    registered, as an interrupt just after the driver returned would). Plain attributes.

    Books: ``registered`` (base → nbytes), ``register_calls`` / ``populate_calls`` (every
    ``(ptr, nbytes)`` asked, failed ones included), ``unregister_calls`` (every ptr),
    ``events`` (``(op, ptr)`` in the order calls started), ``max_concurrent_registers``.
    """

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
        self.fail_register_larger_than = (
            None
            if fail_register_larger_than is None
            else parse_size(fail_register_larger_than, what="fail_register_larger_than")
        )
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
        if not isinstance(exact_ranges, bool):
            raise ConfigError(f"exact_ranges={exact_ranges!r} must be True or False")
        self.capabilities = Capabilities(
            populates=True,
            locks_on_fault=lock_on_fault,
            exact_ranges=exact_ranges,
            retryable_codes=frozenset({2}),
            not_registered_codes=frozenset({_NOT_REGISTERED[0]}),
            resident=False,  # it touches no memory: the pre-flight charges nothing, so tests may plan any size
        )
        _check_hook(before_call, "before_call")
        _check_hook(after_call, "after_call")
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
        """Make the next ``k`` calls of ``op`` fail, counted from now, whichever thread makes them.

        ``op``: ``"register"`` (lock-on-fault calls included) or ``"unregister"``, failing with
        ``cudaErrorMemoryAllocation`` (2), or ``"populate"``, failing with ENOMEM (12). Replaces
        what is still pending for that op; ``k=0`` disarms it.
        """
        if op not in _OPS:
            raise ConfigError(f"op={op!r} is not a FakeRuntime call; choose one of {', '.join(map(repr, _OPS))}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ConfigError(f"k={k!r} must be a non-negative int (the number of {op} calls to fail)")
        with self._lock:
            self._fail_next[op] = k

    def _take_fail_next(self, op: str) -> bool:
        """Under the lock: whether this call is one of the armed ones."""
        if self._fail_next[op]:
            self._fail_next[op] -= 1
            return True
        return False

    def _around(self, op: str, ptr: int, nbytes: int, call: Callable[[], None]) -> None:
        """Run ``call`` between the hooks, in the order the class docstring promises."""
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

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        """Register the range before it is faulted; used when ``lock_on_fault=True`` declares it."""
        self.register(ptr, nbytes)

    def populate(self, ptr: int, nbytes: int) -> None:
        """Stand-in for pre-faulting ``[ptr, +nbytes)``; touches nothing."""
        self._around("populate", ptr, nbytes, lambda: self._populate(ptr, nbytes))

    def unregister(self, ptr: int) -> None:
        self._around("unregister", ptr, 0, lambda: self._unregister(ptr))

    def _register(self, ptr: int, nbytes: int) -> None:
        with self._lock:
            self.register_calls.append((ptr, nbytes))
            self.events.append(("register", ptr))
            call = len(self.register_calls)
            armed = self._take_fail_next("register")
            self._in_flight += 1
            self.max_concurrent_registers = max(self.max_concurrent_registers, self._in_flight)
        try:
            if self.register_delay:
                time.sleep(self.register_delay)
            if call in self.fail_register_on:
                raise self._error("cudaHostRegister", _ALLOCATION_FAILED, ptr, nbytes,
                                  f"injected failure (FakeRuntime register call #{call})")  # fmt: skip
            if armed:
                raise self._error("cudaHostRegister", _ALLOCATION_FAILED, ptr, nbytes,
                                  f"injected failure (FakeRuntime.fail_next, register call #{call})")  # fmt: skip
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
                lo, hi = _page_extent(ptr, nbytes)
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
        with self._lock:
            self.populate_calls.append((ptr, nbytes))
            self.events.append(("populate", ptr))
            call = len(self.populate_calls)
            armed = self._take_fail_next("populate")
        if self.populate_delay:
            time.sleep(self.populate_delay)
        if call in self.fail_populate_on or armed:
            how = "FakeRuntime.fail_next, " if call not in self.fail_populate_on else "FakeRuntime "
            raise RuntimeCallError(
                op=_POPULATE_OP, code=_ENOMEM, reason="ENOMEM", ptr=ptr, nbytes=nbytes,
                message=f"Cannot allocate memory: injected failure ({how}populate call #{call}); "
                "the host is probably short of memory",
            )  # fmt: skip

    def _unregister(self, ptr: int) -> None:
        with self._lock:
            self.unregister_calls.append(ptr)
            self.events.append(("unregister", ptr))
            call = len(self.unregister_calls)
            armed = self._take_fail_next("unregister")
        if self.unregister_delay:
            time.sleep(self.unregister_delay)
        if call in self.fail_unregister_on or armed:
            how = "FakeRuntime.fail_next, " if call not in self.fail_unregister_on else "FakeRuntime "
            raise self._error("cudaHostUnregister", _ALLOCATION_FAILED, ptr, 0,
                              f"injected failure ({how}unregister call #{call})")  # fmt: skip
        if self._book.pop(ptr) is None:
            raise self._error("cudaHostUnregister", _NOT_REGISTERED, ptr, 0,
                              "not the base of a registered range")  # fmt: skip
        if self._pages is not None:
            self._pages.pop(_page_extent(ptr, 1)[0])

    @staticmethod
    def _error(op: str, code_name: tuple[int, str], ptr: int, nbytes: int, message: str) -> RuntimeCallError:
        code, reason = code_name
        return RuntimeCallError(op=op, code=code, reason=reason, message=message, ptr=ptr, nbytes=nbytes)


def _page_extent(ptr: int, nbytes: int) -> tuple[int, int]:
    """``[ptr, +nbytes)`` rounded out to whole OS pages."""
    page = _libc.PAGE_SIZE
    return ptr - ptr % page, -(-(ptr + max(nbytes, 1)) // page) * page


_HOST = HostFacts(
    cpus=8, page_size=4096, huge_page_size=2 << 20, thp_mode="madvise", populate_write=True, memlock_soft=None,
    memlock_hard=None, cap_ipc_lock=True, cgroup_memory_limit=None, mem_available=64 << 30, hugetlb_free=0,
    hugetlb_total=0, numa_nodes=(0,), address_space_bytes=1 << 47, torch_cuda=None, torch_hip=None,
    nvidia_driver=False, amd_kfd=False,
)  # fmt: skip


def host_facts(**changes: Any) -> HostFacts:
    """A healthy Linux host, with ``changes`` (HostFacts fields): 8 CPUs, 4 KiB pages, THP on
    madvise, MADV_POPULATE_WRITE, CAP_IPC_LOCK, no memory cgroup, 64 GiB available, one NUMA
    node, no hugetlb pages, no GPU driver. For planning and pre-flight tests that must not
    depend on the machine they run on."""
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
    """Assert that ``pool`` is closed and left nothing behind.

    Checks that ``fake`` (when given) has nothing registered; that pinpool's process-wide claims
    are ``claims_before`` (the claims before the test; without it, that no claim holds a range the
    fake was asked to register); that the pool is closed; that none of its threads
    (``pinpool-<name>...``) is alive, waiting up to ``timeout`` seconds for one that is returning;
    and, with ``locked_before`` (:func:`locked_bytes` before the pool), that VmLck is back to it.
    """
    if fake is not None:
        assert fake.registered == {}, f"still registered: {fake.registered}"
    claims = PINNED_RANGES.snapshot()
    if claims_before is not None:
        assert claims == claims_before, "a range claim left behind"
    elif fake is not None:
        held = [(b, n) for b, n in claims.items() if any(b <= ptr < b + n for ptr, _ in fake.register_calls)]
        assert not held, f"range claims left behind: {held}"
    assert pool.state.value == "closed", f"pool {pool.name!r} is {pool.state.value}"
    prefix = f"pinpool-{pool.name}"

    def alive() -> list[str]:
        names = (t.name for t in threading.enumerate())
        return [n for n in names if n == prefix or n.startswith(prefix + "-")]

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
    712: "part or all of the requested memory range is already mapped",
    713: "pointer does not correspond to a registered memory region",
    1061: "part or all of the requested memory range is already mapped",
    1062: "pointer does not correspond to a registered memory region",
}
# What each library's GetErrorName answers for a code it does not know.
_UNKNOWN_NAME = {"cuda": b"unrecognized error code", "rocm": b"hipErrorUnknown"}
_UNKNOWN_TEXT = {"cuda": "unrecognized error code", "rocm": "unknown error"}
_CUDART_OPS = ("register", "unregister")

When = Callable[[int, int], bool]


class _ErrorValue:
    """What ``cudaError(code)`` gives: a value ``cudaGetErrorString`` accepts (torch's is a pybind11 enum)."""

    __slots__ = ("value",)

    def __init__(self, code: int) -> None:
        if isinstance(code, bool) or not isinstance(code, int):
            raise TypeError(f"cudaError({code!r}): an error code is an int")
        self.value = code

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ErrorValue) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"cudaError({self.value})"


class FakeCudart:
    """Stands in for ``torch.cuda.cudart()`` and for the runtime library torch loaded (docs/testing.md).

    CUDA's books, by exact byte range: registering over a registered byte returns 712 (1061 under
    ``platform="rocm"``), unregistering anything but a live base 713 (1062), a size of 0 returns 1;
    every failed call sets the calling thread's sticky last error (:meth:`cudaGetLastError`).
    ``lock=True`` (default) really mlocks what is registered, so VmLck moves as it would (a page
    shared with a neighbour, its or an MlockRuntime's, stays locked until its last holder goes); a
    lock the kernel refuses returns 2 and registers nothing. ``lock=False`` keeps the books only.
    Faults: :meth:`refuse_above` (a per-call cap) and :meth:`fail`; an injected failure changes no
    books. Records: :attr:`registered`, :attr:`calls`. Thread-safe. Use it as
    ``CudaRuntime.from_binding(FakeCudart())`` or to answer a server's own ``torch.cuda.cudart()``.
    """

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
        self._faults: list[tuple[str, int, int, When | None]] = []  # op, rc, times left, when
        self._sticky = threading.local()
        self._mutex = threading.Lock()

    def __repr__(self) -> str:
        return f"FakeCudart(platform={self.platform!r}, lock={self.lock})"

    # -- the binding -------------------------------------------------------------------------------

    @property
    def cudaError(self) -> Callable[[int], Any]:
        """``code -> value`` accepted by :meth:`cudaGetErrorString`, as torch's binding's enum."""
        return _ErrorValue

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        with self._mutex:  # held across the mlock: the books and the locks agree for every observer
            rc = self._injected("register", ptr, nbytes)
            if not rc:
                rc = self._register(ptr, nbytes)
            return self._record("register", ptr, nbytes, rc)

    def cudaHostUnregister(self, ptr: int) -> int:
        with self._mutex:
            nbytes = self._book.get(ptr) or 0
            rc = self._injected("unregister", ptr, nbytes)
            if not rc:
                rc = self._unregister(ptr)
            return self._record("unregister", ptr, nbytes, rc)

    def cudaGetErrorString(self, error: Any) -> str:
        code = int(error)
        return _TEXTS.get(code, _UNKNOWN_TEXT[self.platform])

    # -- the library (libcudart / libamdhip64) -----------------------------------------------------

    def cudaGetLastError(self) -> int:
        """The calling thread's sticky last error, cleared (0 when there is none)."""
        code: int = getattr(self._sticky, "code", 0)
        self._sticky.code = 0
        return code

    def cudaGetErrorName(self, code: int) -> bytes:
        """The code's name (``cudaErrorMemoryAllocation``), or what the library answers for a code it does not know."""
        known = self._api.errors.get(int(code))
        return known[0].encode() if known else _UNKNOWN_NAME[self.platform]

    # The same calls under HIP's names, so the fake also stands in for libamdhip64 (library=fake).
    hipGetLastError = cudaGetLastError
    hipGetErrorName = cudaGetErrorName

    # -- books and fault injection ---------------------------------------------------------------

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

    def fail(self, op: str, rc: int, *, times: int = 1, when: When | None = None) -> None:
        """The next ``times`` calls of ``op`` (``"register"`` or ``"unregister"``) for which
        ``when(ptr, nbytes)`` is true (every call, for ``when=None``) return ``rc``. Rules are kept
        in the order given; a call takes the first that matches."""
        if op not in _CUDART_OPS:
            raise ConfigError(f"op={op!r} is not a FakeCudart call; choose 'register' or 'unregister'")
        _check_code(rc)
        _check_count(times, "times", minimum=1)
        if when is not None and not callable(when):
            raise ConfigError(f"when={when!r} must be None or a callable when(ptr, nbytes) -> bool")
        with self._mutex:
            self._faults.append((op, rc, times, when))

    # -- under the mutex ---------------------------------------------------------------------------

    def _injected(self, op: str, ptr: int, nbytes: int) -> int:
        for i, (fault_op, rc, left, when) in enumerate(self._faults):
            if fault_op == op and (when is None or when(ptr, nbytes)):
                if left > 1:
                    self._faults[i] = (fault_op, rc, left - 1, when)
                else:
                    del self._faults[i]
                return rc
        if op == "register" and self._cap is not None and nbytes > self._cap[0]:
            return self._cap[1]
        return 0

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
