"""The pinning pipeline: pure `split_spans` and `Pipeline`, then its orders, lookahead and teardown in a pool."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool import Chunk, RuntimeCallError, _libc
from pinpool._ledger import ChunkState, LedgerError, Phase, StopCause
from pinpool._pipeline import WAIT, Batch, Order, Pipeline, Span, split_spans
from pinpool.testing import FakeRuntime

from .conftest import each_driver, hugetlb_pages, pin_and_run

MiB = 1 << 20

pytestmark = pytest.mark.anyio


def make_chunks(sizes: Iterable[int], gaps: Iterable[int] = (), *, start: int = 0) -> list[Chunk]:
    """Chunks of ``sizes`` in offset order, ``gaps`` bytes apart (0 where not given)."""
    chunks, offset = [], start
    gap_list = list(gaps)
    for i, size in enumerate(sizes):
        chunks.append(Chunk(offset, size))
        offset += size + (gap_list[i] if i < len(gap_list) else 0)
    return chunks


def error(op: str = "madvise(MADV_POPULATE_WRITE)") -> RuntimeCallError:
    return RuntimeCallError(op=op, code=12, reason="ENOMEM", message="injected", ptr=0x1000, nbytes=1)


# -- split_spans ----------------------------------------------------------------------------------------


def test_split_spans_example() -> None:
    chunks = [Chunk(0, 10), Chunk(10, 3), Chunk(16, 8)]
    assert split_spans(chunks, 4) == (
        Span(0, 0, 4), Span(0, 4, 4), Span(0, 8, 2),
        Span(1, 10, 3),
        Span(2, 16, 4), Span(2, 20, 4),
    )  # fmt: skip
    assert split_spans(chunks, 100) == (Span(0, 0, 10), Span(1, 10, 3), Span(2, 16, 8))
    assert split_spans([], 4) == ()


@pytest.mark.parametrize("span_bytes", [0, -1, -4096])
def test_split_spans_rejects_non_positive_span_bytes(span_bytes: int) -> None:
    with pytest.raises(ValueError, match=f"span_bytes={span_bytes}"):
        split_spans([Chunk(0, 10)], span_bytes)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), max_size=8),
    gaps=st.lists(st.integers(0, 50), max_size=8),
    start=st.integers(0, 1000),
    span_bytes=st.integers(1, 64),
)
def test_split_spans_cover_each_chunk_exactly(sizes: list[int], gaps: list[int], start: int, span_bytes: int) -> None:
    chunks = make_chunks(sizes, gaps, start=start)
    spans = split_spans(chunks, span_bytes)
    for index, chunk in enumerate(chunks):
        mine = [s for s in spans if s.chunk == index]
        assert mine, "every chunk has at least one span"
        # contiguous, in order, covering exactly [offset, end): never crossing into another chunk
        assert mine[0].offset == chunk.offset
        assert all(a.offset + a.nbytes == b.offset for a, b in pairwise(mine))
        assert mine[-1].offset + mine[-1].nbytes == chunk.end
        assert all(0 < s.nbytes <= span_bytes for s in mine)
        # boundaries at the chunk's start plus multiples of span_bytes; only the last may be short
        assert [s.offset for s in mine] == list(range(chunk.offset, chunk.end, span_bytes))
        assert all(s.nbytes == span_bytes for s in mine[:-1])
    assert [s.chunk for s in spans] == sorted(s.chunk for s in spans)  # in chunk order
    assert sum(s.nbytes for s in spans) == sum(sizes)


# -- Pipeline, step by step -------------------------------------------------------------------------------


def test_register_only_has_no_spans_and_claims_in_order() -> None:
    pipeline = Pipeline(make_chunks([4, 4, 4]), order=Order.REGISTER_ONLY, span_bytes=1)
    assert pipeline.spans == ()
    assert pipeline.next_populate() is None
    assert [pipeline.next_register() for _ in range(3)] == [0, 1, 2]
    assert pipeline.next_register() is None
    for index in (2, 0, 1):
        pipeline.registered(index)
    assert pipeline.finish() is Phase.PINNED
    assert pipeline.populated_bytes == 0


def test_populate_first_registers_a_chunk_only_once_all_its_spans_landed() -> None:
    pipeline = Pipeline(make_chunks([12]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=12)
    assert pipeline.next_register() is WAIT  # nothing faulted yet
    spans = [pipeline.next_populate() for _ in range(3)]
    assert spans == [Span(0, 0, 4), Span(0, 4, 4), Span(0, 8, 4)]
    assert pipeline.next_populate() is None
    pipeline.populated(Span(0, 8, 4))
    pipeline.populated(Span(0, 0, 4))
    assert pipeline.next_register() is WAIT  # one span still faulting
    pipeline.populated(Span(0, 4, 4))
    assert pipeline.next_register() == 0
    assert pipeline.next_register() is None
    pipeline.registered(0)
    assert pipeline.finish() is Phase.PINNED
    assert pipeline.populated_bytes == 12


def test_register_first_faults_a_chunk_only_once_it_is_registered() -> None:
    pipeline = Pipeline(make_chunks([8, 8]), order=Order.REGISTER_FIRST, span_bytes=4)
    assert pipeline.next_populate() is WAIT  # chunk 0 is not registered yet
    assert pipeline.next_register() == 0
    assert pipeline.next_populate() is WAIT  # registering, not registered
    pipeline.registered(0)
    assert pipeline.next_populate() == Span(0, 0, 4)
    assert pipeline.next_populate() == Span(0, 4, 4)
    assert pipeline.next_populate() is WAIT  # chunk 1 is still pending
    assert pipeline.next_register() == 1
    assert pipeline.next_register() is None
    pipeline.registered(1)
    spans = [pipeline.next_populate(), pipeline.next_populate()]
    assert spans == [Span(1, 8, 4), Span(1, 12, 4)]
    assert pipeline.next_populate() is None
    for span in [Span(0, 0, 4), Span(0, 4, 4), Span(1, 8, 4)]:
        pipeline.populated(span)
    with pytest.raises(LedgerError, match="1 populate calls in flight"):
        pipeline.finish()
    pipeline.populated(Span(1, 12, 4))
    assert pipeline.finish() is Phase.PINNED
    assert pipeline.populated_bytes == 16


def test_finish_raises_while_a_populate_is_in_flight() -> None:
    for order in (Order.POPULATE_FIRST, Order.REGISTER_FIRST):
        pipeline = Pipeline(make_chunks([4, 4]), order=order, span_bytes=4, lookahead_bytes=8)
        if order is Order.REGISTER_FIRST:
            pipeline.registered(pipeline.next_register())  # type: ignore[arg-type]
        span = pipeline.next_populate()
        assert isinstance(span, Span)
        pipeline.cancel()  # not even a stopped pipeline may close with a call out
        with pytest.raises(LedgerError, match="populate calls in flight"):
            pipeline.finish()
        assert pipeline.ledger.phase is Phase.PINNING
        pipeline.populated(span)
        assert pipeline.finish() is Phase.ROLLED_BACK


def test_populate_failure_in_register_first_leaves_the_chunk_registered() -> None:
    pipeline = Pipeline(make_chunks([8, 8]), order=Order.REGISTER_FIRST, span_bytes=4)
    pipeline.registered(pipeline.next_register())  # type: ignore[arg-type]
    first, second = pipeline.next_populate(), pipeline.next_populate()
    assert isinstance(first, Span) and isinstance(second, Span)
    failure = error()
    pipeline.populate_failed(second, failure)
    assert pipeline.stopped
    assert pipeline.next_populate() is None and pipeline.next_register() is None
    pipeline.populated(first)  # the call still out lands normally
    # Registered lock-on-fault but never fully faulted: to undo, yet not counted as pinned.
    assert pipeline.ledger.states == [ChunkState.FAULTING, ChunkState.PENDING]
    assert pipeline.ledger.registered_bytes == 0
    assert [(f.chunk, f.phase, f.error) for f in pipeline.ledger.failures] == [(Chunk(0, 8), "populate", failure)]
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.teardown_order() == [0]  # registered lock-on-fault: rollback must undo it


def test_populate_failure_in_populate_first_fails_the_chunk_and_nothing_undoes_it() -> None:
    pipeline = Pipeline(make_chunks([4, 8]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=12)
    spans = [pipeline.next_populate() for _ in range(3)]
    assert spans == [Span(0, 0, 4), Span(1, 4, 4), Span(1, 8, 4)]
    pipeline.populated(Span(0, 0, 4))
    assert pipeline.next_register() == 0
    pipeline.populate_failed(Span(1, 4, 4), error())
    assert pipeline.next_register() is None and pipeline.next_populate() is None
    pipeline.populated(Span(1, 8, 4))  # chunk 1's last span lands, but it is never handed to registration
    assert pipeline.next_register() is None
    pipeline.registered(0)
    assert pipeline.ledger.states == [ChunkState.REGISTERED, ChunkState.FAILED]
    assert [(f.chunk, f.phase) for f in pipeline.ledger.failures] == [(Chunk(4, 8), "populate")]
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.teardown_order() == [0]


def test_two_failed_spans_of_one_chunk_are_both_recorded() -> None:
    pipeline = Pipeline(make_chunks([8]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=8)
    first, second = pipeline.next_populate(), pipeline.next_populate()
    assert isinstance(first, Span) and isinstance(second, Span)
    pipeline.populate_failed(first, error())
    pipeline.populate_failed(second, error())  # both were in flight: both may fail
    assert [(f.chunk, f.phase) for f in pipeline.ledger.failures] == [(Chunk(0, 8), "populate")] * 2
    assert pipeline.ledger.states == [ChunkState.FAILED]
    assert pipeline.next_register() is None
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.teardown_order() == []


def test_lookahead_holds_faulting_until_registration_lands() -> None:
    pipeline = Pipeline(make_chunks([4, 4, 4, 4]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=8)
    assert pipeline.next_populate() == Span(0, 0, 4)
    assert pipeline.next_populate() == Span(1, 4, 4)
    assert pipeline.next_populate() is WAIT  # chunk 2 would make 12 > 8 bytes in the window
    pipeline.populated(Span(0, 0, 4))
    assert pipeline.next_populate() is WAIT  # faulted is not enough: its registration must land
    assert pipeline.next_register() == 0
    assert pipeline.next_populate() is WAIT
    pipeline.registered(0)
    assert pipeline.next_populate() == Span(2, 8, 4)


def test_lookahead_always_admits_the_front_chunk_and_a_failed_registration_leaves_the_window() -> None:
    pipeline = Pipeline(make_chunks([10, 10]), order=Order.POPULATE_FIRST, span_bytes=5, lookahead_bytes=3)
    assert pipeline.next_populate() == Span(0, 0, 5)  # 10 > 3, but the window is empty
    assert pipeline.next_populate() == Span(0, 5, 5)  # the same chunk: already in the window
    assert pipeline.next_populate() is WAIT
    pipeline.populated(Span(0, 0, 5))
    pipeline.populated(Span(0, 5, 5))
    assert pipeline.next_register() == 0
    pipeline.register_failed(0, error("cudaHostRegister"))
    assert pipeline.next_populate() is None  # stopped
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.teardown_order() == []


def test_cancel_stops_every_role_and_rolls_back() -> None:
    for order in Order:
        pipeline = Pipeline(make_chunks([4, 4]), order=order, span_bytes=2, lookahead_bytes=8)
        index = pipeline.next_register() if order is not Order.POPULATE_FIRST else None
        assert index in (0, None)
        pipeline.cancel()
        assert pipeline.stopped
        assert pipeline.next_register() is None and pipeline.next_populate() is None
        if isinstance(index, int):
            pipeline.registered(index)  # the call in flight when the cancel came lands
        assert pipeline.finish() is Phase.ROLLED_BACK
        assert pipeline.ledger.teardown_order() == ([] if index is None else [0])


# -- Pipeline, random interleavings ------------------------------------------------------------------------


@dataclass
class SimWorker:
    kind: str  # "populate" | "register": one role, one item at a time; "any": Pipeline.next_work batches
    items: tuple[int | Span, ...] = ()
    role: str = ""
    outcomes: list[bool] = field(default_factory=list)  # per called item: did it fail
    calling: bool = False  # items[len(outcomes)] is being called
    waiting: bool = False  # got WAIT and has not been woken since
    exited: bool = False


@dataclass(frozen=True)
class SimConfig:
    sizes: tuple[int, ...]
    gaps: tuple[int, ...]
    span_bytes: int
    lookahead_bytes: int
    order: Order
    register_workers: int
    populate_workers: int
    threads: int  # "work" mode's workers; the engine runs populate + register workers, or the larger of the two


# Sizes in MiB, so the engine's batch limits (bytes) make batches of a few items, not of everything.
UNIT = MiB

configs = st.builds(
    SimConfig,
    sizes=st.lists(st.integers(1, 24), min_size=1, max_size=6).map(lambda s: tuple(x * UNIT for x in s)),
    gaps=st.lists(st.integers(0, 2), max_size=6).map(lambda g: tuple(x * UNIT for x in g)),
    span_bytes=st.integers(3, 16).map(lambda x: x * UNIT),
    lookahead_bytes=st.integers(0, 60).map(lambda x: x * UNIT),
    order=st.sampled_from(Order),
    register_workers=st.integers(1, 3),
    populate_workers=st.integers(1, 3),
    threads=st.integers(1, 6),
)


class Simulation:
    """Workers driving one Pipeline in an interleaving hypothesis chooses, checking every invariant.

    ``mode`` "roles": populate workers call next_populate, register workers next_register, one
    item at a time, each outcome recorded as it lands and waking every waiter. "work": what the
    engine's workers do: ``threads`` workers (any number must do) take next_work batches, call
    the items one by one (stopping after a failure, or once pinning stopped), then record the
    outcomes and batch_done together and wake the waiters; a cancel also wakes them.
    """

    def __init__(self, config: SimConfig, mode: str, data: st.DataObject) -> None:
        self.config = config
        self.mode = mode
        self.data = data
        self.chunks = make_chunks(config.sizes, config.gaps)
        self.pipeline = Pipeline(
            self.chunks, order=config.order, span_bytes=config.span_bytes, lookahead_bytes=config.lookahead_bytes,
            register_workers=config.register_workers, populate_workers=config.populate_workers,
        )  # fmt: skip
        if mode == "roles":
            kinds = ["populate"] * config.populate_workers + ["register"] * config.register_workers
        else:
            kinds = ["any"] * config.threads
        self.workers = [SimWorker(kind) for kind in kinds]
        self.expected_spans = () if config.order is Order.REGISTER_ONLY else split_spans(self.chunks, config.span_bytes)
        self.handed_spans: list[Span] = []
        self.claims: list[int] = []
        self.populated: set[Span] = set()
        self.registered: set[int] = set()
        self.register_landed: set[int] = set()  # registered or failed: out of the lookahead window
        self.entered: set[int] = set()  # chunks with a span handed out (POPULATE_FIRST's window, plus landed)
        self.failures: list[tuple[int, str]] = []
        self.stopped = False
        self.first_cause: StopCause | None = None

    # -- one step ------------------------------------------------------------------------------

    def run(self, flakiness: int, cancel_at: int | None) -> None:
        steps = 0
        while True:
            self.check_counts()
            actionable = [w for w in self.workers if not w.exited and not w.waiting]
            if not actionable:
                live = [w for w in self.workers if not w.exited]
                # Every live worker sleeps on WAIT and nothing is in flight to wake them: a deadlock.
                assert not live, (
                    f"deadlock: {len(live)} workers wait, nothing in flight ({self.pipeline.ledger.states})"
                )
                return
            if cancel_at is not None and steps == cancel_at:
                self.pipeline.cancel()
                self.stop(StopCause.CANCELLED)
                self.wake()
            worker = self.data.draw(st.sampled_from(actionable), label="who acts")
            if worker.calling:
                self.call(worker, fail=self.data.draw(st.integers(0, 19), label="outcome") < flakiness)
            elif worker.items:
                self.advance(worker)
            else:
                self.take(worker)
            steps += 1

    def take(self, worker: SimWorker) -> None:
        pipeline = self.pipeline
        got: Span | int | Batch | object
        if worker.kind == "populate":
            got = pipeline.next_populate()
        elif worker.kind == "register":
            got = pipeline.next_register()
        else:
            got = pipeline.next_work()
        if got is None:
            worker.exited = True
            if not self.stopped:  # running out is only allowed with nothing left for this worker's roles
                if worker.kind in ("populate", "any"):
                    assert len(self.handed_spans) == len(self.expected_spans)
                if worker.kind in ("register", "any"):
                    assert pipeline.ledger.pending == 0
            return
        assert not self.stopped, f"handed out {got!r} after pinning stopped"
        if got is WAIT:
            worker.waiting = True
            return
        if isinstance(got, Batch):
            role, items = got.role, got.items
            assert items, "next_work hands out non-empty batches"
        else:
            assert isinstance(got, Span | int)
            role, items = worker.kind, (got,)
        for item in items:
            if role == "populate":
                assert isinstance(item, Span)
                self.handed_span(item)
            else:
                assert role == "register" and isinstance(item, int)
                self.handed_chunk(item)
        worker.items, worker.role, worker.outcomes, worker.calling = items, role, [], True
        self.check_window()

    def handed_span(self, span: Span) -> None:
        order = self.config.order
        assert order is not Order.REGISTER_ONLY
        assert span == self.expected_spans[len(self.handed_spans)], "spans are handed out once each, in order"
        self.handed_spans.append(span)
        if order is Order.REGISTER_FIRST:
            assert span.chunk in self.registered, f"{span} handed out before chunk {span.chunk} registered"
        self.entered.add(span.chunk)

    def handed_chunk(self, index: int) -> None:
        assert index not in self.claims, f"chunk {index} claimed twice"
        self.claims.append(index)
        if self.config.order is Order.POPULATE_FIRST:
            mine = {s for s in self.expected_spans if s.chunk == index}
            assert mine <= self.populated, f"chunk {index} handed to registration before all its spans were faulted"
        else:
            assert self.claims == list(range(len(self.claims))), "chunks are claimed in offset order"

    def check_window(self) -> None:
        if self.config.order is not Order.POPULATE_FIRST:
            return
        window = self.entered - self.register_landed
        nbytes = sum(self.chunks[i].nbytes for i in window)
        assert nbytes <= self.config.lookahead_bytes or len(window) == 1, (
            f"faulting ran {nbytes} B ({sorted(window)}) ahead of registration, lookahead {self.config.lookahead_bytes}"
        )

    def call(self, worker: SimWorker, *, fail: bool) -> None:
        worker.outcomes.append(fail)
        worker.calling = False
        if self.mode == "roles":
            self.record(worker.items[0], fail)
            worker.items = ()
            self.wake()

    def advance(self, worker: SimWorker) -> None:
        """Between a batch's calls: call the next item, or (done, failed, or pinning stopped) land the batch."""
        called = len(worker.outcomes)
        if called < len(worker.items) and not worker.outcomes[-1] and not self.pipeline.stopped:
            worker.calling = True
            return
        for item, fail in zip(worker.items, worker.outcomes, strict=False):
            self.record(item, fail)
        unstarted = worker.items[called:]
        self.pipeline.batch_done(worker.role, unstarted)
        for item in unstarted:
            if isinstance(item, int):
                self.claims.remove(item)  # pending again (though nothing claims it after a stop)
        worker.items, worker.outcomes = (), []
        self.wake()

    def record(self, item: int | Span, fail: bool) -> None:
        pipeline = self.pipeline
        if isinstance(item, Span):
            if fail:
                pipeline.populate_failed(item, error())
                self.failures.append((item.chunk, "populate"))
            else:
                pipeline.populated(item)
                self.populated.add(item)
        else:
            if fail:
                pipeline.register_failed(item, error("cudaHostRegister"))
                self.failures.append((item, "register"))
            else:
                pipeline.registered(item)
                self.registered.add(item)
            self.register_landed.add(item)
        if fail:
            self.stop(StopCause.FAILURE)

    def stop(self, cause: StopCause) -> None:
        if not self.stopped:
            self.stopped, self.first_cause = True, cause

    def wake(self) -> None:
        for worker in self.workers:
            worker.waiting = False

    def check_counts(self) -> None:
        out = sum(len(w.items) for w in self.workers)  # a batch's items are in flight until it lands
        assert self.pipeline.in_flight == out, "in_flight counts every handed-out item not yet landed or returned"

    # -- the end -------------------------------------------------------------------------------

    def check_end(self) -> None:
        pipeline, ledger = self.pipeline, self.pipeline.ledger
        assert pipeline.in_flight == 0
        assert pipeline.next_populate() is None and pipeline.next_register() is None
        phase = pipeline.finish()
        states = ledger.states
        undo = {ChunkState.REGISTERED, ChunkState.FAULTING}
        assert {i for i, s in enumerate(states) if s in undo} == self.registered
        assert ledger.teardown_order() == sorted(self.registered, reverse=True)
        # Pinned means registered with every page in: lock-on-fault chunks only once all their spans landed.
        faulted = {i for i in self.registered if all(s in self.populated for s in self.expected_spans if s.chunk == i)}
        pinned = faulted if self.config.order is Order.REGISTER_FIRST else self.registered
        assert {i for i, s in enumerate(states) if s is ChunkState.REGISTERED} == pinned
        assert ledger.registered_bytes == sum(self.chunks[i].nbytes for i in pinned)
        assert [(ledger.chunks.index(f.chunk), f.phase) for f in ledger.failures] == self.failures
        assert pipeline.populated_bytes == sum(s.nbytes for s in self.populated)
        if self.stopped:
            assert phase is Phase.ROLLED_BACK
            assert ledger.stop_cause is self.first_cause is not None
            for index, phase_name in self.failures:
                expected = ChunkState.FAILED
                if phase_name == "populate" and self.config.order is Order.REGISTER_FIRST:
                    expected = ChunkState.FAULTING  # registered lock-on-fault, never fully faulted
                assert states[index] is expected
        else:
            assert phase is Phase.PINNED
            assert self.failures == [] and self.first_cause is None
            assert states == [ChunkState.REGISTERED] * len(self.chunks)
            assert set(self.handed_spans) == set(self.expected_spans) == self.populated
            if self.config.order is Order.REGISTER_ONLY:
                assert pipeline.populated_bytes == 0
            else:
                assert pipeline.populated_bytes == sum(self.config.sizes)


