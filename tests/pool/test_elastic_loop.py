"""An elastic pool's policy loop (elastic=, on_give_up=, pressure=; pinpool._pool.follow): under pressure it asks
the server which pages to give up and gives them back, one step at a time down to the floor; calm, it grows when
the server asks (pool.want); its failures are events and counts, never the server's; exit and close() stop and
join it before any segment is torn down. Real mlock pools; pressure injected through pinpool.testing.FakePressure."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry

import pinpool
from pinpool.testing import FakePressure, FakeRuntime, locked_bytes

from ..conftest import each_driver, needs_mlock

MiB = 1 << 20
DEADLINE_S = 30.0  # for events that come in milliseconds: only a hung loop reaches it
PRESSED = FakePressure.reading(50.0, used=7 << 30, limit=8 << 30)
CALM = FakePressure.reading(0.0, used=1 << 30, limit=8 << 30)


class Events:
    """The pool's structlog events, as they come from any thread; a test waits for one, never for a time."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self.logger = structlog.wrap_logger(structlog.testing.CapturingLogger(), processors=[self._keep])

    def _keep(self, _logger: object, method: str, event_dict: Any) -> Any:
        with self._changed:
            self.seen.append({"level": method, **event_dict})
            self._changed.notify_all()
        raise structlog.DropEvent

    def named(self, event: str, **fields: object) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.seen if e["event"] == event and fields.items() <= e.items()]

    def wait(self, event: str, count: int = 1, **fields: object) -> list[dict[str, Any]]:
        with self._changed:
            if not self._changed.wait_for(lambda: len(self.named(event, **fields)) >= count, DEADLINE_S):
                raise AssertionError(f"no {count} x {event} {fields} within {DEADLINE_S} s: {self.seen}")
        return self.named(event, **fields)


def give_up_tail(pool_box: list[pinpool.PinnedPool]) -> Callable[[int], Sequence[range]]:
    """A server that gives up the top of what it holds: its last ``nbytes`` of usable pages (Raw: a byte each)."""

    def give_up(nbytes: int) -> Sequence[range]:
        top = pool_box[0].pinned_runs[-1].stop
        return [range(top - nbytes, top)]

    return give_up


def elastic_pool(
    events: Events, pressure: FakePressure, *, on_give_up: Callable[[int], Sequence[range] | None] | None = None,
    registry: CollectorRegistry | None = None, runtime: object = "mlock", options: dict[str, Any] | None = None,
    **policy: Any,
) -> tuple[pinpool.PinnedPool, list[pinpool.PinnedPool]]:  # fmt: skip
    """A 4 MiB floor, 12 MiB reserved in segments of 2 MiB; the policy steps by a segment, without waits."""
    box: list[pinpool.PinnedPool] = []
    settings = {"step": 2 * MiB, "cooldown_seconds": 0.0, "shrink_interval_seconds": 0.0, **policy}
    pool = pinpool.PinnedPool(
        size=4 * MiB, reserve=12 * MiB, grow_step=2 * MiB, chunk_bytes=MiB, runtime=runtime, registry=registry,
        logger=events.logger, elastic=pinpool.ElasticPolicy(**settings), pressure=pressure,
        on_give_up=on_give_up or give_up_tail(box), name="elastic-loop", **(options or {}),
    )  # fmt: skip
    box.append(pool)
    return pool, box


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"pool": "elastic-loop", "runtime": "mlock", **labels})
    return 0.0 if value is None else value


def wait_until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, f"not done within {DEADLINE_S} s"
        time.sleep(0.002)


def loop_thread() -> threading.Thread | None:
    return next((t for t in threading.enumerate() if t.name == "pinpool-elastic-loop-elastic"), None)


@pytest.fixture
def events() -> Iterator[Events]:
    yield Events()
    assert loop_thread() is None, "a pool's policy loop outlived its pool"


