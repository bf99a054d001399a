"""The stall budget: how many bytes the next runtime call may take so it stays within a time.

A registration call holds the CUDA driver lock (every other CUDA call of the process waits)
and under mlock the process's ``mmap_lock`` (every mmap, munmap and page-table change
waits); a populate call holds ``mmap_lock`` for reading, which a waiting writer turns into a
stall for everyone. A server already serving feels the longest such call. With
``max_call_seconds`` set, each call is sized from the rate the previous calls of its kind
achieved, so none should exceed the budget, while calls stay as large as the budget allows
(throughput is lost per call, not per byte).

Pure and thread-safe; the engine asks :meth:`CallSizer.next_bytes` before each call and tells
:meth:`CallSizer.record` after it.
"""

from __future__ import annotations

import threading
from collections import deque

# Calls aim at this share of the budget: rates vary from call to call (a slower NUMA node,
# a reclaim pass), and an estimate taken at the budget itself would exceed it half the time.
TARGET_SHARE = 0.6
# The first call of a kind, before any rate is known: small enough for any realistic budget
# on any runtime (CUDA registers >= 4 GB/s, mlock faults >= 1 GB/s: 16 MiB is <= 16 ms).
PROBE_BYTES = 16 << 20
# A size may grow at most this much from one call to the next, so one fast call (a range
# that happened to be faulted already) cannot produce a huge next call.
MAX_GROWTH = 4
# The rate is the slowest of the last few calls (conservative, and quick to follow a slowdown).
WINDOW = 8
# Smaller calls say more about per-call overhead than about the rate: not sampled.
MIN_SAMPLE_BYTES = 1 << 20


class CallSizer:
    """Sizes of the next calls of one kind (e.g. "register") under a budget of ``seconds``."""

    def __init__(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"seconds={seconds!r} must be positive")
        self.seconds = seconds
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=WINDOW)  # seconds per byte of recent calls
        self._last = 0
        self.longest = 0.0

    def next_bytes(self, unit: int, at_most: int) -> int:
        """The next call's size: a multiple of ``unit`` (at least one), at most ``at_most``
        (whole units of it; ``at_most`` itself when it is below one unit)."""
        size = self.hint(unit, at_most)
        with self._lock:
            self._last = size
        return size

    def hint(self, unit: int, at_most: int) -> int:
        """What :meth:`next_bytes` would answer now, without counting as a call (another kind of
        call may borrow this kind's rate: see the engine's lock-on-fault pieces)."""
        if at_most <= unit:
            return at_most
        with self._lock:
            if self._recent:
                # Compared as a float first: a huge budget over a fast rate is past any int (inf).
                estimate = self.seconds * TARGET_SHARE / max(self._recent)
                want = int(estimate) if estimate < at_most else at_most
                if self._last:
                    want = min(want, self._last * MAX_GROWTH)
            else:
                want = PROBE_BYTES
        # Never below what is sampled: calls that small would never teach a better rate, and a
        # fixed per-call cost would shrink them for good.
        want = max(want, MIN_SAMPLE_BYTES)
        return max(unit, min(want, at_most) // unit * unit)

    def record(self, nbytes: int, seconds: float) -> None:
        """A call of ``nbytes`` took ``seconds``."""
        with self._lock:
            self.longest = max(self.longest, seconds)
            if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
                self._recent.append(seconds / nbytes)
