"""MlockRuntime: real page-locking with Linux ``mlock``, pinpool's runtime for CPU-only hosts."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

from .. import _libc
from .._errors import RuntimeCallError
from .._ranges import RangeBook
from .._types import Capabilities
from .._units import format_bytes

__all__ = ["MlockRuntime", "mlock_error_message"]


class MlockRuntime:
    """Real page-locking with Linux ``mlock``/``munlock``, for CPU-only hosts.

    mlock is not CUDA pinning (a GPU copies from it at pageable speed), but it faults, locks
    and accounts pages against RLIMIT_MEMLOCK exactly as pinning does, so tests, demos and
    benchmarks on CPU hosts exercise the real kernel path.

    Capabilities: ``lock_on_fault`` (mlock2 MLOCK_ONFAULT, so pre-faulting also locks) and
    ``find_pinned`` (/proc/self/smaps). Locking is per page, not per byte range
    (``exact_ranges=False``), and no errno is worth retrying with a smaller chunk: the limit
    counts the whole pool, however it is split.
    """

    name = "mlock"
    capabilities = Capabilities(locks_on_fault=True, finds_pinned=True)

    def __init__(self) -> None:
        self._book = RangeBook()

    @property
    def registered(self) -> dict[int, int]:
        """Bases → sizes this runtime currently holds locked."""
        return self._book.snapshot()

    def register(self, ptr: int, nbytes: int) -> None:
        """mlock: fault in and lock every page of the range."""
        self._lock(ptr, nbytes, _libc.mlock, "mlock")

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        """mlock2(MLOCK_ONFAULT): lock the range's resident pages now and the rest as they are faulted in.

        Charged against RLIMIT_MEMLOCK in full at once, like mlock. PinnedPool uses it when it
        pre-faults: it registers each chunk this way first and then faults the chunk on several
        threads, so each page is faulted and locked in one pass.
        """
        self._lock(ptr, nbytes, _libc.mlock_on_fault, "mlock2(MLOCK_ONFAULT)")

    def _lock(self, ptr: int, nbytes: int, call: Callable[[int, int], int], op: str) -> None:
        overlap = self._book.add(ptr, nbytes)
        if overlap is not None:
            raise RuntimeCallError(
                op=op, code=errno.EEXIST, reason="EEXIST", ptr=ptr, nbytes=nbytes,
                message=f"range overlaps [{overlap[0]:#x}, +{overlap[1]}) already locked by this runtime",
            )  # fmt: skip
        err = call(ptr, nbytes)
        if err:
            self._book.pop(ptr)
            raise RuntimeCallError(
                op=op, code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
                message=mlock_error_message(err, nbytes),
            )  # fmt: skip

    def find_pinned(self, ptr: int, nbytes: int) -> str | None:
        """Describe memory in ``[ptr, ptr+nbytes)`` that is already locked (by anyone), or None."""
        return _locked_in_smaps(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        nbytes = self._book.pop(ptr)
        if nbytes is None:
            raise RuntimeCallError(
                op="munlock", code=errno.EINVAL, reason="EINVAL", ptr=ptr, nbytes=0,
                message="no range registered at this base (unregister takes the base of an earlier register)",
            )  # fmt: skip
        err = _libc.munlock(ptr, nbytes)
        if err:
            self._book.add(ptr, nbytes)  # still locked: keep it on the books
            raise RuntimeCallError(
                op="munlock", code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
                message=os.strerror(err),
            )  # fmt: skip


def _locked_in_smaps(ptr: int, nbytes: int) -> str | None:
    """The first mapping of this process overlapping the range with locked pages, per /proc/self/smaps."""
    end = ptr + nbytes
    current: tuple[int, int] | None = None
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    current = (lo, hi) if lo < end and ptr < hi else None
                elif current is not None and head == "Locked:" and int(line.split()[1]) > 0:
                    return f"[{current[0]:#x}, {current[1]:#x}) has {line.split()[1]} kB locked already"
    except OSError:
        return None
    return None


def mlock_error_message(err: int, nbytes: int) -> str:
    """What an mlock errno means for this process, with its limits, and what to do."""
    soft, hard = _libc.memlock_limits()
    cap = _libc.has_cap_ipc_lock()
    limits = (
        f"RLIMIT_MEMLOCK soft {_libc.format_rlimit(soft)}, hard {_libc.format_rlimit(hard)}; "
        f"CAP_IPC_LOCK {'present' if cap else 'absent'}"
    )
    raise_limit = (
        "raise the limit (`ulimit -l unlimited`; systemd `LimitMEMLOCK=infinity`; "
        "docker `--ulimit memlock=-1:-1`; /etc/security/limits.conf `memlock unlimited`) "
        "or grant the process CAP_IPC_LOCK"
    )
    if err == errno.ENOMEM:
        if cap or soft == _libc.RLIM_INFINITY:
            return (
                f"{os.strerror(err)}: the kernel could not lock {format_bytes(nbytes)} although the limit allows it "
                f"({limits}); the host is short of memory: make the pool smaller or free memory"
            )
        return (
            f"{os.strerror(err)}: locking {format_bytes(nbytes)} more would exceed the locked-memory limit "
            f"({limits}); "
            f"{raise_limit}"
        )
    if err == errno.EPERM:
        return f"{os.strerror(err)}: locking is not permitted ({limits}); {raise_limit}"
    if err == errno.EAGAIN:
        return (
            f"{os.strerror(err)}: some of the {format_bytes(nbytes)} could not be locked ({limits}); "
            f"if the limit is the cause, {raise_limit}; otherwise retry or make the pool smaller"
        )
    return f"{os.strerror(err)} ({limits})"