@needs_mlock
def test_pressure_shrinks_step_by_step_to_the_floor_and_says_so(events: Events) -> None:
    pressure, registry = FakePressure(), CollectorRegistry()
    before = locked_bytes()
    pool, _box = elastic_pool(events, pressure, registry=registry)
    with pool:
        pool.grow_sync(nbytes=8 * MiB)
        assert pool.pinned_runs == (range(0, 12 * MiB),) and locked_bytes() - before == 12 * MiB
        thread = loop_thread()
        assert thread is not None and thread.daemon  # never keeps the interpreter alive
        assert sample(registry, "pinpool_reserved_bytes") == 12 * MiB
        pressure.set(PRESSED)
        events.wait("pool.shrink", outcome="shrunk")
        for shrinks in range(2, 5):  # each reading under pressure gives back one more step
            pressure.set(PRESSED)
            events.wait("pool.shrink", shrinks, outcome="shrunk")
        events.wait("elastic.at_floor")
        assert pool.pinned_runs == (range(0, 4 * MiB),) and locked_bytes() - before == 4 * MiB
        decided = [e["action"] for e in events.named("elastic.decided")]
        assert decided == ["shrink", "shrink", "shrink", "shrink_to_floor"]
        read = pressure.reads
        pressure.set(PRESSED)  # at the floor, still pressed: nothing more to give, and told once per episode
        wait_until(lambda: pressure.reads > read)
        assert len(events.named("elastic.at_floor")) == 1
        assert sample(registry, "pinpool_shrinks_total", outcome="shrunk") == 4
        assert sample(registry, "pinpool_released_bytes_total") == 8 * MiB
        assert sample(registry, "pinpool_shrink_seconds_count") == 4
        assert sample(registry, "pinpool_elastic_at_floor_total") == 1
        assert sample(registry, "pinpool_memory_pressure_psi") == 50.0
        assert sample(registry, "pinpool_pressure_events_total", source="fake") >= 4  # sets may coalesce
    assert locked_bytes() == before and sample(registry, "pinpool_reserved_bytes") == 0


@needs_mlock
@each_driver
@pytest.mark.anyio
async def test_the_server_asks_and_the_calm_loop_grows_by_whole_segments(mode: str, events: Events) -> None:
    pressure, registry = FakePressure(), CollectorRegistry()
    pressure.set(CALM)
    pool, _box = elastic_pool(events, pressure, registry=registry)
    if mode == "async":
        async with pool:
            pool.want(pages=3 * MiB)  # two segments of 2 MiB
            assert await pool.wait_ready(min_bytes=8 * MiB) == 8 * MiB
    else:
        with pool:
            pool.want(nbytes="3MiB")
            events.wait("pool.grow", outcome="grown")
            assert pool.pinned_runs == (range(0, 8 * MiB),)
    grown = events.wait("pool.grow", outcome="grown")
    assert [g["bytes"] for g in grown] == [4 * MiB]
    assert sample(registry, "pinpool_grown_bytes_total") == 4 * MiB
    assert events.named("elastic.stopped")  # stopped at exit, on every driver


@needs_mlock
def test_pressure_wins_over_an_ask_and_nothing_grows_while_pressed(events: Events) -> None:
    pressure = FakePressure()
    pool, _box = elastic_pool(events, pressure)
    with pool:
        pressure.set(FakePressure.reading(50.0, used=1 << 30, limit=8 << 30))  # PSI alone
        pool.want(pages=MiB)
        events.wait("elastic.at_floor")
        assert pool.pinned_runs == (range(0, 4 * MiB),) and not events.named("pool.grow")
        pressure.set(CALM)  # calm again: the ask stands and is served
        events.wait("pool.grow", outcome="grown")
        assert pool.pinned_runs == (range(0, 6 * MiB),)


@needs_mlock
def test_a_server_that_gives_nothing_or_raises_keeps_its_pages_and_its_pool(events: Events) -> None:
    answers: list[object] = [None, [], RuntimeError("allocator busy"), [range(0, 1)]]

    def give_up(nbytes: int) -> Sequence[range] | None:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    pressure, registry = FakePressure(), CollectorRegistry()
    pool, _box = elastic_pool(events, pressure, on_give_up=give_up, registry=registry)
    with pool:
        pool.grow_sync(nbytes=2 * MiB)
        for count in (1, 2):
            pressure.set(PRESSED)
            events.wait("pool.shrink", count, outcome="declined")
        pressure.set(PRESSED)
        failed = events.wait("elastic.failed", kind="give_up")
        assert failed[0]["error_type"] == "RuntimeError" and "allocator busy" in failed[0]["error"]
        pressure.set(PRESSED)  # a page of the floor: refused by the pool, counted, nothing taken
        events.wait("elastic.failed", kind="shrink")
        assert pool.pinned_runs == (range(0, 6 * MiB),)
        assert sample(registry, "pinpool_shrinks_total", outcome="declined") == 2
        assert sample(registry, "pinpool_shrinks_total", outcome="refused") == 1
        assert sample(registry, "pinpool_elastic_failures_total", kind="give_up") == 1
        pool.tensor[:MiB].fill_(3)  # the server's pool serves on
        assert int(pool.tensor[:MiB].sum()) == 3 * MiB