@pytest.mark.parametrize("mode", ["roles", "work"])
@settings(max_examples=300, deadline=None)
@given(config=configs, data=st.data())
def test_random_interleavings_keep_every_invariant(mode: str, config: SimConfig, data: st.DataObject) -> None:
    flakiness = data.draw(st.sampled_from([0, 0, 1, 4]), label="failures in 20 calls")
    cancel_at = data.draw(st.none() | st.integers(0, 120), label="cancel at step")
    sim = Simulation(config, mode, data)
    sim.run(flakiness, cancel_at)
    sim.check_end()
    event(f"{config.order.value}: {sim.first_cause.value if sim.first_cause else 'pinned'}")
    event(f"chunks registered: {len(sim.registered)} of {len(sim.chunks)}")


@pytest.mark.parametrize("order", list(Order))
@pytest.mark.parametrize("mode", ["roles", "work"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_clean_runs_pin_everything_in_every_order(mode: str, order: Order, data: st.DataObject) -> None:
    """Not left to chance: with no failure and no cancel, each order pins everything, in any interleaving."""
    config = SimConfig(
        sizes=(9 * UNIT, 3 * UNIT, 12 * UNIT, 1 * UNIT, 16 * UNIT), gaps=(UNIT,), span_bytes=4 * UNIT,
        lookahead_bytes=10 * UNIT, order=order, register_workers=2, populate_workers=2, threads=3,
    )  # fmt: skip
    sim = Simulation(config, mode, data)
    sim.run(flakiness=0, cancel_at=None)
    assert not sim.stopped
    sim.check_end()


# -- the pool, against FakeRuntime ---------------------------------------------------------------------------


def assert_rolled_back(fake: FakeRuntime, failed_register_calls: frozenset[int] = frozenset()) -> None:
    """Nothing registered; every successful register base unregistered exactly once."""
    assert fake.registered == {}
    succeeded = [ptr for i, (ptr, _n) in enumerate(fake.register_calls, 1) if i not in failed_register_calls]
    assert sorted(fake.unregister_calls) == sorted(succeeded)
    assert len(set(fake.unregister_calls)) == len(fake.unregister_calls)


def chunk_of(pool: pinpool.PinnedPool, base: int, ptr: int) -> int:
    (index,) = [i for i, c in enumerate(pool.chunks) if base + c.offset <= ptr < base + c.end]
    return index


def test_populate_is_on_by_default_for_the_fake() -> None:
    fake = FakeRuntime()
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=32 * MiB, runtime=fake, populate_workers=2)
    assert pool.populate is True and pool.order is Order.POPULATE_FIRST
    assert pool.span_bytes == 16 * MiB and pool.populate_workers == 2
    with pool as p:
        base = p.data_ptr
    assert sorted(fake.populate_calls) == [(base + k * 16 * MiB, 16 * MiB) for k in range(4)]
    assert_rolled_back(fake)


@each_driver
async def test_populate_first_registers_each_chunk_after_all_its_spans(mode: str) -> None:
    fake = FakeRuntime(populate_delay=0.001, register_delay=0.002)
    pool = pinpool.PinnedPool(
        size=512 * MiB, chunk_bytes=64 * MiB, runtime=fake, populate_workers=4, register_workers=2
    )
    assert pool.order is Order.POPULATE_FIRST and pool.span_bytes == 16 * MiB
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr, registered=len(fake.registered)))
    base = seen["base"]
    assert seen["registered"] == len(pool.chunks) == 8
    # The spans tile every chunk exactly.
    assert sorted(fake.populate_calls) == [(base + s.offset, s.nbytes) for s in split_spans(pool.chunks, 16 * MiB)]
    events = fake.events
    for index, chunk in enumerate(pool.chunks):
        (register_at,) = [
            i for i, (kind, ptr) in enumerate(events) if kind == "register" and ptr == base + chunk.offset
        ]
        populate_at = [
            i for i, (kind, ptr) in enumerate(events) if kind == "populate" and chunk_of(pool, base, ptr) == index
        ]
        assert len(populate_at) == 4
        assert max(populate_at) < register_at, f"chunk {index} registered before all its spans were faulted"
    assert_rolled_back(fake)


