"""The policy loop's OWN grows and shrinks (pool.want, pressure) against a failing runtime and a hostile server:
a FakeRuntime call that fails at each populate/register/unregister of a loop-initiated grow or shrink, an
on_give_up that raises, answers garbage, pages it does not hold or blocks, and a want() storm from several threads.
Every failure is an ``elastic.failed`` event and a ``pinpool_elastic_failures_total{kind}`` count, the loop goes on
(a later grow or shrink of its own succeeds), no announced page is left unpinned, and after exit the fake's books
are balanced and the loop's thread is gone."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry

import pinpool
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakePressure, FakeRuntime, assert_released

from ..depth import depth, runs
from .test_elastic_loop import CALM, PRESSED, Events, elastic_pool, loop_thread

MiB = 1 << 20
STORM_ROUNDS = runs(40, 400, "PINPOOL_WANT_STORM")


class Faulty(FakeRuntime):
    """A FakeRuntime whose ``op`` call number ``calls`` (1-based, counted once armed) fails, as the driver's
    cudaErrorMemoryAllocation would: the call does nothing."""

    def __init__(self) -> None:
        super().__init__(before_call=self._before)
        self.faults: dict[str, set[int]] = {}
        self._seen: dict[str, int] = {}
        self._faults_lock = threading.Lock()
        self.failed = threading.Event()
        self.kept: set[int] = set()

    def arm(self, **faults: set[int]) -> None:
        with self._faults_lock:
            self.faults, self._seen = faults, {}

    def _before(self, op: str, ptr: int, nbytes: int) -> None:
        with self._faults_lock:
            self._seen[op] = call = self._seen.get(op, 0) + 1
            hit = call in self.faults.get(op, ())
        if hit:
            if op == "unregister":
                self.kept.add(ptr)  # a failed unregister leaves the range registered (CUDA's books say so)
            self.failed.set()
            op_name = {"register": "cudaHostRegister", "unregister": "cudaHostUnregister"}.get(op, "populate")
            raise pinpool.RuntimeCallError(
                op=op_name, code=2, reason="cudaErrorMemoryAllocation", ptr=ptr, nbytes=nbytes,
                message=f"injected failure ({op} call #{call} of the loop's action)",
            )  # fmt: skip


def count(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"pool": "elastic-loop", "runtime": "fake", **labels})
    return 0.0 if value is None else value


def announced_are_registered(pool: pinpool.PinnedPool, fake: FakeRuntime) -> None:
    """No page the pool calls usable is unpinned (Raw: a page is a byte)."""
    held = fake.registered
    for run in pool.pinned_runs:
        for page in (run.start, run.stop - 1):
            address = pool.data_ptr + page
            assert any(ptr <= address < ptr + n for ptr, n in held.items()), (run, held)


@pytest.fixture
def events() -> Iterator[Events]:
    yield Events()
    assert loop_thread() is None, "a pool's policy loop outlived its pool"


# A segment is 2 chunks here: a grow populates then registers both, a shrink unregisters both.
FAULTS = [
    ("grow", {"populate": {1}}),
    ("grow", {"populate": {2}}),
    ("grow", {"register": {1}}),
    ("grow", {"register": {2}}),
    ("grow", {"register": {2}, "unregister": {1}}),  # and the rollback's unregister of the first chunk
    ("shrink", {"unregister": {1}}),
    ("shrink", {"unregister": {2}}),
    ("shrink", {"unregister": {1, 2}}),
]


@pytest.mark.parametrize(("action", "faults"), FAULTS, ids=[f"{a}-{sorted(f.items())}" for a, f in FAULTS])
def test_a_failing_runtime_in_the_loops_own_grow_or_shrink(
    action: str, faults: dict[str, set[int]], events: Events
) -> None:
    claims = PINNED_RANGES.snapshot()
    fake, pressure, registry = Faulty(), FakePressure(), CollectorRegistry()
    pool, _box = elastic_pool(events, pressure, registry=registry, runtime=fake, options={"max_retries": 0})
    with pool:
        pool.grow_sync(nbytes=4 * MiB)  # the server's: 8 MiB usable, two segments the loop may give back
        fake.arm(**faults)
        if action == "grow":
            pressure.set(CALM)
            pool.want(pages=MiB)
            failed = events.wait("elastic.failed", kind="grow")
            assert failed[0]["error_type"] == "PinError"
            assert pool.pinned_runs == (range(0, 8 * MiB),)  # the segment in flight rolled back, nothing else
        else:
            pressure.set(PRESSED)
            shrunk = events.wait("pool.shrink")
            assert shrunk[0]["outcome"] in ("shrunk", "failed"), shrunk
            if shrunk[0]["outcome"] == "failed":
                events.wait("elastic.failed", kind="shrink")
            assert pool.pinned_runs == (range(0, 6 * MiB),)  # given up: never usable again, whatever failed
        assert fake.failed.is_set()
        announced_are_registered(pool, fake)
        fake.arm()
        pool.want(pages=0)
        thread = loop_thread()
        assert thread is not None and thread.is_alive()  # the failure was the loop's to count, not to die of
        # and it acts again: one more shrink of its own, then a grow when calm and asked
        shrinks = len(events.named("pool.shrink", outcome="shrunk"))
        pressure.set(PRESSED)
        events.wait("pool.shrink", shrinks + 1, outcome="shrunk")
        pressure.set(CALM)
        pool.want(pages=MiB)
        events.wait("pool.grow", outcome="grown")
        announced_are_registered(pool, fake)
    failures = events.named("elastic.failed")
    assert {e["kind"] for e in failures} == {action}
    assert count(registry, "pinpool_elastic_failures_total", kind=action) == len(failures)
    if not fake.kept:
        assert_released(pool, fake, claims_before=claims)
        return
    # An unregister that failed leaks its chunk for good (the runtime still holds it: never unpinned behind its
    # back, never regrown, the mapping kept): exactly those chunks stay registered, and the error said so.
    assert set(fake.registered) == fake.kept
    assert any("failed to unregister" in e["error"] + e.get("notes", "") for e in failures), failures


# -- a hostile server ------------------------------------------------------------------------------


class Garbage(Exception):
    pass


# What on_give_up answers: each must be refused (counted as give_up or shrink), and nothing taken.
ANSWERS: list[tuple[str, Callable[[pinpool.PinnedPool], object], str]] = [
    ("raises", lambda pool: (_ for _ in ()).throw(Garbage("allocator busy")), "give_up"),
    ("raises-base", lambda pool: (_ for _ in ()).throw(SystemExit(3)), "give_up"),
    ("an-int", lambda pool: 7, "give_up"),
    ("a-string", lambda pool: "0-100", "give_up"),
    ("tuples", lambda pool: [(0, 10)], "give_up"),
    ("a-generator-that-raises", lambda pool: (range(0, 1) if i < 1 else 1 / 0 for i in range(2)), "give_up"),
    ("never-pinned", lambda pool: [range(10 * MiB, 12 * MiB)], "shrink"),
    ("beyond-the-reservation", lambda pool: [range(12 * MiB, 14 * MiB)], "shrink"),
    ("negative", lambda pool: [range(-2 * MiB, 0)], "shrink"),
    ("the-floor", lambda pool: [range(0, 2 * MiB)], "shrink"),
    ("a-stepped-range", lambda pool: [range(4 * MiB, 8 * MiB, 2)], "shrink"),
]


@pytest.mark.parametrize(("answer", "kind"), [(a, k) for _, a, k in ANSWERS], ids=[n for n, _, _ in ANSWERS])
def test_an_on_give_up_answer_that_is_not_whole_usable_pages_takes_nothing(
    answer: Callable[[pinpool.PinnedPool], object], kind: str, events: Events
) -> None:
    pressure, registry = FakePressure(), CollectorRegistry()
    box: list[pinpool.PinnedPool] = []
    pool, _ = elastic_pool(events, pressure, registry=registry, runtime=FakeRuntime(),
                           on_give_up=lambda nbytes: answer(box[0]))  # type: ignore[arg-type,return-value]  # fmt: skip
    box.append(pool)
    with pool:
        pool.grow_sync(nbytes=4 * MiB)
        pressure.set(PRESSED)
        events.wait("elastic.failed", kind=kind)
        assert pool.pinned_runs == (range(0, 8 * MiB),)
        thread = loop_thread()
        assert thread is not None and thread.is_alive()
        assert count(registry, "pinpool_elastic_failures_total", kind=kind) >= 1
        assert not events.named("pool.shrink", outcome="shrunk")
    assert loop_thread() is None


def test_pages_of_a_segment_named_in_part_stay_and_the_next_answer_is_served(events: Events) -> None:
    answers = [[range(6 * MiB, 7 * MiB)], [range(6 * MiB, 8 * MiB)]]  # half a segment, then all of it
    pressure = FakePressure()
    pool, _ = elastic_pool(events, pressure, runtime=FakeRuntime(), on_give_up=lambda nbytes: answers.pop(0))
    with pool:
        pool.grow_sync(nbytes=4 * MiB)
        pressure.set(PRESSED)
        events.wait("pool.shrink", outcome="kept")
        assert pool.pinned_runs == (range(0, 8 * MiB),)
        pressure.set(PRESSED)
        events.wait("pool.shrink", outcome="shrunk")
        assert pool.pinned_runs == (range(0, 6 * MiB),)


def test_an_on_give_up_that_blocks_while_the_pool_closes(events: Events) -> None:
    """The server's callback holds the loop while another thread closes the pool: the close waits for the loop,
    which then leaves the pages to the exit (no shrink, no failure counted); nothing is left."""
    claims = PINNED_RANGES.snapshot()
    asked, release = threading.Event(), threading.Event()
    fake, pressure = FakeRuntime(), FakePressure()
    box: list[pinpool.PinnedPool] = []

    def give_up(nbytes: int) -> Sequence[range]:
        asked.set()
        release.wait(30)
        top = box[0].pinned_runs[-1].stop
        return [range(top - nbytes, top)]

    pool, _ = elastic_pool(events, pressure, runtime=fake, on_give_up=give_up)
    box.append(pool)
    pool.open()
    pool.grow_sync(nbytes=4 * MiB)
    pressure.set(PRESSED)
    assert asked.wait(30)
    pool.want(pages=MiB)  # the server's asks never wait for the loop's callback (it is still held)
    assert not release.is_set()
    closer = threading.Thread(target=pool.close)
    closer.start()
    release.set()
    closer.join(30)
    assert not closer.is_alive()
    assert not events.named("pool.shrink") and not events.named("elastic.failed")  # the exit takes every page
    assert_released(pool, fake, claims_before=claims)


def test_on_give_up_closing_the_pool_from_the_loops_own_thread(events: Events) -> None:
    claims = PINNED_RANGES.snapshot()
    fake, pressure = FakeRuntime(), FakePressure()
    box: list[pinpool.PinnedPool] = []

    def give_up(nbytes: int) -> Sequence[range]:
        box[0].close()  # the server's shutdown, run on whatever thread asked it
        return [range(6 * MiB, 8 * MiB)]

    pool, _ = elastic_pool(events, pressure, runtime=fake, on_give_up=give_up)
    box.append(pool)
    pool.open()
    pool.grow_sync(nbytes=4 * MiB)
    pressure.set(PRESSED)
    events.wait("elastic.stopped")
    assert not events.named("pool.shrink") and not events.named("elastic.failed")
    pool.close()
    assert_released(pool, fake, claims_before=claims)


@depth
def test_a_want_storm_from_several_threads_while_pressure_comes_and_goes(events: Events) -> None:
    claims = PINNED_RANGES.snapshot()
    fake, pressure = FakeRuntime(register_delay=0.0002), FakePressure()
    pool, _ = elastic_pool(events, pressure, runtime=fake)
    problems: list[BaseException] = []
    with pool:
        start = threading.Barrier(4)

        def storm(seed: int) -> None:
            rng = random.Random(seed)
            try:
                start.wait()
                for _ in range(STORM_ROUNDS):
                    choice = rng.random()
                    if choice < 0.6:
                        pool.want(pages=rng.choice([0, 1, MiB, 3 * MiB, 8 * MiB, 64 * MiB]))
                    elif choice < 0.8:
                        pool.want(nbytes=rng.choice(["1MiB", "5MiB"]))
                    else:
                        pressure.set(PRESSED if rng.random() < 0.5 else CALM)
                    announced_are_registered(pool, fake)
            except BaseException as exc:
                problems.append(exc)

        threads = [threading.Thread(target=storm, args=(seed,)) for seed in range(3)]
        for thread in threads:
            thread.start()
        start.wait()
        for thread in threads:
            thread.join(60)
        assert not problems, problems
        assert all(run.stop <= 12 * MiB for run in pool.pinned_runs)
        refused = [e for e in events.named("elastic.failed") if e["kind"] != "grow"]
        assert not refused, refused
        announced_are_registered(pool, fake)
        alive = loop_thread()
        assert alive is not None and alive.is_alive()
    assert_released(pool, fake, claims_before=claims)


class Babbling(FakePressure):
    """An injected pressure source (``pressure=``) whose first readings are not readings a policy can take."""

    def __init__(self, garbage: list[object]) -> None:
        super().__init__()
        self.garbage = garbage

    def read(self) -> pinpool.MemoryReading:
        if self.garbage:
            return self.garbage.pop(0)  # type: ignore[return-value]
        return super().read()


def test_a_pressure_source_that_answers_garbage_is_a_failed_read_and_the_loop_reads_on(events: Events) -> None:
    garbage: list[object] = [object(), None, pinpool.MemoryReading(usage_bytes="lots", limit_bytes=1)]  # type: ignore[arg-type]
    pressure, registry = Babbling(list(garbage)), CollectorRegistry()
    pool, _ = elastic_pool(events, pressure, registry=registry, runtime=FakeRuntime())
    with pool:
        pool.grow_sync(nbytes=2 * MiB)
        for reads in range(1, len(garbage) + 1):
            pressure.wake()
            events.wait("elastic.failed", reads, kind="read")
        pressure.set(PRESSED)
        events.wait("pool.shrink", outcome="shrunk")
    assert count(registry, "pinpool_elastic_failures_total", kind="read") == len(garbage)
    assert [e["error_type"] for e in events.named("elastic.failed")] == ["ConfigError", "ConfigError", "TypeError"]
