"""Whatever Python raises inside pinpool's own teardown code, the pool ends CLOSED or a later close()
finishes it: a signal handler's TimeoutError at random moments, a MemoryError right after the
teardown begins, no stack left. Children run in subprocesses (a regression could hang), with timeouts."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from .. import preloaded
from ..conftest import lifecycle_of, needs_mlock
from ..depth import depth, runs

# A child prints one JSON line last: {"states": [...], "caught": {...}, "registered": n, "claims": n, "vmlck": n}
REPORT = textwrap.dedent(
    """
    import gc, json
    from pinpool._host import libc
    from pinpool._ranges import PINNED_RANGES

    def report(pools, caught, fakes=()):
        for pool in pools:  # a later close() finishes whatever a raise left
            if pool.state.value != "closed":
                pool.close()
        gc.collect()
        print(json.dumps({
            "states": sorted({pool.state.value for pool in pools}), "caught": caught,
            "registered": sum(len(fake.registered) for fake in fakes), "claims": len(PINNED_RANGES.snapshot()),
            "vmlck": libc.vm_locked_bytes(),
        }), flush=True)
    """
)

ALARMS = REPORT + textwrap.dedent(
    """
    import random, signal, sys, time
    import pinpool
    from pinpool.testing import FakeRuntime

    runtime, runs = sys.argv[1], int(sys.argv[2])
    rng = random.Random(int(sys.argv[3]))

    def alarm(signum, frame):
        raise TimeoutError("alarm")

    signal.signal(signal.SIGALRM, alarm)
    pools, fakes, caught = [], [], {}
    for run in range(runs):
        fake = FakeRuntime(unregister_delay=rng.choice((0.0, 0.0005)))
        fakes.append(fake)
        background, closing = rng.random() < 0.5, rng.random() < 0.5
        pool = pinpool.PinnedPool(
            size="8MiB", chunk_bytes="256KiB", runtime=fake if runtime == "fake" else runtime, registry=None,
            background=background, unpin_workers=2,
        )
        pools.append(pool)
        pool.open()
        try:
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0, 0.003))
            if closing:
                pool.close()
            else:
                pool.__exit__(None, None, None)
            time.sleep(0.003)  # the alarm lands after the exit, if not during it
        except BaseException as exc:
            caught[type(exc).__name__] = caught.get(type(exc).__name__, 0) + 1
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    report(pools, caught, fakes)
    """
)


def _child(code: str, *args: str, timeout: float = 240) -> dict[str, object]:
    done = preloaded.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@depth
@pytest.mark.parametrize("runtime", ["fake", pytest.param("mlock", marks=needs_mlock)])
def test_alarm_timeouts_around_exit_and_close_leave_nothing(runtime: str) -> None:
    """A real SIGALRM whose handler raises TimeoutError, at a random moment of each of many foreground and
    background pools' exit or close: every pool ends CLOSED (a later close() finishing any), nothing
    registered or claimed, and every exception seen is the TimeoutError itself."""
    pools = runs(70, 200)
    report = _child(ALARMS, runtime, str(pools), "33")
    assert report["states"] == ["closed"]
    assert report["registered"] == 0 and report["claims"] == 0 and report["vmlck"] == 0
    assert set(report["caught"]) <= {"TimeoutError"}, report["caught"]  # type: ignore[arg-type]
    assert report["caught"].get("TimeoutError", 0) > pools // 2, report  # type: ignore[union-attr]


def test_memory_error_right_after_teardown_begins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A MemoryError raised right after ``begin_teardown`` returns: the teardown resumes and finishes,
    then the MemoryError reaches the caller; the pool is CLOSED, nothing registered or claimed."""
    import pinpool
    from pinpool._pin import PinSession
    from pinpool._ranges import PINNED_RANGES
    from pinpool.testing import FakeRuntime

    begin = PinSession.begin_teardown
    raised: list[int] = []

    def begin_then_fail(self: PinSession, **kwargs: bool) -> object:
        bodies = begin(self, **kwargs)
        if not raised:
            raised.append(1)
            raise MemoryError
        return bodies

    monkeypatch.setattr(PinSession, "begin_teardown", begin_then_fail)
    fake = FakeRuntime()
    pool = pinpool.PinnedPool(size="8MiB", chunk_bytes="1MiB", runtime=fake, registry=None)
    with pytest.raises(MemoryError):
        with pool:
            pass
    assert raised and pool.state.value == "closed"
    assert fake.registered == {} and lifecycle_of(pool).memory is None
    assert PINNED_RANGES.get(fake.register_calls[0][0]) is None
    pool.close()  # returns at once


def test_memory_error_every_time_hands_over_and_close_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails every time: the teardown hands the MemoryError over with the pool CLOSING
    (claim and registrations kept, nothing unmapped), and a later close() finishes it."""
    import pinpool
    from pinpool._pin import PinSession
    from pinpool.testing import FakeRuntime

    begin = PinSession.begin_teardown

    def fail(self: PinSession, **kwargs: bool) -> object:
        raise MemoryError

    fake = FakeRuntime()
    pool = pinpool.PinnedPool(size="8MiB", chunk_bytes="1MiB", runtime=fake, registry=None)
    pool.open()
    monkeypatch.setattr(PinSession, "begin_teardown", fail)
    with pytest.raises(MemoryError):
        pool.close()
    assert pool.state.value == "closing" and len(fake.registered) == 8
    monkeypatch.setattr(PinSession, "begin_teardown", begin)
    pool.close()
    assert pool.state.value == "closed" and fake.registered == {}


RECURSION = REPORT + textwrap.dedent(
    """
    import sys
    import pinpool

    how, limit = sys.argv[1], int(sys.argv[2])
    sys.setrecursionlimit(limit)

    def deep(n, fn):
        return fn() if n == 0 else deep(n - 1, fn)

    pools, caught = [], {}
    for depth in range(limit - 100, limit):
        pool = pinpool.PinnedPool(size="4MiB", chunk_bytes="512KiB", runtime="mlock", registry=None, unpin_workers=2)
        pools.append(pool)
        pool.open()
        leave = pool.close if how == "close" else (lambda: pool.__exit__(None, None, None))
        try:
            deep(depth, leave)
        except BaseException as exc:
            caught[type(exc).__name__] = caught.get(type(exc).__name__, 0) + 1
    report(pools, caught)
    """
)


@needs_mlock
@pytest.mark.parametrize("how", ["exit", "close"])
def test_low_stack_headroom(how: str) -> None:
    """Exiting or closing a real mlock pool at every depth near ``sys.setrecursionlimit(400)``: the
    process returns, each pool ends CLOSED or a later close() finishes it, VmLck is 0 and no claim stays."""
    report = _child(RECURSION, how, "400", timeout=180)
    assert report["states"] == ["closed"]
    assert report["claims"] == 0 and report["vmlck"] == 0
    assert report["caught"].get("RecursionError"), report  # type: ignore[union-attr]