@each_driver
async def test_lock_on_fault_registers_each_chunk_before_faulting_it(mode: str) -> None:
    fake = FakeRuntime(lock_on_fault=True, populate_delay=0.001, register_delay=0.002)
    pool = pinpool.PinnedPool(
        size=512 * MiB, chunk_bytes=64 * MiB, runtime=fake, populate_workers=4, register_workers=2
    )
    assert pool.order is Order.REGISTER_FIRST
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr, registered=len(fake.registered)))
    base = seen["base"]
    assert seen["registered"] == 8
    assert len(fake.populate_calls) == 32
    events = fake.events
    register_at = {ptr: i for i, (kind, ptr) in enumerate(events) if kind == "register"}
    for i, (kind, ptr) in enumerate(events):
        if kind == "populate":
            chunk = pool.chunks[chunk_of(pool, base, ptr)]
            assert register_at[base + chunk.offset] < i, f"span at {ptr - base} faulted before its chunk registered"
    assert_rolled_back(fake)


@pytest.mark.skipif(_libc.transparent_huge_pages_mode() not in ("always", "madvise"), reason="needs THP")
def test_huge_pages_fault_first_even_under_lock_on_fault() -> None:
    pool = pinpool.PinnedPool(size=8 * MiB, runtime=FakeRuntime(lock_on_fault=True), huge_pages=True)
    assert pool.order is Order.POPULATE_FIRST


