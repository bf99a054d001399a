"""How pinning's runtime calls are sized (:class:`CallSizer`, the stall budget), cut on their buffer's
grid (:class:`RetrySplitter`) and paced (:class:`Pacer`). Pure policy, thread-safe. Why: docs/performance.md,
"background pinning and the stall budget", "under a CPU limit"."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from .chunks import Chunk

# Rates vary (a slower NUMA node, a reclaim pass): aiming at the budget itself would exceed it half the time.
TARGET_SHARE = 0.6
# The first call of a kind, before any rate is known: CUDA registers >= 4 GB/s, mlock faults >= 1 GB/s.
PROBE_BYTES = 16 << 20
MAX_GROWTH = 4  # per call: one fast call (a range faulted already) cannot produce a huge next one
WINDOW = 8  # the rate is the slowest of the last few calls (conservative, quick to follow a slowdown)
MIN_SAMPLE_BYTES = 1 << 20  # smaller calls measure per-call overhead, not the rate: not sampled


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
        """The next call's size: whole units, at least one, at most ``at_most`` (itself when below a unit)."""
        size = self.hint(unit, at_most)  # takes the lock itself
        with self._lock:
            self._last = size
        return size

    def hint(self, unit: int, at_most: int) -> int:
        """:meth:`next_bytes` without counting as a call (another kind may borrow this rate)."""
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
        # Never below what is sampled: smaller calls would never teach a better rate.
        want = max(want, MIN_SAMPLE_BYTES)
        return max(unit, min(want, at_most) // unit * unit)

    def record(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.longest = max(self.longest, seconds)
            if nbytes >= MIN_SAMPLE_BYTES and seconds > 0:
                self._recent.append(seconds / nbytes)


@dataclass(frozen=True)
class RetryGrid:
    """Where chunks of one buffer may be cut: ``origin + k * unit``, within ``[start, end)``."""

    start: int
    end: int
    unit: int
    origin: int


@dataclass(frozen=True)
class RetrySplitter:
    """Cuts on each buffer's grid: a failed chunk's halves for a retry (neither below ``floor_bytes``,
    min_chunk_bytes, or one unit), and the stall budget's first pieces."""

    grids: tuple[RetryGrid, ...]
    floor_bytes: int

    def split(self, chunk: Chunk) -> tuple[Chunk, Chunk] | None:
        grid = self._grid(chunk)
        if grid is None:
            return None
        floor = max(self.floor_bytes, grid.unit)
        if chunk.nbytes < 2 * floor:
            return None
        mid = chunk.offset + chunk.nbytes // 2
        cut = grid.origin + (mid - grid.origin) // grid.unit * grid.unit
        if cut - chunk.offset < floor:
            cut += grid.unit
        if cut - chunk.offset < floor or chunk.end - cut < floor:
            return None
        return Chunk(chunk.offset, cut - chunk.offset), Chunk(cut, chunk.end - cut)

    def first_piece(self, chunk: Chunk, at_most: int) -> Chunk:
        """The first piece of at most ``at_most`` bytes (one unit when less), or the whole chunk where no cut fits."""
        grid = self._grid(chunk)
        if grid is None or chunk.nbytes <= at_most:
            return chunk
        cut = grid.origin + (chunk.offset + at_most - grid.origin) // grid.unit * grid.unit
        if cut <= chunk.offset:
            cut = grid.origin + ((chunk.offset - grid.origin) // grid.unit + 1) * grid.unit
        return chunk if cut >= chunk.end else Chunk(chunk.offset, cut - chunk.offset)

    def unit_of(self, chunk: Chunk) -> int:
        """The cut unit of ``chunk``'s buffer (lcm(granularity, OS page)); its size where it has none."""
        grid = self._grid(chunk)
        return chunk.nbytes if grid is None else grid.unit

    def _grid(self, chunk: Chunk) -> RetryGrid | None:
        return next((g for g in self.grids if g.start <= chunk.offset < g.end), None)


MIN_DUTY = 0.1  # a tiny quota still pins, at a tenth of its time: a pin that never ends helps no one
MAX_REST = 0.25  # seconds: a longer call (no stall budget) rests no longer, so a stop is never held long


def duty_cycle(quota_cpus: float | None, *, background: bool) -> float:
    """The share of their time pin workers spend in calls: half the quota for a background pool under
    a quota below 2 CPUs, else 1 (no rest)."""
    if not background or quota_cpus is None or quota_cpus >= 2:
        return 1.0
    return max(MIN_DUTY, quota_cpus / 2)


class Pacer:
    """Makes each calling thread rest before its next call (never between a call and its books) so its
    calls use ``duty`` of its CPU time (``time.thread_time``: a worker preempted mid-call used no quota).
    ``clock`` (``thread_time`` and ``sleep``, the time module by default) lets a test script the clock."""

    def __init__(self, duty: float, clock: Any = time) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"duty={duty!r} must be in (0, 1]")
        self._duty = duty
        self._clock = clock
        self._thread = threading.local()

    def before(self) -> None:
        if self._duty == 1:  # no rest, nothing to remember
            return
        rest = getattr(self._thread, "owed", 0.0)
        if rest > 0:
            self._thread.owed = 0.0
            self._clock.sleep(rest)
        self._thread.started = self._clock.thread_time()

    def took(self, seconds: float) -> None:
        """A call ended after ``seconds`` (wall): owe the rest that makes its CPU time ``duty`` of both."""
        started = getattr(self._thread, "started", None)
        if started is not None:
            used = self._clock.thread_time() - started
            self._thread.owed = min(MAX_REST, max(0.0, used / self._duty - seconds))