@needs_mlock
def test_a_reading_that_fails_is_counted_and_the_loop_reads_on(events: Events) -> None:
    pressure, registry = FakePressure(), CollectorRegistry()
    pool, _box = elastic_pool(events, pressure, registry=registry)
    with pool:
        pool.grow_sync(nbytes=2 * MiB)
        pressure.fail_reads(pinpool.ConfigError("a fake /proc"))
        events.wait("elastic.failed", kind="read")
        pressure.fail_reads(None)
        pressure.set(PRESSED)
        events.wait("pool.shrink", outcome="shrunk")
        assert sample(registry, "pinpool_elastic_failures_total", kind="read") >= 1


def test_a_grow_that_fails_is_rolled_back_counted_and_the_pool_serves_on(events: Events) -> None:
    pressure, registry = FakePressure(), CollectorRegistry()
    pressure.set(CALM)
    runtime = FakeRuntime(fail_register_on=range(5, 100))  # calls 1-4, the floor, pin; every grow fails
    pool, _box = elastic_pool(events, pressure, registry=registry, runtime=runtime, options={"max_retries": 0})
    with pool:
        pool.want(pages=MiB)
        events.wait("elastic.failed", kind="grow")
        assert pool.pinned_runs == (range(0, 4 * MiB),)
        assert registry.get_sample_value(
            "pinpool_grows_total", {"pool": "elastic-loop", "runtime": "fake", "outcome": "failed"}
        ) >= 1  # fmt: skip


@needs_mlock
def test_close_from_another_thread_stops_and_joins_the_loop_before_the_segments_go(events: Events) -> None:
    pressure = FakePressure()
    pool, _box = elastic_pool(events, pressure)
    pool.open()
    pool.grow_sync(nbytes=2 * MiB)
    assert loop_thread() is not None
    closer = threading.Thread(target=pool.close)
    closer.start()
    closer.join(DEADLINE_S)
    assert not closer.is_alive() and loop_thread() is None and pressure.closed
    order = [e["event"] for e in events.seen if e["event"] in ("elastic.stopped", "pool.unpinned")]
    assert order == ["elastic.stopped", "pool.unpinned"]  # the loop ended before any segment was torn down


@pytest.mark.parametrize(
    ("given", "needs"),
    [
        ({"elastic": pinpool.ElasticPolicy(), "on_give_up": lambda n: []}, "reserve="),
        ({"reserve": "8MiB", "elastic": pinpool.ElasticPolicy()}, "on_give_up="),
        ({"reserve": "8MiB", "on_give_up": lambda n: []}, "elastic="),
        ({"reserve": "8MiB", "elastic": "on", "on_give_up": lambda n: []}, "ElasticPolicy"),
        ({"reserve": "8MiB", "elastic": pinpool.ElasticPolicy(), "on_give_up": 3}, "callable"),
        ({"reserve": "8MiB", "elastic": pinpool.ElasticPolicy(), "on_give_up": list, "pressure": 1}, "wait("),
        ({"reserve": "8MiB", "elastic": pinpool.ElasticPolicy(floor=1 << 30), "on_give_up": list}, "floor="),
    ],
)
def test_a_policy_is_declared_whole_or_refused(given: dict[str, Any], needs: str) -> None:
    with pytest.raises(pinpool.ConfigError, match=needs.replace("(", r"\(")):
        pinpool.PinnedPool(size="4MiB", runtime=FakeRuntime(), registry=None, **given)


def test_want_needs_a_policy_loop() -> None:
    with pinpool.PinnedPool(
        size="4MiB", reserve="8MiB", grow_step="2MiB", runtime=FakeRuntime(), registry=None
    ) as pool:
        with pytest.raises(pinpool.ConfigError, match="no policy loop"):
            pool.want(pages=1)


@needs_mlock
def test_an_unexited_pool_with_a_loop_is_collected_and_its_loop_ends(events: Events) -> None:
    pressure = FakePressure()
    pool, box = elastic_pool(events, pressure)
    pool.open()
    box.clear()
    with pytest.warns(pinpool.UnclosedPoolWarning):
        del pool
        deadline = time.monotonic() + DEADLINE_S
        while loop_thread() is not None and time.monotonic() < deadline:
            pressure.wake()  # the loop holds the pool only between a wake and its step
            time.sleep(0.01)
    assert loop_thread() is None and events.named("elastic.stopped")