@pytest.mark.parametrize("lock_on_fault", [False, True])
@each_driver
async def test_populate_false_only_registers(mode: str, lock_on_fault: bool) -> None:
    fake = FakeRuntime(lock_on_fault=lock_on_fault)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, populate=False, register_workers=2)
    assert pool.populate is False and pool.order is Order.REGISTER_ONLY
    assert pool.populate_workers == 0 and pool.span_bytes == 0
    await pin_and_run(pool, mode, lambda p: None)
    assert fake.populate_calls == []
    assert [kind for kind, _ptr in fake.events if kind != "unregister"] == ["register"] * 8
    assert_rolled_back(fake)


@pytest.mark.parametrize("fail_on", [1, 6, 13])
@pytest.mark.parametrize("lock_on_fault", [False, True])
@each_driver
async def test_populate_failure_rolls_back_in_both_orders(mode: str, lock_on_fault: bool, fail_on: int) -> None:
    fake = FakeRuntime(fail_populate_on=fail_on, lock_on_fault=lock_on_fault, populate_delay=0.001)
    pool = pinpool.PinnedPool(
        size=512 * MiB, chunk_bytes=64 * MiB, runtime=fake, populate_workers=4, register_workers=2
    )
    assert len(split_spans(pool.chunks, pool.span_bytes)) == 32
    assert pool.order is (Order.REGISTER_FIRST if lock_on_fault else Order.POPULATE_FIRST)
    with pytest.raises(pinpool.PinError) as info:
        await pin_and_run(pool, mode, lambda p: pytest.fail("body must not run after a failure"))
    error = info.value
    assert error.phase == "populate" and error.reason == "ENOMEM" and error.code == 12
    assert [f.phase for f in error.failures] == ["populate"]
    assert error.leaked == ()
    assert isinstance(error.__cause__, pinpool.RuntimeCallError)
    failed_ptr = fake.populate_calls[fail_on - 1][0]
    # the fake's registrations all succeed; the failed chunk is the one holding the failed span
    bases = {ptr for ptr, _n in fake.register_calls}
    base = min(p for p, _n in fake.populate_calls)  # the first span (chunk 0's start) is always faulted
    failed_chunk = pool.chunks[chunk_of(pool, base, failed_ptr)]
    assert error.offset == failed_chunk.offset
    if lock_on_fault:
        assert base + failed_chunk.offset in fake.unregister_calls  # registered first, so rolled back
    else:
        assert base + failed_chunk.offset not in bases  # never handed to registration
    assert_rolled_back(fake)
    with pytest.raises(pinpool.PoolStateError):
        _ = pool.tensor


