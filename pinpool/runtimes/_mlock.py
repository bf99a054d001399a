"""MlockRuntime: real page-locking with Linux ``mlock``, pinpool's runtime for CPU-only hosts."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import errno
import itertools
import os
import threading
from collections.abc import Callable, Iterator

from .._errors import RAISE_MEMLOCK, RuntimeCallError
from .._host import libc as _libc
from .._ranges import RangeBook
from .._types import Capabilities
from .._units import format_bytes


class _SharedPages:
    """Holders of each OS page registrations share, process-wide: mlock counts nothing (``munlock``
    unlocks every page it touches), so a shared page is locked by its first holder, unlocked by its last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # held across the page's own mlock/munlock: count and lock agree
        self._holders: dict[int, int] = {}

    def hold(self, pages: tuple[int, ...], call: Callable[[int, int], int]) -> int:
        """One more holder of each page, locking those that had none; 0, or undo and return the errno."""
        page_size = _libc.PAGE_SIZE
        with self._lock:
            held: list[int] = []
            for page in pages:
                if not self._holders.get(page):
                    err = call(page, page_size)
                    if err:
                        _libc.munlock(page, page_size)  # a failed mlock may have locked it (see lock_range)
                        self._drop(held)
                        return err
                self._holders[page] = self._holders.get(page, 0) + 1
                held.append(page)
        return 0

    def release(self, pages: tuple[int, ...]) -> int:
        """One holder less of each page, unlocking the last; 0, or a munlock's errno (nothing counted down)."""
        with self._lock:
            for page in pages:
                if self._holders.get(page, 0) <= 1:
                    err = _libc.munlock(page, _libc.PAGE_SIZE)
                    if err:
                        return err
            self._drop(pages, unlock=False)
        return 0

    def _drop(self, pages: list[int] | tuple[int, ...], *, unlock: bool = True) -> None:
        """Under the lock: one holder less of each page; unlock (best effort) those left with none."""
        for page in pages:
            count = self._holders.get(page, 0) - 1
            if count > 0:
                self._holders[page] = count
                continue
            self._holders.pop(page, None)
            if unlock:
                _libc.munlock(page, _libc.PAGE_SIZE)

    def holders(self, page: int) -> int:
        with self._lock:
            return self._holders.get(page, 0)


SHARED_PAGES = _SharedPages()


class _OwnLocks:
    """The pages every MlockRuntime here holds locked, to tell pinpool's locks from foreign ones in
    /proc/self/smaps: recorded before locking, forgotten after unlocking (a :meth:`scan` keeps those)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranges: dict[tuple[int, int], int] = {}  # page-rounded [lo, hi) -> how many registrations
        self._scans: dict[int, list[tuple[int, int]]] = {}  # a running scan -> ranges forgotten since it began
        self._scan_ids = itertools.count()

    def add(self, lo: int, hi: int) -> None:
        with self._lock:
            self._ranges[lo, hi] = self._ranges.get((lo, hi), 0) + 1

    def remove(self, lo: int, hi: int) -> None:
        with self._lock:
            count = self._ranges.get((lo, hi), 0) - 1
            if count > 0:
                self._ranges[lo, hi] = count
            else:
                self._ranges.pop((lo, hi), None)
            for forgotten in self._scans.values():
                forgotten.append((lo, hi))

    @contextlib.contextmanager
    def scan(self) -> Iterator[Callable[[], _Pages]]:
        """Yields ``owned()``: at the end of a read, the pages pinpool held at any moment since the scan began."""
        forgotten: list[tuple[int, int]] = []
        with self._lock:
            key = next(self._scan_ids)
            self._scans[key] = forgotten
        try:

            def owned() -> _Pages:
                with self._lock:  # copied under the lock, merged outside it: a pool may hold 100k ranges
                    ranges = [*self._ranges, *forgotten]
                return _Pages(ranges)

            yield owned
        finally:
            with self._lock:
                del self._scans[key]


class _Pages:
    """A union of address ranges, merged and sorted, to ask how much of a mapping it covers."""

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self._los = [lo for lo, _ in merged]
        self._his = [hi for _, hi in merged]

    def bytes_in(self, lo: int, hi: int) -> int:  # each byte once
        total = 0
        i = max(0, bisect.bisect_right(self._los, lo) - 1)
        while i < len(self._los) and self._los[i] < hi:
            total += max(0, min(hi, self._his[i]) - max(lo, self._los[i]))
            i += 1
        return total

    def covers(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self._los, lo) - 1
        return i >= 0 and self._his[i] >= hi


OWN_LOCKS = _OwnLocks()


def _forget_in_child() -> None:
    """A forked child holds none of its parent's mlocks: empty books, new locks."""
    _SharedPages.__init__(SHARED_PAGES)
    _OwnLocks.__init__(OWN_LOCKS)


