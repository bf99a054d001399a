"""An elastic pool recovers from a segment teardown that raised TEARDOWN_TRIES times (docs/elastic-design.md):
the next shrink() finishes every segment earlier shrinks left releasing and says so in ``Shrunk.recovered``;
the next grow() resumes a rollback that raised, then grows. One that keeps raising stays as it is with a typed
error each time, and the pool's exit still takes everything over.

What raises: a runtime's unregister that raises or fails is booked as a failed unregister (the segment is
leaked, not retried), so a teardown that raises is pinpool's own code raising (a MemoryError, an exception
from a signal handler): injected here into the segment sessions' ``begin_teardown`` / ``end_teardown``, as
tests/pool/test_teardown_raises.py does for a whole pool. FakeRuntime keeps the books; real mlock for VmLck."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import pinpool
from pinpool._pin import TEARDOWN_TRIES, PinSession
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakePressure, FakeRuntime, assert_released, locked_bytes

from ..conftest import each_driver, needs_mlock
from ..engine.test_runtime_mlock import FailingMlock
from .test_elastic_loop import PRESSED, Events, elastic_pool, sample

MiB = 1 << 20
FLOOR, SEGMENT = 4 * MiB, 2 * MiB  # Raw: a page is a byte; segments [4, 6), [6, 8), [8, 10), [10, 12) MiB


def elastic(runtime: object, **options: object) -> pinpool.PinnedPool:
    given: dict[str, object] = {"size": FLOOR, "reserve": 12 * MiB, "grow_step": SEGMENT, "chunk_bytes": MiB}
    return pinpool.PinnedPool(runtime=runtime, registry=None, **{**given, **options})  # type: ignore[arg-type]


class Raises:
    """``PinSession.<step>`` raises MemoryError for the next ``left`` calls by sessions of pages from ``above``
    on (the segments'; the floor's session is never hit), before the step runs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, step: str, *, above: int = FLOOR) -> None:
        self.left, self.raised, self.above, self.step = 0, 0, above, step
        real: Callable[..., object] = getattr(PinSession, step)

        def step_or_raise(session: PinSession, *args: object, **kwargs: object) -> object:
            if self.left and min(c.offset for c in session.ledger.chunks) >= self.above:
                self.left -= 1
                self.raised += 1
                raise MemoryError(f"injected into {step}")
            return real(session, *args, **kwargs)

        monkeypatch.setattr(PinSession, step, step_or_raise)

    def arm(self, times: int) -> None:
        self.left, self.raised = times, 0


@pytest.fixture(params=["begin_teardown", "end_teardown"])
def raises(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Raises]:
    """Before anything is unregistered (begin), or after every unregister, before the books close (end)."""
    yield Raises(monkeypatch, request.param)


def held_above(fake: FakeRuntime, start: int, base: int) -> int:
    return sum(n for ptr, n in fake.registered.items() if ptr - base >= start)


async def grow(pool: pinpool.PinnedPool, mode: str, pages: int) -> Any:
    return pool.grow_sync(pages=pages) if mode == "sync" else await pool.grow(pages=pages)


async def shrink(pool: pinpool.PinnedPool, mode: str, to_pages: int) -> Any:
    return pool.shrink_sync(to_pages=to_pages) if mode == "sync" else await pool.shrink(to_pages=to_pages)