@pytest.mark.parametrize("lock_on_fault", [False, True])
@each_driver
async def test_two_spans_failing_at_once_are_both_reported(mode: str, lock_on_fault: bool) -> None:
    meet = threading.Barrier(2, timeout=10)

    class Together(FakeRuntime):
        def populate(self, ptr: int, nbytes: int) -> None:
            meet.wait()  # both spans of the chunk are out before either fails
            super().populate(ptr, nbytes)

    fake = Together(fail_populate_on={1, 2}, lock_on_fault=lock_on_fault)
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=64 * MiB, runtime=fake, populate_workers=2)
    assert len(pool.chunks) == 1 and pool.span_bytes == 32 * MiB and pool.populate_workers == 2
    with pytest.raises(pinpool.PinError) as info:
        await pin_and_run(pool, mode, lambda p: pytest.fail("body must not run after a failure"))
    assert [(f.chunk.offset, f.phase) for f in info.value.failures] == [(0, "populate")] * 2
    assert len(fake.register_calls) == (1 if lock_on_fault else 0)
    assert_rolled_back(fake)


@pytest.mark.parametrize("lock_on_fault", [False, True])
async def test_cancellation_while_faulting_rolls_back(lock_on_fault: bool) -> None:
    fake = FakeRuntime(lock_on_fault=lock_on_fault, populate_delay=0.02)
    pool = pinpool.PinnedPool(
        size=2048 * MiB, chunk_bytes=32 * MiB, runtime=fake, populate_workers=2, register_workers=2
    )
    spans = len(split_spans(pool.chunks, pool.span_bytes))
    assert spans == 128
    with anyio.move_on_after(0.1) as scope:
        async with pool:
            pytest.fail("body must not run")
    assert scope.cancelled_caught
    assert len(fake.populate_calls) < spans  # the workers stopped after their current calls
    assert_rolled_back(fake)
    assert pool.pinned_bytes == 0


