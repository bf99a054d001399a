"""Bookkeeping of address ranges: sorted bases, overlap checks by bisection."""

from __future__ import annotations

import bisect
import math
import os
import threading
import weakref


class RangeBook:
    """Registered bases → sizes, with CUDA's rules: no overlaps, unregister by base only. Thread-safe.
    Bases are sorted (an overlap check is a bisection); every change is one store, so an exception
    between two statements (a Ctrl-C) never leaves it half-changed. ``per_process``: a forked child's
    copy starts empty (pins and mlocks are not inherited)."""

    def __init__(self, *, per_process: bool = False) -> None:
        self._lock = threading.Lock()
        # (base, size, group) sorted by base; group: on an add_all set's first base, every base of the set.
        self._ranges: list[tuple[int, int, tuple[int, ...]]] = []
        if per_process:
            _PER_PROCESS.add(self)

    def _forget(self) -> None:
        # A new lock too: a thread of the parent may have held this one at the fork, and is gone.
        self._lock = threading.Lock()
        self._ranges = []

    def _find(self, ptr: int) -> int:  # the index of the entry whose base is ptr, or -1
        i = bisect.bisect_left(self._ranges, (ptr,))
        return i if i < len(self._ranges) and self._ranges[i][0] == ptr else -1

    def _overlap(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        ranges = self._ranges
        i = bisect.bisect_right(ranges, (ptr, math.inf))
        if i and ranges[i - 1][0] + ranges[i - 1][1] > ptr:
            return ranges[i - 1][0], ranges[i - 1][1]
        if i < len(ranges) and ranges[i][0] < ptr + max(nbytes, 1):
            return ranges[i][0], ranges[i][1]
        return None

    def add(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """Record ``[ptr, ptr+nbytes)``; returns the overlapping range instead if there is one."""
        with self._lock:
            overlap = self._overlap(ptr, nbytes)
            if overlap is None:
                bisect.insort(self._ranges, (ptr, nbytes, ()))
            return overlap

    def add_all(self, ranges: list[tuple[int, int]]) -> tuple[int, int] | None:
        """Record sorted, disjoint ranges as one group that ``pop(ranges[0][0])`` removes whole (pin() of
        a strided view or ranges=); returns the first overlapping range instead, recording none."""
        with self._lock:
            for ptr, nbytes in ranges:
                overlap = self._overlap(ptr, nbytes)
                if overlap is not None:
                    return overlap
            group = tuple(ptr for ptr, _ in ranges) if len(ranges) > 1 else ()
            entries = [(ptr, nbytes, group if i == 0 else ()) for i, (ptr, nbytes) in enumerate(ranges)]
            self._ranges = sorted(self._ranges + entries)
            return None

    def pop(self, ptr: int) -> int | None:
        """Forget the range (or the group recorded by :meth:`add_all`) at ``ptr``; its bytes, or None."""
        with self._lock:
            i = self._find(ptr)
            if i < 0:
                return None
            _, nbytes, group = self._ranges[i]
            if not group:
                del self._ranges[i]
                return nbytes
            members = set(group)
            total = sum(entry[1] for entry in self._ranges if entry[0] in members)
            self._ranges = [entry for entry in self._ranges if entry[0] not in members]
            return total

    def get(self, ptr: int) -> int | None:
        with self._lock:
            i = self._find(ptr)
            return None if i < 0 else self._ranges[i][1]

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return {base: nbytes for base, nbytes, _ in self._ranges}


_PER_PROCESS: weakref.WeakSet[RangeBook] = weakref.WeakSet()


def _forget_in_child() -> None:
    for book in list(_PER_PROCESS):
        book._forget()


os.register_at_fork(after_in_child=_forget_in_child)

# Ranges pinned by pinpool in this process (pools and pinned tensors), so none is pinned twice.
PINNED_RANGES = RangeBook(per_process=True)