@pytest.mark.anyio
@each_driver
async def test_the_next_shrink_finishes_a_segment_whose_teardown_raised(mode: str, raises: Raises) -> None:
    fake = FakeRuntime()
    pool = elastic(fake)
    pool.open()
    base = pool.data_ptr
    await grow(pool, mode, 2 * SEGMENT)  # segments 1 and 2: pages [4, 8) MiB
    raises.arm(TEARDOWN_TRIES)
    stuck = r"segment 2 .* stays releasing .* the next shrink\(\) resumes it"
    with pytest.raises(pinpool.UnpinError, match=stuck) as info:
        await shrink(pool, mode, 6 * MiB)
    assert isinstance(info.value.__cause__, MemoryError) and raises.raised == TEARDOWN_TRIES
    assert pool.pinned_runs == (range(0, 6 * MiB),)  # given up: never usable again
    still = SEGMENT if raises.step == "begin_teardown" else 0  # raised before anything was unregistered
    assert held_above(fake, 6 * MiB, base) == still and pool.pinned_bytes == 6 * MiB + still
    shrunk = await shrink(pool, mode, pool.num_pages)  # gives up nothing more: finishes segment 2
    assert shrunk.recovered == (range(6 * MiB, 8 * MiB),) and shrunk.released == shrunk.unreturned == ()
    assert held_above(fake, 6 * MiB, base) == 0 and pool.pinned_bytes == 6 * MiB
    assert pool.pinned_pages == 6 * MiB
    assert (await shrink(pool, mode, 6 * MiB)).recovered == ()  # finished once
    assert (await grow(pool, mode, SEGMENT)).pages == (range(6 * MiB, 8 * MiB),)  # and it grows again
    pool.close()
    assert_released(pool, fake)


def test_a_teardown_that_keeps_raising_is_a_typed_error_each_time(raises: Raises) -> None:
    fake = FakeRuntime()
    pool = elastic(fake)
    pool.open()
    base = pool.data_ptr
    pool.grow_sync(pages=4 * SEGMENT)
    raises.above = 10 * MiB  # segment 4 only
    raises.arm(10_000)
    for attempt in range(3):  # the first shrink, then two that resume it: each one typed, nothing else changes
        with pytest.raises(pinpool.UnpinError, match=r"segment 4 \(pages \[10485760, 12582912\).* raised "
                           r"MemoryError\('injected into \w+'\) 3 times: the segment stays releasing"):  # fmt: skip
            pool.shrink_sync(to_pages=10 * MiB)
        assert pool.pinned_runs == (range(0, 10 * MiB),), attempt
    with pytest.raises(pinpool.UnpinError, match="segment 4"):  # a shrink that names more still releases those
        pool.shrink_sync(to_pages=8 * MiB)
    assert pool.pinned_runs == (range(0, 8 * MiB),) and held_above(fake, 8 * MiB, base) <= SEGMENT
    assert pool.grow_sync(pages=SEGMENT).pages == (range(8 * MiB, 10 * MiB),)  # the stalled one is not grown
    raises.arm(0)
    pool.close()  # the exit takes the stalled segment over
    assert_released(pool, fake)


def test_the_next_grow_resumes_a_rollback_that_raised(raises: Raises) -> None:
    fake = FakeRuntime()
    pool = elastic(fake)
    pool.open()
    base = pool.data_ptr
    fake.fail_next(10_000)  # every register of the next segment fails: it rolls back
    raises.arm(TEARDOWN_TRIES)
    with pytest.raises(pinpool.PinError, match="segment 1") as info:
        pool.grow_sync(pages=2 * SEGMENT)
    assert any("stays growing" in note and "the next grow() resumes it" in note for note in info.value.__notes__)
    assert pool.pinned_runs == (range(0, FLOOR),)
    fake.fail_next(0)
    raises.arm(TEARDOWN_TRIES)  # the resumed rollback raises again: refused, typed, naming the segment
    with pytest.raises(pinpool.PoolStateError, match=r"grow\(pages=2097152\): resuming the rollback .*segment 1 "):
        pool.grow_sync(pages=SEGMENT)
    assert pool.pinned_runs == (range(0, FLOOR),)
    with pytest.raises(pinpool.PoolStateError, match="not usable now"):  # a shrink never takes a growing segment
        pool.shrink_sync(pages=[range(FLOOR, FLOOR + SEGMENT)])
    grown = pool.grow_sync(pages=2 * SEGMENT)  # resumes the rollback (segment 1 free), then grows it and the next
    assert grown.pages == (range(FLOOR, FLOOR + 2 * SEGMENT),) and pool.pinned_runs == (range(0, 8 * MiB),)
    assert held_above(fake, FLOOR, base) == 2 * SEGMENT == pool.pinned_bytes - FLOOR
    pool.close()
    assert_released(pool, fake)


