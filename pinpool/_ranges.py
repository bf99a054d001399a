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

    def pop(self, ptr: int) -> int | None:
        with self._lock:
            nbytes = self._sizes.pop(ptr, None)
            if nbytes is not None:
                del self._bases[bisect.bisect_left(self._bases, ptr)]
            return nbytes

    def get(self, ptr: int) -> int | None:
        """The size of the range whose base is ``ptr``, or None."""
        with self._lock:
            return self._sizes.get(ptr)

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self._sizes)


# Ranges pinned by pinpool in this process (pools and pinned tensors), so none is pinned twice.
PINNED_RANGES = RangeBook()