@pytest.mark.parametrize("lock_on_fault", [False, True])
async def test_cancellation_from_inside_a_populate_call_rolls_back(lock_on_fault: bool) -> None:
    scope = anyio.CancelScope()
    token = anyio.lowlevel.current_token()  # pinpool's workers are plain threads

    class CancelOnFifth(FakeRuntime):
        def populate(self, ptr: int, nbytes: int) -> None:
            super().populate(ptr, nbytes)
            if len(self.populate_calls) == 5:
                anyio.from_thread.run_sync(scope.cancel, token=token)
                # Return only once the driver has told the workers to stop (it notifies the condition).
                session = pool._lifecycle.session
                assert session is not None
                with session._changed:
                    assert session._changed.wait_for(lambda: session.pipeline.stopped, timeout=10)

    fake = CancelOnFifth(lock_on_fault=lock_on_fault)
    pool = pinpool.PinnedPool(
        size=512 * MiB, chunk_bytes=32 * MiB, runtime=fake, populate_workers=1, register_workers=1
    )
    assert len(pool.chunks) == 16 and pool.span_bytes == 32 * MiB  # a span per chunk
    with scope:
        async with pool:
            pytest.fail("body must not run")
    assert scope.cancelled_caught
    assert len(fake.populate_calls) == 5  # one populate worker: nothing else was out
    if lock_on_fault:
        assert len(fake.register_calls) >= 5  # each faulted chunk was registered first
    else:
        assert len(fake.register_calls) <= 4  # only chunks faulted before the cancel
    assert_rolled_back(fake)
    assert pool.pinned_bytes == 0


@each_driver
async def test_a_failure_ends_a_batch_at_once(mode: str) -> None:
    fake = FakeRuntime(fail_register_on=5)
    # One worker, 64 one-page chunks: they go out as one batch, called one by one.
    pool = pinpool.PinnedPool(size=64 * 4096, chunk_bytes=4096, runtime=fake, populate=False, register_workers=1)
    assert len(pool.chunks) == 64 and pool.threads == 1
    with pytest.raises(pinpool.PinError) as info:
        await pin_and_run(pool, mode, lambda p: pytest.fail("body must not run after a failure"))
    assert info.value.offset == 4 * 4096 and info.value.phase == "register"
    assert len(fake.register_calls) == 5  # nothing of the batch was called after its failed item
    assert_rolled_back(fake, frozenset({5}))


