"""Bookkeeping of address ranges: sorted bases, overlap checks by bisection."""

from __future__ import annotations

import bisect
import threading


class RangeBook:
    """Registered bases → sizes, with CUDA's rules: no overlaps, unregister by base only.

    Bases are kept sorted, so an overlap check is a bisection, not a scan: a pool of 100k
    chunks must not cost O(n²) in bookkeeping. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: list[int] = []
        self._sizes: dict[int, int] = {}
        self._groups: dict[int, tuple[int, ...]] = {}  # the first base of a group → all its bases

    def _overlap(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(self._bases, ptr)
        if i and self._bases[i - 1] + self._sizes[self._bases[i - 1]] > ptr:
            base = self._bases[i - 1]
            return base, self._sizes[base]
        if i < len(self._bases) and self._bases[i] < ptr + max(nbytes, 1):
            base = self._bases[i]
            return base, self._sizes[base]
        return None

    def add(self, ptr: int, nbytes: int) -> tuple[int, int] | None:
        """Record ``[ptr, ptr+nbytes)``; returns the overlapping range instead if there is one."""
        with self._lock:
            overlap = self._overlap(ptr, nbytes)
            if overlap is None:
                bisect.insort(self._bases, ptr)
                self._sizes[ptr] = nbytes
            return overlap

    def add_all(self, ranges: list[tuple[int, int]]) -> tuple[int, int] | None:
        """Record sorted, disjoint ``(ptr, nbytes)`` ranges as one entry that ``pop(ranges[0][0])``
        removes whole (pin() of a strided view or of ranges=: the gaps stay free for other pools);
        returns the first overlapping range instead, recording none."""
        with self._lock:
            for ptr, nbytes in ranges:
                overlap = self._overlap(ptr, nbytes)
                if overlap is not None:
                    return overlap
            for ptr, nbytes in ranges:
                bisect.insort(self._bases, ptr)
                self._sizes[ptr] = nbytes
            if len(ranges) > 1:
                self._groups[ranges[0][0]] = tuple(ptr for ptr, _ in ranges)
            return None

    def pop(self, ptr: int) -> int | None:
        """Forget the range (or the group recorded by :meth:`add_all`) at ``ptr``; its bytes, or None."""
        with self._lock:
            total = None
            for base in self._groups.pop(ptr, (ptr,)):
                nbytes = self._sizes.pop(base, None)
                if nbytes is not None:
                    del self._bases[bisect.bisect_left(self._bases, base)]
                    total = (total or 0) + nbytes
            return total

    def get(self, ptr: int) -> int | None:
        """The size of the range whose base is ``ptr``, or None."""
        with self._lock:
            return self._sizes.get(ptr)

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self._sizes)


# Ranges pinned by pinpool in this process (pools and pinned tensors), so none is pinned twice.
PINNED_RANGES = RangeBook()
