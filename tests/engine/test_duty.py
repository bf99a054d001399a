"""A background pool's pin workers under a small CPU quota rest between calls (pinpool/_plan/calls.py):
the duty cycle the plan chooses, the rests the pacer takes, and a real pool that takes them."""

from __future__ import annotations

import threading
import time

import pytest

from pinpool._plan import MAX_REST, MIN_DUTY, Pacer, duty_cycle


def test_duty_cycle_is_half_a_quota_below_two_cpus_for_a_background_pool() -> None:
    assert duty_cycle(1.0, background=True) == 0.5
    assert duty_cycle(1.5, background=True) == 0.75
    assert duty_cycle(0.01, background=True) == MIN_DUTY  # a tiny quota still pins
    # A whole CPU can be left to the server: fewer workers do it, no rest.
    assert duty_cycle(2.0, background=True) == 1.0
    assert duty_cycle(None, background=True) == 1.0  # no quota
    assert duty_cycle(1.0, background=False) == 1.0  # nothing else runs while a foreground pool pins


def spin(seconds: float) -> None:
    """A call that uses ``seconds`` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class ScriptedClock:
    """The calling thread's CPU clock, moved by hand, and the rests the pacer asked for: the pacer's
    arithmetic checked exactly, not through sleeps a loaded host stretches."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.rests: list[float] = []

    def thread_time(self) -> float:
        return self.cpu

    def sleep(self, seconds: float) -> None:
        self.rests.append(seconds)


def test_the_pacer_rests_before_the_next_call_in_proportion_to_the_last_calls_cpu_time() -> None:
    clock = ScriptedClock()
    pacer = Pacer(0.5, clock)
    pacer.before()
    assert clock.rests == []  # nothing owed before the first call
    clock.cpu += 0.05
    pacer.took(0.05)  # a call on the CPU all its 0.05 s
    pacer.before()
    # Rested so the call's CPU time is half of call + rest: as long as the call.
    assert clock.rests == [pytest.approx(0.05)]
    pacer.took(0.1)  # a call that waited 0.1 s, using no CPU (preempted, or blocked): owes no rest
    pacer.before()
    assert clock.rests == [pytest.approx(0.05)]
    # A call that used 0.05 s of CPU in 0.08 s of wall time (preempted for 0.03 s) rests 0.02 s:
    # 0.05 of CPU in 0.1 s is duty 0.5 already counting the time it waited.
    clock.cpu += 0.05
    pacer.took(0.08)
    pacer.before()
    assert clock.rests == [pytest.approx(0.05), pytest.approx(0.02)]


def test_the_pacer_really_rests() -> None:
    """The same with the real clocks: a call that spun 0.05 s of CPU time is followed by a rest."""
    pacer = Pacer(0.5)
    pacer.before()
    wall, cpu = time.perf_counter(), time.thread_time()
    spin(0.05)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    pacer.took(wall)
    started = time.perf_counter()
    pacer.before()
    assert time.perf_counter() - started >= max(0.0, 2 * cpu - wall) - 0.01  # a loaded host only adds


def test_each_thread_owes_its_own_rest_and_a_rest_is_bounded() -> None:
    pacer = Pacer(0.1)
    pacer.before()
    spin(0.1)
    pacer.took(0.1)  # owes 1 - 0.1 = 0.9 s at duty 0.1: capped, so a stop is never held long
    rested: list[float] = []

    def other() -> None:
        started = time.perf_counter()
        pacer.before()  # this thread made no call: it owes nothing
        rested.append(time.perf_counter() - started)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert rested[0] < 0.01
    started = time.perf_counter()
    pacer.before()
    assert MAX_REST * 0.9 <= time.perf_counter() - started < MAX_REST + 0.5


def test_duty_one_never_rests() -> None:
    pacer = Pacer(1.0)
    pacer.before()
    spin(0.05)
    pacer.took(0.05)
    started = time.perf_counter()
    pacer.before()
    assert time.perf_counter() - started < 0.01
    with pytest.raises(ValueError, match="duty=0"):
        Pacer(0)