async def test_a_cancel_ends_a_batch_after_the_current_call() -> None:
    scope = anyio.CancelScope()
    token = anyio.lowlevel.current_token()  # pinpool's workers are plain threads

    class CancelOnFifth(FakeRuntime):
        def register(self, ptr: int, nbytes: int) -> None:
            super().register(ptr, nbytes)
            if len(self.register_calls) == 5:
                anyio.from_thread.run_sync(scope.cancel, token=token)
                session = pool._lifecycle.session
                assert session is not None
                with session._changed:
                    assert session._changed.wait_for(lambda: session.pipeline.stopped, timeout=10)

    fake = CancelOnFifth()
    pool = pinpool.PinnedPool(size=64 * 4096, chunk_bytes=4096, runtime=fake, populate=False, register_workers=1)
    with scope:
        async with pool:
            pytest.fail("body must not run")
    assert scope.cancelled_caught
    assert len(fake.register_calls) == 5
    assert_rolled_back(fake)


class Logging(FakeRuntime):
    """FakeRuntime that also logs when each register call ends, and how many unregisters overlap."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.log: list[tuple[str, int]] = []
        self.unregistering = 0
        self.max_concurrent_unregisters = 0
        self._log_lock = threading.Lock()

    def populate(self, ptr: int, nbytes: int) -> None:
        with self._log_lock:
            self.log.append(("populate", ptr))
        super().populate(ptr, nbytes)

    def register(self, ptr: int, nbytes: int) -> None:
        try:
            super().register(ptr, nbytes)
        finally:
            with self._log_lock:
                self.log.append(("registered", ptr))

    def unregister(self, ptr: int) -> None:
        with self._log_lock:
            self.unregistering += 1
            self.max_concurrent_unregisters = max(self.max_concurrent_unregisters, self.unregistering)
        try:
            super().unregister(ptr)
        finally:
            with self._log_lock:
                self.unregistering -= 1


@each_driver
async def test_faulting_runs_ahead_of_registration_by_at_most_the_lookahead(mode: str) -> None:
    ran_ahead = threading.Event()

    class HoldFirst(Logging):
        """The first registration waits until another chunk is being faulted: faulting must run ahead."""

        holding: tuple[int, int] | None = None

        def populate(self, ptr: int, nbytes: int) -> None:
            with self._log_lock:
                self.log.append(("populate", ptr))
                if self.holding is not None and not self.holding[0] <= ptr < self.holding[0] + self.holding[1]:
                    ran_ahead.set()
            FakeRuntime.populate(self, ptr, nbytes)

        def register(self, ptr: int, nbytes: int) -> None:
            with self._log_lock:
                first = not self.register_calls
                if first and any(not ptr <= p < ptr + nbytes for kind, p in self.log if kind == "populate"):
                    ran_ahead.set()
                self.holding = (ptr, nbytes)
            if first:
                assert ran_ahead.wait(10), "no other chunk was faulted while the first one registered"
            super().register(ptr, nbytes)

    fake = HoldFirst(register_delay=0.02, populate_delay=0.001)
    pool = pinpool.PinnedPool(
        size=768 * MiB, chunk_bytes=64 * MiB, runtime=fake, populate_workers=2, register_workers=1
    )
    assert pool.order is Order.POPULATE_FIRST and len(pool.chunks) == 12
    assert pool.span_bytes == 32 * MiB and pool.lookahead_bytes == 128 * MiB
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr))
    base = seen["base"]
    assert ran_ahead.is_set()
    # Replay the log: the window is every chunk with a span started whose registration has not ended.
    # The log sees a span start after the pipeline admitted it, and a registration end before the
    # pipeline hears of it, so this window is never larger than the pipeline's.
    window: set[int] = set()
    largest = 0
    for kind, ptr in fake.log:
        index = chunk_of(pool, base, ptr)
        if kind == "populate":
            window.add(index)
            nbytes = sum(pool.chunks[i].nbytes for i in window)
            assert nbytes <= pool.lookahead_bytes or len(window) == 1, f"window {sorted(window)} over the lookahead"
            largest = max(largest, len(window))
        else:
            window.discard(index)
    assert largest == pool.lookahead_bytes // pool.chunk_bytes == 2  # it ran ahead, as far as allowed
    assert len(fake.populate_calls) == 24
    assert_rolled_back(fake)


@each_driver
async def test_parallel_teardown_unregisters_every_chunk_once(mode: str) -> None:
    meet = threading.Barrier(2, timeout=10)

    class Overlapping(Logging):
        arrivals = 0

        def unregister(self, ptr: int) -> None:
            with self._log_lock:
                arrival = self.arrivals
                self.arrivals += 1
            if arrival < 2:
                meet.wait()  # the first two calls meet: the barrier breaks (an unpin failure) if teardown is serial
            super().unregister(ptr)

    fake = Overlapping(unregister_delay=0.02)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, unpin_workers=4, populate=False)
    assert pool.unpin_workers == 4 and len(pool.chunks) == 8
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr))
    assert 2 <= fake.max_concurrent_unregisters <= 4
    assert sorted(fake.unregister_calls) == [seen["base"] + c.offset for c in pool.chunks]
    assert_rolled_back(fake)
    assert pool.pinned_bytes == 0


@each_driver
async def test_one_unpin_worker_unregisters_in_reverse_offset_order(mode: str) -> None:
    fake = Logging(unregister_delay=0.002)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, unpin_workers=1, register_workers=3)
    assert pool.unpin_workers == 1
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr))
    assert fake.unregister_calls == [seen["base"] + c.offset for c in reversed(pool.chunks)]
    assert fake.max_concurrent_unregisters == 1
    assert_rolled_back(fake)


def test_unpin_workers_are_capped_by_the_chunk_count() -> None:
    pool = pinpool.PinnedPool(size=3 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(), unpin_workers=8)
    assert pool.unpin_workers == 3


# -- configuration errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("populate_workers", 0),
        ("populate_workers", "2"),
        ("populate_workers", True),
        ("populate_workers", 1.5),
        ("register_workers", 0),
        ("register_workers", False),
        ("unpin_workers", -1),
        ("unpin_workers", 0),
        ("huge_pages", "yes"),
        ("huge_pages", 1),
        ("numa_node", 99),
        ("numa_node", -1),
        ("numa_node", True),
        ("populate", "yes"),
    ],
)
def test_bad_options_are_config_errors_before_anything_is_registered(option: str, value: object) -> None:
    fake = FakeRuntime()
    with pytest.raises(pinpool.ConfigError, match=re.escape(f"{option}={value!r}")):
        pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, **{option: value})  # type: ignore[arg-type]
    assert fake.register_calls == [] and fake.populate_calls == [] and fake.events == []


@hugetlb_pages
def test_hugetlb_without_free_pages_is_a_config_error() -> None:
    free = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
    try:
        free_pages = int(free.read_text())
    except OSError:
        pytest.skip("no 2 MiB hugetlb pool on this kernel")
    if free_pages != 0:
        pytest.skip(f"{free_pages} free hugetlb pages: the pool might fit")
    fake = FakeRuntime()
    with pytest.raises(pinpool.ConfigError, match="nr_hugepages") as info:
        pinpool.PinnedPool(size=8 * MiB, chunk_bytes=2 * MiB, runtime=fake, huge_pages="hugetlb")
    assert "hugetlb" in str(info.value)
    assert fake.register_calls == [] and fake.events == []


def test_finalizer_leaves_a_pool_alone_while_a_populate_call_runs() -> None:
    """The finalizer must not tear down under a running worker (its driver finishes the job)."""
    release, started = threading.Event(), threading.Event()

    class Slow(FakeRuntime):
        def populate(self, ptr: int, nbytes: int) -> None:
            started.set()
            release.wait(10)
            super().populate(ptr, nbytes)

    fake = Slow(lock_on_fault=True)
    pool = pinpool.PinnedPool(size=4 * MiB, chunk_bytes=4 * MiB, runtime=fake, populate_workers=1, registry=None)
    errors: list[BaseException] = []

    def enter() -> None:
        try:
            pool.__enter__()
        except BaseException as exc:  # pragma: no cover - the failure this test guards against
            errors.append(exc)

    thread = threading.Thread(target=enter)
    thread.start()
    assert started.wait(10)
    assert pool._finalizer is not None
    pool._finalizer()  # nothing happens: a populate call is in flight
    assert fake.unregister_calls == []
    release.set()
    thread.join(10)
    assert errors == [] and pool.pinned_bytes == 4 * MiB  # the driver finished pinning normally
    pool.__exit__(None, None, None)
    assert fake.registered == {}


def test_a_role_in_use_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="populate_workers=0"):
        Pipeline([Chunk(0, 4)], order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=4, populate_workers=0)
    with pytest.raises(ValueError, match="register_workers=0"):
        Pipeline([Chunk(0, 4)], order=Order.REGISTER_ONLY, register_workers=0)
    Pipeline([Chunk(0, 4)], order=Order.REGISTER_ONLY, populate_workers=0)  # no spans: no populate worker needed


def _gauge(registry: object, name: str) -> float:
    from prometheus_client import CollectorRegistry

    assert isinstance(registry, CollectorRegistry)
    value = registry.get_sample_value(name, {"pool": "lof", "runtime": "fake"})
    return 0.0 if value is None else value


def test_lock_on_fault_chunks_count_as_pinned_only_once_faulted() -> None:
    """Progress, pool.pinned_bytes and the pinned gauge must not jump to 100% at the cheap lock-on-fault calls."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    fake = FakeRuntime(lock_on_fault=True, populate_delay=0.1)
    seen: list[tuple[int, int]] = []
    pool = pinpool.PinnedPool(
        size=64 * MiB, chunk_bytes=16 * MiB, runtime=fake, populate_workers=1, register_workers=4, name="lof",
        registry=registry, on_progress=lambda pinned, total, done, chunks: seen.append((pinned, done)),
    )  # fmt: skip
    assert pool.order is Order.REGISTER_FIRST and pool.span_bytes == 16 * MiB
    with pool:
        assert pool.pinned_bytes == 64 * MiB
        assert _gauge(registry, "pinpool_pinned_bytes") == 64 * MiB
    # All four chunks were lock-on-fault registered at once, but progress climbed chunk by chunk.
    assert seen[-1] == (64 * MiB, 4)
    assert any(0 < pinned < 64 * MiB for pinned, _ in seen), seen
    assert [pinned for pinned, _ in seen] == sorted(pinned for pinned, _ in seen)
    assert _gauge(registry, "pinpool_pinned_bytes") == 0
    assert _gauge(registry, "pinpool_registered_bytes_total") == 64 * MiB


def test_rollback_of_a_half_faulted_lock_on_fault_chunk_keeps_the_gauge_at_zero() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    fake = FakeRuntime(lock_on_fault=True, fail_populate_on=2)  # chunk 0 faults fully, chunk 1 fails
    pool = pinpool.PinnedPool(
        size=32 * MiB, chunk_bytes=16 * MiB, runtime=fake, populate_workers=1, register_workers=1, name="lof",
        registry=registry,
    )  # fmt: skip
    with pytest.raises(pinpool.PinError) as info:
        with pool:
            pytest.fail("body must not run")
    assert info.value.phase == "populate"
    assert fake.registered == {} and sorted(fake.unregister_calls) == sorted(p for p, _ in fake.register_calls)
    assert _gauge(registry, "pinpool_pinned_bytes") == 0  # never below zero, never left above it
    assert pool.pinned_bytes == 0
