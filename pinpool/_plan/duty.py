"""The duty cycle of a background pool's pin workers under a small CPU quota.

A background pool leaves its server one CPU of the budget (:func:`pinpool._plan.plan.pool_cpus`), but
under a CPU quota below 2 CPUs there is no whole CPU to leave: the one pin worker would spend
the quota as fast as the server, and once the cgroup has spent its quota for the period the
kernel stops every thread in it, the serving threads included, until the next period (a
throttled period; ``cpu.stat``'s ``nr_throttled``). So there each pin worker rests before its
next call, in proportion to the length of its last, and together use half the quota at most: a 1-CPU quota
pins at half a CPU, and the server keeps the other half without a throttled period.

Resting costs pin time in proportion (a 1-CPU quota: at most twice as long) and nothing where
the quota allows a whole CPU to be left. Calls are short (a background pool's stall budget,
50 ms by default), so a rest is too, and a stop waits for at most one rest (:data:`MAX_REST`).
"""

from __future__ import annotations

import threading
import time

__all__ = ["MAX_REST", "MIN_DUTY", "Pacer", "duty_cycle"]

MIN_DUTY = 0.1  # a tiny quota still pins, at a tenth of its time: a pin that never ends helps no one
MAX_REST = 0.25  # seconds: a longer call (no stall budget) rests no longer, so a stop is never held long


def duty_cycle(quota_cpus: float | None, *, background: bool) -> float:
    """The share of their time a pool's pin workers may spend in calls: 1 (no rest) unless the
    pool pins in the background under a quota below 2 CPUs, where it is half the quota."""
    if not background or quota_cpus is None or quota_cpus >= 2:
        return 1.0
    return max(MIN_DUTY, quota_cpus / 2)


class Pacer:
    """Makes each thread that calls rest before its next call, so its calls use ``duty`` of its
    time. A call is charged by the CPU time its thread spent in it (``time.thread_time``: user and
    system, the faulting included), not by its wall time: a worker preempted mid-call (other work
    on the host, or its nice value) used no quota meanwhile, so the rest is what makes the call's
    CPU time ``duty`` of the call and the rest together (``used / duty - wall``), never more.
    The rest is taken before the next call, not right after a call, so a rest never sits between
    a call and the books that record it."""

    def __init__(self, duty: float) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"duty={duty!r} must be in (0, 1]")
        self._duty = duty
        self._thread = threading.local()

    def before(self) -> None:
        """Rest what the calling thread's last call left owing (nothing before its first)."""
        if self._duty == 1:  # no rest, nothing to remember
            return
        rest = getattr(self._thread, "owed", 0.0)
        if rest > 0:
            self._thread.owed = 0.0
            time.sleep(rest)
        self._thread.started = time.thread_time()

    def took(self, seconds: float) -> None:
        """A call of the calling thread ended after ``seconds`` (wall time): its next call first
        rests so that the CPU time this one used is ``duty`` of the call and the rest together."""
        started = getattr(self._thread, "started", None)
        if started is not None:
            used = time.thread_time() - started
            self._thread.owed = min(MAX_REST, max(0.0, used / self._duty - seconds))