@pytest.mark.anyio
@each_driver
async def test_the_exit_takes_stalled_segments_over(mode: str, raises: Raises) -> None:
    """A rollback and a release left stalled, then the pool's exit: both torn down, the books balanced."""
    fake = FakeRuntime()
    pool = elastic(fake)
    pool.open()
    await grow(pool, mode, SEGMENT)
    raises.arm(TEARDOWN_TRIES)
    with pytest.raises(pinpool.UnpinError, match="segment 1"):
        await shrink(pool, mode, FLOOR)
    fake.fail_next(10_000)
    raises.arm(TEARDOWN_TRIES)
    with pytest.raises(pinpool.PinError, match="segment 2"):  # segment 1 is releasing: the lowest free is 2
        await grow(pool, mode, SEGMENT)
    fake.fail_next(0)
    assert pool.pinned_runs == (range(0, FLOOR),)
    pool.close()
    assert_released(pool, fake)


@needs_mlock
def test_a_resumed_rollback_with_mlock_leaves_vmlck_exactly_floor_and_grown(monkeypatch: pytest.MonkeyPatch) -> None:
    before, claims = locked_bytes(), PINNED_RANGES.snapshot()
    runtime = FailingMlock()
    raises = Raises(monkeypatch, "begin_teardown")  # the rollback unlocks nothing: the resumed one must
    pool = elastic(runtime, max_retries=0, register_workers=1)
    with pool:
        runtime.fail_on = range(runtime.calls + 2, 1 << 62)  # the segment's first chunk locks, the rest fail
        raises.arm(TEARDOWN_TRIES)
        with pytest.raises(pinpool.PinError, match="segment 1"):
            pool.grow_sync(pages=SEGMENT)
        runtime.fail_on = ()
        assert pool.pinned_runs == (range(0, FLOOR),) and sum(runtime.registered.values()) == FLOOR + MiB
        assert locked_bytes() - before == FLOOR + MiB  # the half-pinned segment's first chunk is still locked
        grown = pool.grow_sync(pages=2 * SEGMENT)
        assert grown.pages == (range(FLOOR, FLOOR + 2 * SEGMENT),)
        assert locked_bytes() - before == FLOOR + 2 * SEGMENT == pool.pinned_bytes
    assert_released(pool, claims_before=claims, locked_before=before)


@needs_mlock
def test_the_policy_loops_next_shrink_finishes_a_stalled_segment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop shrinks through the same method: under pressure its shrink finishes the segment a shrink left
    releasing, then gives back the step the server gave up; the released-bytes metric counts each once."""
    events, pressure, registry, before = Events(), FakePressure(), CollectorRegistry(), locked_bytes()
    raises = Raises(monkeypatch, "begin_teardown")
    pool, _box = elastic_pool(events, pressure, registry=registry)
    with pool:
        pool.grow_sync(nbytes=8 * MiB)
        raises.arm(TEARDOWN_TRIES)
        with pytest.raises(pinpool.UnpinError, match="segment 4"):
            pool.shrink_sync(to_pages=10 * MiB)
        assert locked_bytes() - before == 12 * MiB  # nothing of segment 4 was unlocked
        pressure.set(PRESSED)  # the server gives up the top of what it holds: [8, 10) MiB
        events.wait("pool.shrink", outcome="shrunk")
        assert pool.pinned_runs == (range(0, 8 * MiB),) and locked_bytes() - before == 8 * MiB
        assert sample(registry, "pinpool_released_bytes_total") == 4 * MiB  # each once, when its pages went back
        assert sample(registry, "pinpool_shrinks_total", outcome="failed") == 1
    assert locked_bytes() == before