os.register_at_fork(after_in_child=_forget_in_child)


def page_span(ptr: int, nbytes: int) -> tuple[int, int]:
    """``[ptr, +nbytes)`` rounded out to whole OS pages: every page a registration of it locks or shares."""
    page = _libc.PAGE_SIZE
    return ptr - ptr % page, -(-(ptr + max(nbytes, 1)) // page) * page


def _pages_of(ptr: int, nbytes: int) -> tuple[tuple[int, ...], int, int]:
    """``[ptr, +nbytes)`` as the pages it covers in part (their bases) and its whole pages ``[lo, hi)``."""
    if nbytes <= 0:
        return (), ptr, ptr
    page = _libc.PAGE_SIZE
    end = ptr + nbytes
    partial: list[int] = []
    if ptr % page:
        partial.append(ptr - ptr % page)
    if end % page and end - end % page not in partial:
        partial.append(end - end % page)
    lo = -(-ptr // page) * page
    hi = end - end % page
    return tuple(partial), lo, max(lo, hi)


def lock_range(ptr: int, nbytes: int, call: Callable[[int, int], int] = _libc.mlock) -> int:
    """Lock ``[ptr, +nbytes)`` with ``call`` (mlock or mlock2): whole pages in one call, shared ones through
    :data:`SHARED_PAGES`. 0, or an errno after which nothing stays locked (a failed mlock may lock part)."""
    partial, lo, hi = _pages_of(ptr, nbytes)
    err = call(lo, hi - lo) if hi > lo else 0  # the whole pages: this registration's alone
    if not err:
        err = SHARED_PAGES.hold(partial, call)  # the pages it shares (or may share)
    if err and hi > lo:
        _libc.munlock(lo, hi - lo)
    return err


def unlock_range(ptr: int, nbytes: int) -> int:
    """Undo :func:`lock_range`; 0, or the errno of a munlock that failed."""
    partial, lo, hi = _pages_of(ptr, nbytes)
    err = _libc.munlock(lo, hi - lo) if hi > lo else 0
    return err or SHARED_PAGES.release(partial)


class MlockRuntime:
    """Real page-locking with Linux ``mlock``/``munlock`` for CPU-only hosts: not CUDA pinning (a GPU copies
    from it at pageable speed), but it faults, locks and charges RLIMIT_MEMLOCK as pinning does."""

    name = "mlock"
    # Nothing retries smaller (the limit counts the whole pool); EINVAL: no range at this base (munlock's: wrap-around).
    capabilities = Capabilities(
        locks_on_fault=True, finds_pinned=True, exact_ranges=True, charges_memlock=True,
        not_registered_codes=frozenset({errno.EINVAL}),
    )  # fmt: skip

    def __init__(self) -> None:
        self._book = RangeBook(per_process=True)

    @property
    def registered(self) -> dict[int, int]:  # bases → sizes held locked now
        return self._book.snapshot()

    def register(self, ptr: int, nbytes: int) -> None:
        self._lock(ptr, nbytes, _libc.mlock, "mlock")

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        """mlock2(MLOCK_ONFAULT): the populate threads fault and lock each page in one pass."""
        self._lock(ptr, nbytes, _libc.mlock_on_fault, "mlock2(MLOCK_ONFAULT)")

    def _lock(self, ptr: int, nbytes: int, call: Callable[[int, int], int], op: str) -> None:
        if (overlap := self._book.add(ptr, nbytes)) is not None:
            raise RuntimeCallError(
                op=op, code=errno.EEXIST, reason="EEXIST", ptr=ptr, nbytes=nbytes,
                message=f"range overlaps [{overlap[0]:#x}, +{overlap[1]}) already locked by this runtime",
            )  # fmt: skip
        OWN_LOCKS.add(*page_span(ptr, nbytes))  # before any page is locked: smaps never sees it unowned
        if err := lock_range(ptr, nbytes, call):
            OWN_LOCKS.remove(*page_span(ptr, nbytes))
            self._book.pop(ptr)
            raise RuntimeCallError(
                op=op, code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
                message=mlock_error_message(err, nbytes),
            )  # fmt: skip

    def find_pinned(self, ptr: int, nbytes: int) -> str | None:
        """Memory in the range locked by someone else than pinpool, or None."""
        return _locked_in_smaps(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        nbytes = self._book.pop(ptr)
        if nbytes is None:
            raise RuntimeCallError(
                op="munlock", code=errno.EINVAL, reason="EINVAL", ptr=ptr, nbytes=0,
                message="no range registered at this base (unregister takes the base of an earlier register)",
            )  # fmt: skip
        if err := unlock_range(ptr, nbytes):
            self._book.add(ptr, nbytes)  # still (partly) locked: keep it on the books
            raise RuntimeCallError(
                op="munlock", code=err, reason=_libc.errno_name(err), ptr=ptr, nbytes=nbytes,
                message=os.strerror(err),
            )  # fmt: skip
        OWN_LOCKS.remove(*page_span(ptr, nbytes))  # after the unlock: smaps never sees it unowned


def _locked_in_smaps(ptr: int, nbytes: int) -> str | None:
    """The first mapping overlapping the range with more ``Locked:`` than pinpool's own pages, or ``lo``
    in ``VmFlags`` beyond them, per /proc/self/smaps (a foreign lock of a page pinpool holds is unseen)."""
    end = ptr + nbytes
    mappings: list[_Mapping] = []
    current: _Mapping | None = None
    with OWN_LOCKS.scan() as owned:
        try:
            with open("/proc/self/smaps") as smaps:
                for line in smaps:
                    head, _, rest = line.partition(" ")
                    if "-" in head and not head.endswith(":"):
                        lo, hi = (int(x, 16) for x in head.split("-"))
                        current = _Mapping(lo, hi) if lo < end and ptr < hi else None
                        if current is not None:
                            mappings.append(current)
                    elif current is None:
                        continue
                    elif head == "Locked:":
                        current.locked_kb = int(rest.split()[0])
                    elif head == "VmFlags:":
                        current.locked_flag = "lo" in rest.split()
        except OSError:
            return None
        ours = owned()  # at the end of the read: covers every page pinpool held locked during it
    for mapping in mappings:
        lo, hi = mapping.lo, mapping.hi
        own_kb = ours.bytes_in(lo, hi) // 1024
        if mapping.locked_kb > own_kb:
            by_us = f", {own_kb} kB of it by pinpool" if own_kb else ""
            return f"[{lo:#x}, {hi:#x}) has {mapping.locked_kb} kB locked already{by_us}"
        if mapping.locked_flag and not ours.covers(lo, hi):
            return f"[{lo:#x}, {hi:#x}) is locked already (VmFlags lo), not all of it by pinpool"
    return None


@dataclasses.dataclass
class _Mapping:
    lo: int
    hi: int
    locked_kb: int = 0
    locked_flag: bool = False


def mlock_error_message(err: int, nbytes: int) -> str:
    """What an mlock errno means for this process, with its limits, and what to do."""
    soft, hard = _libc.memlock_limits()
    cap = _libc.has_cap_ipc_lock()
    limits = (
        f"RLIMIT_MEMLOCK soft {_libc.format_rlimit(soft)}, hard {_libc.format_rlimit(hard)}; "
        f"CAP_IPC_LOCK {'present' if cap else 'absent'}"
    )
    if err == errno.ENOMEM:
        if cap or soft == _libc.RLIM_INFINITY:
            return (
                f"{os.strerror(err)}: the kernel could not lock {format_bytes(nbytes)} although the limit allows it "
                f"({limits}); the host is short of memory: make the pool smaller or free memory"
            )
        return (
            f"{os.strerror(err)}: locking {format_bytes(nbytes)} more would exceed the locked-memory limit "
            f"({limits}); {RAISE_MEMLOCK}"
        )
    if err == errno.EPERM:
        return f"{os.strerror(err)}: locking is not permitted ({limits}); {RAISE_MEMLOCK}"
    if err == errno.EAGAIN:
        return (
            f"{os.strerror(err)}: some of the {format_bytes(nbytes)} could not be locked ({limits}); "
            f"if the limit is the cause, {RAISE_MEMLOCK}; otherwise retry or make the pool smaller"
        )
    return f"{os.strerror(err)} ({limits})"
