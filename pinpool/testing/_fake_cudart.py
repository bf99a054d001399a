"""FakeCudart: a stand-in for ``torch.cuda.cudart()`` that keeps CUDA's host-registration books.

Re-exported by :mod:`pinpool.testing`; see :class:`FakeCudart`.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from typing import Any

from .._errors import ConfigError
from .._ranges import RangeBook
from ..runtimes._gpu import CUDA, HIP, GpuApi
from ..runtimes._mlock import lock_range, unlock_range

__all__ = ["FakeCudart"]

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
_OPS = ("register", "unregister")

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
    """Stands in for ``torch.cuda.cudart()`` and for the runtime library torch loaded.

    It keeps the books CUDA keeps for host registration, by exact byte range: two
    registrations may share an OS page as long as no byte is in both; a register call that
    overlaps a registered range returns 712 (``cudaErrorHostMemoryAlreadyRegistered``; 1061
    under ``platform="rocm"``), an unregister of anything but the base of a live registration
    returns 713 (``cudaErrorHostMemoryNotRegistered``; 1062). A size of 0 returns 1
    (``cudaErrorInvalidValue``). Every failed call sets the calling thread's sticky last error,
    which :meth:`cudaGetLastError` returns and clears, as the runtime does.

    ``lock=True`` (default) really page-locks what is registered, with mlock (a page shared by
    neighbouring registrations, theirs or an MlockRuntime's, is counted and stays locked until
    its last holder goes), so ``VmLck`` in /proc/self/status moves as it would; a lock the
    kernel refuses (RLIMIT_MEMLOCK) returns 2 (``cudaErrorMemoryAllocation``) and registers
    nothing. ``lock=False`` keeps the books only, for addresses that are not this process's memory.

    Fault injection: :meth:`refuse_above` (a driver's per-call cap, as SGLang's degradation
    tests use) and :meth:`fail` (the next calls of one op, optionally only those matching a
    predicate). An injected failure registers nothing, or leaves the registration in place.

    Records: :attr:`registered` (base → nbytes, live), :attr:`calls` (every ``(op, ptr,
    nbytes, rc)``; unregister's nbytes is the registration's size, 0 when there was none).
    Thread-safe. Build pinpool's runtime on it with
    ``pinpool.runtimes.CudaRuntime.from_binding(FakeCudart())`` (``RocmRuntime`` for
    ``platform="rocm"``), or answer a server's own ``torch.cuda.cudart()`` with it.
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
        if op not in _OPS:
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
