"""The pinning pipeline: pure `SpanTable` and `Pipeline`, then its orders, lookahead and teardown in a pool."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
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
from pinpool import Chunk, RuntimeCallError
from pinpool._errors import ChunkFailure, LedgerError
from pinpool._host import libc as _libc
from pinpool._pin import WAIT, Batch, ChunkState, Landing, Phase, Pipeline, StopCause
from pinpool._plan import Order, PrefixTracker, Span, SpanTable
from pinpool.testing import FakeRuntime

from ..conftest import each_driver, hugetlb_pages, lifecycle_of, pin_and_run
from ..depth import depth, runs

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


# -- SpanTable ----------------------------------------------------------------------------------------


def test_split_spans_example() -> None:
    chunks = [Chunk(0, 10), Chunk(10, 3), Chunk(16, 8)]
    assert SpanTable(chunks, 4) == (
        Span(0, 0, 4), Span(0, 4, 4), Span(0, 8, 2),
        Span(1, 10, 3),
        Span(2, 16, 4), Span(2, 20, 4),
    )  # fmt: skip
    assert SpanTable(chunks, 100) == (Span(0, 0, 10), Span(1, 10, 3), Span(2, 16, 8))
    assert SpanTable([], 4) == ()


@pytest.mark.parametrize("span_bytes", [0, -1, -4096])
def test_split_spans_rejects_non_positive_span_bytes(span_bytes: int) -> None:
    with pytest.raises(ValueError, match=f"span_bytes={span_bytes}"):
        SpanTable([Chunk(0, 10)], span_bytes)


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), max_size=8),
    gaps=st.lists(st.integers(0, 50), max_size=8),
    start=st.integers(0, 1000),
    span_bytes=st.integers(1, 64),
)
def test_split_spans_cover_each_chunk_exactly(sizes: list[int], gaps: list[int], start: int, span_bytes: int) -> None:
    chunks = make_chunks(sizes, gaps, start=start)
    spans = SpanTable(chunks, span_bytes)
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
        pipeline.land(Landing(index))
    assert pipeline.finish() is Phase.PINNED
    assert pipeline.populated_bytes == 0


def test_populate_first_registers_a_chunk_only_once_all_its_spans_landed() -> None:
    pipeline = Pipeline(make_chunks([12]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=12)
    assert pipeline.next_register() is WAIT  # nothing faulted yet
    spans = [pipeline.next_populate() for _ in range(3)]
    assert spans == [Span(0, 0, 4), Span(0, 4, 4), Span(0, 8, 4)]
    assert pipeline.next_populate() is None
    pipeline.land(Landing(Span(0, 8, 4)))
    pipeline.land(Landing(Span(0, 0, 4)))
    assert pipeline.next_register() is WAIT  # one span still faulting
    pipeline.land(Landing(Span(0, 4, 4)))
    assert pipeline.next_register() == 0
    assert pipeline.next_register() is None
    pipeline.land(Landing(0))
    assert pipeline.finish() is Phase.PINNED
    assert pipeline.populated_bytes == 12


def test_register_first_faults_a_chunk_only_once_it_is_registered() -> None:
    pipeline = Pipeline(make_chunks([8, 8]), order=Order.REGISTER_FIRST, span_bytes=4)
    assert pipeline.next_populate() is WAIT  # chunk 0 is not registered yet
    assert pipeline.next_register() == 0
    assert pipeline.next_populate() is WAIT  # registering, not registered
    pipeline.land(Landing(0))
    assert pipeline.next_populate() == Span(0, 0, 4)
    assert pipeline.next_populate() == Span(0, 4, 4)
    assert pipeline.next_populate() is WAIT  # chunk 1 is still pending
    assert pipeline.next_register() == 1
    assert pipeline.next_register() is None
    pipeline.land(Landing(1))
    spans = [pipeline.next_populate(), pipeline.next_populate()]
    assert spans == [Span(1, 8, 4), Span(1, 12, 4)]
    assert pipeline.next_populate() is None
    for span in [Span(0, 0, 4), Span(0, 4, 4), Span(1, 8, 4)]:
        pipeline.land(Landing(span))
    with pytest.raises(LedgerError, match="1 populate calls in flight"):
        pipeline.finish()
    pipeline.land(Landing(Span(1, 12, 4)))
    assert pipeline.finish() is Phase.PINNED
    assert pipeline.populated_bytes == 16


def test_finish_raises_while_a_populate_is_in_flight() -> None:
    for order in (Order.POPULATE_FIRST, Order.REGISTER_FIRST):
        pipeline = Pipeline(make_chunks([4, 4]), order=order, span_bytes=4, lookahead_bytes=8)
        if order is Order.REGISTER_FIRST:
            pipeline.land(Landing(pipeline.next_register()))  # type: ignore[arg-type]
        span = pipeline.next_populate()
        assert isinstance(span, Span)
        pipeline.ledger.cancel()  # not even a stopped pipeline may close with a call out
        with pytest.raises(LedgerError, match="populate calls in flight"):
            pipeline.finish()
        assert pipeline.ledger.phase is Phase.PINNING
        pipeline.land(Landing(span))
        assert pipeline.finish() is Phase.ROLLED_BACK


def test_populate_failure_in_register_first_leaves_the_chunk_registered() -> None:
    pipeline = Pipeline(make_chunks([8, 8]), order=Order.REGISTER_FIRST, span_bytes=4)
    pipeline.land(Landing(pipeline.next_register()))  # type: ignore[arg-type]
    first, second = pipeline.next_populate(), pipeline.next_populate()
    assert isinstance(first, Span) and isinstance(second, Span)
    failure = error()
    pipeline.land(Landing(second, failure))
    assert pipeline.stopped
    assert pipeline.next_populate() is None and pipeline.next_register() is None
    pipeline.land(Landing(first))  # the call still out lands normally
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
    pipeline.land(Landing(Span(0, 0, 4)))
    assert pipeline.next_register() == 0
    pipeline.land(Landing(Span(1, 4, 4), error()))
    assert pipeline.next_register() is None and pipeline.next_populate() is None
    pipeline.land(Landing(Span(1, 8, 4)))  # chunk 1's last span lands, but it is never handed to registration
    assert pipeline.next_register() is None
    pipeline.land(Landing(0))
    assert pipeline.ledger.states == [ChunkState.REGISTERED, ChunkState.FAILED]
    assert [(f.chunk, f.phase) for f in pipeline.ledger.failures] == [(Chunk(4, 8), "populate")]
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.teardown_order() == [0]


def test_two_failed_spans_of_one_chunk_are_both_recorded() -> None:
    pipeline = Pipeline(make_chunks([8]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=8)
    first, second = pipeline.next_populate(), pipeline.next_populate()
    assert isinstance(first, Span) and isinstance(second, Span)
    pipeline.land(Landing(first, error()))
    pipeline.land(Landing(second, error()))  # both were in flight: both may fail
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
    pipeline.land(Landing(Span(0, 0, 4)))
    assert pipeline.next_populate() is WAIT  # faulted is not enough: its registration must land
    assert pipeline.next_register() == 0
    assert pipeline.next_populate() is WAIT
    pipeline.land(Landing(0))
    assert pipeline.next_populate() == Span(2, 8, 4)


def test_lookahead_always_admits_the_front_chunk_and_a_failed_registration_leaves_the_window() -> None:
    pipeline = Pipeline(make_chunks([10, 10]), order=Order.POPULATE_FIRST, span_bytes=5, lookahead_bytes=3)
    assert pipeline.next_populate() == Span(0, 0, 5)  # 10 > 3, but the window is empty
    assert pipeline.next_populate() == Span(0, 5, 5)  # the same chunk: already in the window
    assert pipeline.next_populate() is WAIT
    pipeline.land(Landing(Span(0, 0, 5)))
    pipeline.land(Landing(Span(0, 5, 5)))
    assert pipeline.next_register() == 0
    pipeline.land(Landing(0, error("cudaHostRegister")))
    assert pipeline.next_populate() is None  # stopped
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.teardown_order() == []


def test_cancel_stops_every_role_and_rolls_back() -> None:
    for order in Order:
        pipeline = Pipeline(make_chunks([4, 4]), order=order, span_bytes=2, lookahead_bytes=8)
        index = pipeline.next_register() if order is not Order.POPULATE_FIRST else None
        assert index in (0, None)
        pipeline.ledger.cancel()
        assert pipeline.stopped
        assert pipeline.next_register() is None and pipeline.next_populate() is None
        if isinstance(index, int):
            pipeline.land(Landing(index))  # the call in flight when the cancel came lands
        assert pipeline.finish() is Phase.ROLLED_BACK
        assert pipeline.ledger.teardown_order() == ([] if index is None else [0])


def test_a_landing_that_contradicts_itself_is_refused() -> None:
    pipeline = Pipeline(make_chunks([8]), order=Order.REGISTER_ONLY)
    index = pipeline.next_register()
    assert index == 0
    with pytest.raises(LedgerError, match="both failed and stopped"):
        pipeline.land(Landing(index, error(), stopped=True))
    for progress in (Landing(index, partial=True), Landing(index, error(), pieces=(Chunk(0, 4),), partial=True)):
        with pytest.raises(LedgerError, match="must name its pieces and nothing else"):
            pipeline.land(progress)
    assert pipeline.in_flight == 1  # refused landings change nothing
    pipeline.land(Landing(index))
    assert pipeline.finish() is Phase.PINNED


def test_a_chunk_stopped_between_its_pieces_is_undone_and_is_not_a_failure() -> None:
    """The stall budget registers a chunk piece by piece; pinning stops between two of them: the
    pieces registered go on the books to be undone (each by its own base), the chunk never counts
    whole, its pieces stay counted as pinned until teardown unregisters them (they are), and only
    the cause of the stop is reported."""
    chunks = make_chunks([8, 8])
    pipeline = Pipeline(chunks, order=Order.REGISTER_ONLY)
    assert pipeline.next_register() == 0
    pipeline.land(Landing(0, pieces=(Chunk(0, 2),), partial=True))  # progress: pinned before it lands
    pipeline.land(Landing(0, pieces=(Chunk(2, 3),), partial=True))
    assert pipeline.ledger.pinned_bytes == 5
    pipeline.ledger.cancel()
    pipeline.land(Landing(0, stopped=True, pieces=(Chunk(0, 2), Chunk(2, 3))))
    assert pipeline.in_flight == 0 and pipeline.ledger.failures == []
    assert pipeline.ledger.states == [ChunkState.FAULTING, ChunkState.PENDING]  # to undo, never pinned
    assert pipeline.ledger.pieces == {0: (Chunk(0, 2), Chunk(2, 3))}
    assert pipeline.ledger.pinned_bytes == 5  # still registered, so still pinned
    assert pipeline.ledger.registered_bytes == 0 and pipeline.ledger.chunks_done == 0  # never whole
    assert pipeline.finish() is Phase.ROLLED_BACK
    assert pipeline.ledger.pinned_bytes == 5
    assert pipeline.ledger.teardown_order() == [0]
    pipeline.ledger.unregistered(0)
    assert pipeline.ledger.pinned_bytes == 0


@pytest.mark.parametrize("stopped", [False, True])
def test_pieces_of_a_chunk_that_failed_count_all_of_them_until_unregistered(stopped: bool) -> None:
    """Issue 22: a chunk that fails (or stops) after some pieces registered keeps those pieces
    pinned until teardown, so they count, all of them, and the prefix hears of them: also the
    pieces no progress reported (retry halves land only with the chunk)."""
    covered = Covered()
    pipeline = Pipeline(make_chunks([8 * UNIT] * 3), order=Order.REGISTER_ONLY, prefix=covered)
    assert pipeline.next_register() == 0
    pipeline.land(Landing(0))
    assert pipeline.next_register() == 1
    offset = 8 * UNIT
    halves = (Chunk(offset, 3 * UNIT), Chunk(offset + 3 * UNIT, UNIT))  # never reported as progress
    failure = RuntimeCallError(op="register", code=2, reason="oom", message="injected", ptr=0, nbytes=1)
    if stopped:
        pipeline.ledger.cancel()
        pipeline.land(Landing(1, stopped=True, pieces=halves))
    else:
        pipeline.land(Landing(1, failure, pieces=halves))
    assert pipeline.ledger.pinned_bytes == 12 * UNIT
    assert covered.units == set(range(12))
    pipeline.finish()
    assert pipeline.ledger.pinned_bytes == 12 * UNIT  # a background pool keeps them until it is exited
    for index in pipeline.ledger.teardown_order():
        pipeline.ledger.unregistered(index)
    assert pipeline.ledger.pinned_bytes == 0
    pipeline.ledger.close()
    assert pipeline.ledger.pinned_bytes == 0


def test_a_leaked_chunk_of_pieces_counts_the_pieces_it_registered() -> None:
    pipeline = Pipeline(make_chunks([8, 8]), order=Order.REGISTER_ONLY)
    assert pipeline.next_register() == 0
    failure = RuntimeCallError(op="register", code=2, reason="oom", message="injected", ptr=0, nbytes=1)
    pipeline.land(Landing(0, failure, pieces=(Chunk(0, 3),)))
    pipeline.finish()
    pipeline.ledger.unregister_failed(0, failure)
    assert pipeline.ledger.pinned_bytes == 3  # may still be pinned: counted, once
    pipeline.ledger.close()
    assert pipeline.ledger.pinned_bytes == 3


def test_finishing_before_anything_ran_rolls_back() -> None:
    pipeline = Pipeline(make_chunks([4, 4]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=8)
    assert pipeline.finish() is Phase.ROLLED_BACK  # nothing stopped it, but nothing is pinned either
    assert pipeline.ledger.teardown_order() == []


def test_a_span_landed_that_was_never_handed_out_is_refused() -> None:
    pipeline = Pipeline(make_chunks([8]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=8)
    with pytest.raises(LedgerError, match="no populate in flight"):
        pipeline.land(Landing(Span(0, 0, 4)))


def test_a_span_stopped_while_pinning_goes_on_is_a_wait_that_would_never_end() -> None:
    """A span lands stopped only once pinning stopped; an engine that did otherwise would leave its
    chunk never faulted, so never registered: the pipeline says so instead of waiting forever."""
    pipeline = Pipeline(make_chunks([4]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=4)
    span = pipeline.next_populate()
    assert isinstance(span, Span)
    pipeline.land(Landing(span, stopped=True))
    assert not pipeline.stopped
    with pytest.raises(LedgerError, match="would wait forever"):
        pipeline.next_register()


def test_every_chunk_registered_with_a_span_never_faulted_cannot_finish() -> None:
    """The last span landed twice (a bug) in place of its sibling: its chunk looked faulted and was
    registered, but the books know a span was never faulted, so pinning cannot close as PINNED."""
    pipeline = Pipeline(make_chunks([7]), order=Order.POPULATE_FIRST, span_bytes=4, lookahead_bytes=8)
    first, last = pipeline.next_populate(), pipeline.next_populate()
    assert first == Span(0, 0, 4) and last == Span(0, 4, 3)
    pipeline.land(Landing(last))
    pipeline.land(Landing(last))
    assert pipeline.next_register() == 0
    pipeline.land(Landing(0))
    with pytest.raises(LedgerError, match="spans left unfaulted"):
        pipeline.finish()


# -- Pipeline, random interleavings ------------------------------------------------------------------------


class Covered(PrefixTracker):
    """A prefix tracker that only remembers which ranges the pipeline reported pinned."""

    def __init__(self) -> None:
        super().__init__((), 0)
        self.units: set[int] = set()

    def cover(self, start: int, end: int) -> None:
        assert start % UNIT == 0 and end % UNIT == 0 and start < end, (start, end)
        self.units |= set(range(start // UNIT, end // UNIT))


@dataclass
class Call:
    """One handed-out item being called, one runtime call at a time: a span in parts, or a chunk in
    pieces (the stall budget), whose failed pieces may be retried as halves."""

    item: int | Span
    todo: list[Chunk]  # pieces (parts) not called yet, in call order
    paced: bool  # sized as the calls go: pinning may stop between them, and progress lands as they return
    done: list[Chunk] = field(default_factory=list)  # pieces whose call returned
    attempts: list[ChunkFailure] = field(default_factory=list)
    landing: Landing | None = None  # how it ended, once it has


@dataclass
class SimWorker:
    kind: str  # "populate" | "register": one role, one item at a time; "any": Pipeline.next_work batches
    items: tuple[int | Span, ...] = ()
    calls: list[Call] = field(default_factory=list)  # the batch's items called so far, in order
    landed: int = 0  # of ``calls``, how many landings are on the books (a long batch records as it goes)
    waiting: bool = False  # got WAIT and has not been woken since
    exited: bool = False

    @property
    def calling(self) -> Call | None:
        return self.calls[-1] if self.calls and self.calls[-1].landing is None else None


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


# Sizes in MiB, so the engine's batch limits (bytes) make batches of a few items, not of everything;
# pieces and parts are cut on MiB boundaries too.
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


def units(start: int, end: int) -> set[int]:
    return set(range(start // UNIT, end // UNIT))


class Simulation:
    """Workers driving one Pipeline in an interleaving hypothesis chooses, checking every invariant.

    Every outcome goes through the real :meth:`Pipeline.land`, the one method the engine lands
    with, as a :class:`Landing` drawn at random: an item called in several calls (parts of a
    span, pieces of a chunk, with progress landed between them), failed pieces retried as
    halves, failures with and without pieces registered, stops between calls, and items never
    called. The simulation keeps its own account from the records alone (what the docs of
    ``Landing`` say each means) and holds the books to it after every step.

    ``mode`` "roles": populate workers call next_populate, register workers next_register, one
    item at a time, each landing as it ends and waking every waiter. "work": as the engine's
    workers: ``threads`` workers (any number must do) take next_work batches, call the items one
    by one (stopping after a failure, or once pinning stopped), land the outcomes now and then
    and when the batch ends, the items not called as stopped, and wake the waiters; a cancel
    also wakes them.
    """

    def __init__(self, config: SimConfig, mode: str, data: st.DataObject, flakiness: int) -> None:
        self.config = config
        self.mode = mode
        self.data = data
        self.flakiness = flakiness
        self.chunks = make_chunks(config.sizes, config.gaps)
        # Without a prefix tracker (a pipeline alone), nothing else changes.
        self.covered = Covered() if data.draw(st.integers(0, 4), label="prefix") else None
        self.pipeline = Pipeline(
            self.chunks, order=config.order, span_bytes=config.span_bytes, lookahead_bytes=config.lookahead_bytes,
            register_workers=config.register_workers, populate_workers=config.populate_workers, prefix=self.covered,
        )  # fmt: skip
        if mode == "roles":
            kinds = ["populate"] * config.populate_workers + ["register"] * config.register_workers
        else:
            kinds = ["any"] * config.threads
        self.workers = [SimWorker(kind) for kind in kinds]
        self.expected_spans = () if config.order is Order.REGISTER_ONLY else SpanTable(self.chunks, config.span_bytes)
        self.retries_left = data.draw(st.integers(0, 6), label="retry budget")
        # What the records said, kept by the simulation.
        self.handed_spans: list[Span] = []
        self.claims: list[int] = []
        self.populated: set[Span] = set()
        self.registered: set[int] = set()  # registration landed whole (in one call or in pieces)
        self.undo: set[int] = set()  # registered, or pieces of it: the rollback undoes it
        self.pieces: dict[int, tuple[Chunk, ...]] = {}  # chunks registered in several calls
        self.failed: set[int] = set()  # failed before anything of it was registered
        self.register_landed: set[int] = set()  # out of the lookahead window
        self.entered: set[int] = set()  # chunks with a span handed out (POPULATE_FIRST's window, plus landed)
        self.failures: list[ChunkFailure] = []
        self.progress: dict[int, set[int]] = {}  # units pinned ahead of their item's landing, per chunk
        self.pinned_units: set[int] = set()  # every unit ever reported pinned (the prefix never goes back)
        self.stopped = False
        self.first_cause: StopCause | None = None
        self.shapes: set[str] = set()  # which kinds of landings ran (hypothesis events)

    # -- one step ------------------------------------------------------------------------------

    def run(self, cancel_at: int | None) -> None:
        steps = 0
        while True:
            self.check_books()
            actionable = [w for w in self.workers if not w.exited and not w.waiting]
            if not actionable:
                live = [w for w in self.workers if not w.exited]
                # Every live worker sleeps on WAIT and nothing is in flight to wake them: a deadlock.
                assert not live, (
                    f"deadlock: {len(live)} workers wait, nothing in flight ({self.pipeline.ledger.states})"
                )
                return
            if cancel_at is not None and steps == cancel_at:
                self.pipeline.ledger.cancel()
                self.stop(StopCause.CANCELLED)
                self.wake()
            worker = self.data.draw(st.sampled_from(actionable), label="who acts")
            if (call := worker.calling) is not None:
                self.call_once(worker, call)
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
        worker.items, worker.calls, worker.landed = items, [], 0
        self.check_window()
        self.start(worker, items[0])

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

    # -- calling one item ------------------------------------------------------------------------

    def start(self, worker: SimWorker, item: int | Span) -> None:
        """Begin calling ``item``: in one call, or paced in several (cut where hypothesis says)."""
        whole = Chunk(item.offset, item.nbytes) if isinstance(item, Span) else self.chunks[item]
        start, nbytes = whole.offset, whole.nbytes
        paced = self.data.draw(st.booleans(), label="paced")
        cuts: set[int] = set()
        if paced and nbytes >= 2 * UNIT:
            cuts = self.data.draw(st.sets(st.integers(1, nbytes // UNIT - 1), max_size=3), label="cuts")
        bounds = [start, *sorted(start + c * UNIT for c in cuts), start + nbytes]
        worker.calls.append(Call(item, [Chunk(a, b - a) for a, b in pairwise(bounds)], paced))

    def call_once(self, worker: SimWorker, call: Call) -> None:
        """One runtime call of ``call`` returns (or, paced and pinning stopped, none is made)."""
        item = call.item
        if call.paced and not call.attempts and self.pipeline.stopped and self.data.draw(st.booleans(), "stop"):
            self.end(worker, call, Landing(item, stopped=True, pieces=() if isinstance(item, Span) else (*call.done,)))
            return
        piece = call.todo.pop(0)
        phase = "populate" if isinstance(item, Span) else "register"
        if self.data.draw(st.integers(0, 19), label="outcome") >= self.flakiness:
            call.done.append(piece)
            if call.paced and call.todo:  # progress within the item: pinned now, before it lands
                self.land(Landing(item, pieces=(piece,), partial=True))
                self.shapes.add(f"{phase} progress")
            if not call.todo:
                self.end(worker, call, Landing(item, pieces=() if isinstance(item, Span) else (*call.done,)))
            return
        failure = RuntimeCallError(op=phase, code=12, reason="ENOMEM", message="injected", ptr=piece.offset, nbytes=1)
        call.attempts.append(ChunkFailure(piece, phase, failure))
        if phase == "register" and piece.nbytes >= 2 * UNIT and self.retries_left and self.data.draw(st.booleans()):
            self.retries_left -= 1  # a retryable failure: the piece is called again as two halves
            half = piece.nbytes // UNIT // 2 * UNIT
            call.todo[:0] = [Chunk(piece.offset, half), Chunk(piece.offset + half, piece.nbytes - half)]
            self.shapes.add("register retried")
            return
        attempts = () if len(call.attempts) == 1 and self.data.draw(st.booleans(), label="one error") else call.attempts
        pieces = () if isinstance(item, Span) else (*call.done,)
        self.end(worker, call, Landing(item, failure, pieces=pieces, attempts=(*attempts,)))

    def end(self, worker: SimWorker, call: Call, landing: Landing) -> None:
        call.landing = landing
        if self.mode == "roles":  # one item: it lands as it ends
            self.land_batch(worker, ())

    def advance(self, worker: SimWorker) -> None:
        """Between a batch's items: call the next one, put what ended on the books (a long batch), or
        (all called, one failed, or pinning stopped) land the rest and the items not called."""
        last = worker.calls[-1].landing
        assert last is not None
        called = len(worker.calls)
        if called < len(worker.items) and last.error is None and not self.pipeline.stopped:
            if worker.landed < called and self.data.draw(st.booleans(), label="record now"):
                self.land_batch(worker, (), ends=False)
            self.start(worker, worker.items[called])
            return
        self.land_batch(worker, worker.items[called:])

    def land_batch(self, worker: SimWorker, unstarted: Sequence[int | Span], *, ends: bool = True) -> None:
        for call in worker.calls[worker.landed :]:
            assert call.landing is not None
            self.land(call.landing)
        worker.landed = len(worker.calls)
        for item in unstarted:
            self.land(Landing(item, stopped=True))
            self.shapes.add("never called")
        if ends:
            worker.items, worker.calls, worker.landed = (), [], 0
        self.wake()

    # -- the records, as the simulation reads them --------------------------------------------------------

    def land(self, landing: Landing) -> None:
        """Hand ``landing`` to the pipeline, and keep the simulation's own account of it."""
        pinned = self.pipeline.land(landing)
        item, order = landing.item, self.config.order
        if isinstance(item, Span):
            index, phase = item.chunk, "populate"
        else:
            index, phase = item, "register"
        if landing.partial:
            (piece,) = landing.pieces
            if order is Order.REGISTER_FIRST and phase == "populate":
                self.progress.setdefault(index, set()).update(units(piece.offset, piece.end))
                self.pinned_units |= units(piece.offset, piece.end)  # locked as it faulted
            elif order is not Order.REGISTER_FIRST and phase == "register":
                self.progress.setdefault(index, set()).update(units(piece.offset, piece.end))
                self.pinned_units |= units(piece.offset, piece.end)
            assert pinned is None
            return
        whole = landing.error is None and not landing.stopped
        self.shapes.add(f"{phase} {'ok' if whole else 'failed' if landing.error else 'stopped'}")
        if phase == "register":
            self.register_landed.add(index)
            if landing.pieces and landing.pieces != (self.chunks[index],):
                self.pieces[index] = landing.pieces
                self.shapes.add(f"register {'ok' if whole else 'failed' if landing.error else 'stopped'} in pieces")
            if landing.pieces or whole:
                self.undo.add(index)
            if order is not Order.REGISTER_FIRST:
                self.progress.pop(index, None)  # the chunk counts whole from here, or only its pieces
                if landing.pieces and not whole:  # failed or stopped part-way: its pieces stay pinned
                    for piece in landing.pieces:
                        self.progress.setdefault(index, set()).update(units(piece.offset, piece.end))
                        self.pinned_units |= units(piece.offset, piece.end)
            if whole:
                self.registered.add(index)
                if order is not Order.REGISTER_FIRST:
                    chunk = self.chunks[index]
                    self.pinned_units |= units(chunk.offset, chunk.end)
                assert pinned == (None if order is Order.REGISTER_FIRST else index)
            elif landing.error is not None:
                chunk = self.chunks[index]
                self.failures.extend(landing.attempts or [ChunkFailure(chunk, "register", landing.error)])
                if not landing.pieces:
                    self.failed.add(index)
                self.stop(StopCause.FAILURE)
            elif not landing.pieces:
                self.claims.remove(index)  # pending again (though nothing claims it after a stop)
            if not whole:
                assert pinned is None
            return
        if landing.error is not None:
            self.failures.append(ChunkFailure(self.chunks[index], "populate", landing.error))
            if order is Order.POPULATE_FIRST:
                self.failed.add(index)
            self.stop(StopCause.FAILURE)
        if not whole:
            assert pinned is None
            return
        self.populated.add(item)
        if order is Order.REGISTER_FIRST:
            self.progress.setdefault(index, set()).update(units(item.offset, item.offset + item.nbytes))
            self.pinned_units |= units(item.offset, item.offset + item.nbytes)
        spans_done = all(s in self.populated for s in self.expected_spans if s.chunk == index)
        if order is Order.REGISTER_FIRST and spans_done:
            self.progress.pop(index)
            assert pinned == index, "the last span of a lock-on-fault chunk makes it pinned"
        else:
            assert pinned is None

    def stop(self, cause: StopCause) -> None:
        if not self.stopped:
            self.stopped, self.first_cause = True, cause

    def wake(self) -> None:
        for worker in self.workers:
            worker.waiting = False

    def pinned(self) -> set[int]:
        """Chunks pinned: registered with every page in (lock-on-fault: only once all its spans landed)."""
        if self.config.order is not Order.REGISTER_FIRST:
            return set(self.registered)
        return {i for i in self.registered if all(s in self.populated for s in self.expected_spans if s.chunk == i)}

    def check_books(self) -> None:
        pipeline = self.pipeline
        out = sum(len(w.items) - w.landed for w in self.workers)  # handed out, not yet landed
        assert pipeline.in_flight == out, "in_flight counts every handed-out item not yet landed"
        pinned = sum(self.chunks[i].nbytes for i in self.pinned())
        ahead = sum(len(u) for i, u in self.progress.items() if i not in self.pinned()) * UNIT
        assert pipeline.ledger.pinned_bytes == pinned + ahead
        # One source of truth (issue 22): until teardown, what is counted pinned is exactly what the
        # prefix was told of, however pinning ended (a failure or stop mid-chunk included).
        assert pipeline.ledger.pinned_bytes == len(self.pinned_units) * UNIT
        if self.covered is not None:
            assert self.covered.units == self.pinned_units, "the prefix hears of every pinned range, and nothing else"

    # -- the end -------------------------------------------------------------------------------

    def check_end(self) -> None:
        pipeline, ledger = self.pipeline, self.pipeline.ledger
        assert pipeline.in_flight == 0
        assert pipeline.next_populate() is None and pipeline.next_register() is None
        phase = pipeline.finish()
        self.check_books()
        pinned = self.pinned()
        expected = [
            ChunkState.REGISTERED if i in pinned
            else ChunkState.FAULTING if i in self.undo
            else ChunkState.FAILED if i in self.failed
            else ChunkState.PENDING
            for i in range(len(self.chunks))
        ]  # fmt: skip
        assert ledger.states == expected
        assert ledger.teardown_order() == sorted(self.undo, reverse=True)
        assert ledger.pieces == self.pieces, "teardown unregisters each piece of a chunk by its own base"
        assert ledger.registered_bytes == sum(self.chunks[i].nbytes for i in pinned)
        assert ledger.failures == self.failures
        assert pipeline.populated_bytes == sum(s.nbytes for s in self.populated)
        if self.stopped:
            assert phase is Phase.ROLLED_BACK
            assert ledger.stop_cause is self.first_cause is not None
        else:
            assert phase is Phase.PINNED
            assert self.failures == [] and self.first_cause is None
            assert ledger.states == [ChunkState.REGISTERED] * len(self.chunks)
            assert set(self.handed_spans) == set(self.expected_spans) == self.populated
            assert self.pinned_units == set().union(*(units(c.offset, c.end) for c in self.chunks))
            if self.config.order is Order.REGISTER_ONLY:
                assert pipeline.populated_bytes == 0
            else:
                assert pipeline.populated_bytes == sum(self.config.sizes)
        self.check_teardown()

    def check_teardown(self) -> None:
        """Teardown takes each chunk's count with it: a chunk unregistered leaves nothing counted, a
        leaked one counts what it registered (maybe still pinned), and closed books count only leaks."""
        ledger = self.pipeline.ledger
        leaked = 0
        for index in ledger.teardown_order():
            before = self.pipeline.ledger.pinned_bytes
            counted = self.chunks[index].nbytes if index in self.pinned() else len(self.progress.get(index, ())) * UNIT
            if self.data.draw(st.integers(0, 9), label="unregister fails") == 0:
                ledger.unregister_failed(index, error("unregister"))
                registered = self.pieces.get(index, (self.chunks[index],))
                leaked += sum(piece.nbytes for piece in registered)
                assert self.pipeline.ledger.pinned_bytes == before - counted + sum(piece.nbytes for piece in registered)
            else:
                ledger.unregistered(index)
                assert self.pipeline.ledger.pinned_bytes == before - counted
        ledger.close()
        assert self.pipeline.ledger.pinned_bytes == leaked


@depth
@pytest.mark.parametrize("mode", ["roles", "work"])
@settings(max_examples=runs(100, 300), deadline=None)
@given(config=configs, data=st.data())
def test_random_interleavings_keep_every_invariant(mode: str, config: SimConfig, data: st.DataObject) -> None:
    flakiness = data.draw(st.sampled_from([0, 0, 1, 4]), label="failures in 20 calls")
    cancel_at = data.draw(st.none() | st.integers(0, 120), label="cancel at step")
    sim = Simulation(config, mode, data, flakiness)
    sim.run(cancel_at)
    sim.check_end()
    event(f"{config.order.value}: {sim.first_cause.value if sim.first_cause else 'pinned'}")
    event(f"chunks registered: {len(sim.registered)} of {len(sim.chunks)}")
    for shape in sorted(sim.shapes):
        event(shape)


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
    sim = Simulation(config, mode, data, flakiness=0)
    sim.run(cancel_at=None)
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
    (index,) = [i for i, c in enumerate(pool.plan.chunks) if base + c.offset <= ptr < base + c.end]
    return index


def test_populate_is_on_by_default_for_the_fake(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=32 * MiB, runtime=fake, populate_workers=2)
    assert pool.plan.populate is True and pool.plan.order is Order.POPULATE_FIRST
    assert pool._plan.span_bytes == 16 * MiB and pool.plan.populate_workers == 2
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
    assert pool.plan.order is Order.POPULATE_FIRST and pool._plan.span_bytes == 16 * MiB
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr, registered=len(fake.registered)))
    base = seen["base"]
    assert seen["registered"] == len(pool.plan.chunks) == 8
    # The spans tile every chunk exactly.
    assert sorted(fake.populate_calls) == [(base + s.offset, s.nbytes) for s in SpanTable(pool.plan.chunks, 16 * MiB)]
    events = fake.events
    for index, chunk in enumerate(pool.plan.chunks):
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
    assert pool.plan.order is Order.REGISTER_FIRST
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr, registered=len(fake.registered)))
    base = seen["base"]
    assert seen["registered"] == 8
    assert len(fake.populate_calls) == 32
    events = fake.events
    register_at = {ptr: i for i, (kind, ptr) in enumerate(events) if kind == "register"}
    for i, (kind, ptr) in enumerate(events):
        if kind == "populate":
            chunk = pool.plan.chunks[chunk_of(pool, base, ptr)]
            assert register_at[base + chunk.offset] < i, f"span at {ptr - base} faulted before its chunk registered"
    assert_rolled_back(fake)


@pytest.mark.skipif(_libc.transparent_huge_pages_mode() not in ("always", "madvise"), reason="needs THP")
def test_huge_pages_fault_first_even_under_lock_on_fault() -> None:
    pool = pinpool.PinnedPool(size=8 * MiB, runtime=FakeRuntime(lock_on_fault=True), huge_pages=True)
    assert pool.plan.order is Order.POPULATE_FIRST


@pytest.mark.parametrize("lock_on_fault", [False, True])
@each_driver
async def test_populate_false_only_registers(mode: str, lock_on_fault: bool) -> None:
    fake = FakeRuntime(lock_on_fault=lock_on_fault)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, populate=False, register_workers=2)
    assert pool.plan.populate is False and pool.plan.order is Order.REGISTER_ONLY
    assert pool.plan.populate_workers == 0 and pool._plan.span_bytes == 0
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
    assert len(SpanTable(pool.plan.chunks, pool._plan.span_bytes)) == 32
    assert pool.plan.order is (Order.REGISTER_FIRST if lock_on_fault else Order.POPULATE_FIRST)
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
    failed_chunk = pool.plan.chunks[chunk_of(pool, base, failed_ptr)]
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
    assert len(pool.plan.chunks) == 1 and pool._plan.span_bytes == 32 * MiB and pool.plan.populate_workers == 2
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
    spans = len(SpanTable(pool.plan.chunks, pool._plan.span_bytes))
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
                session = lifecycle_of(pool).session
                assert session is not None
                with session._changed:
                    assert session._changed.wait_for(lambda: session.pipeline.stopped, timeout=10)

    fake = CancelOnFifth(lock_on_fault=lock_on_fault)
    pool = pinpool.PinnedPool(
        size=512 * MiB, chunk_bytes=32 * MiB, runtime=fake, populate_workers=1, register_workers=1
    )
    assert len(pool.plan.chunks) == 16 and pool._plan.span_bytes == 32 * MiB  # a span per chunk
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
    assert len(pool.plan.chunks) == 64 and pool.plan.threads == 1
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
                session = lifecycle_of(pool).session
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
    assert pool.plan.order is Order.POPULATE_FIRST and len(pool.plan.chunks) == 12
    assert pool._plan.span_bytes == 32 * MiB and pool._plan.lookahead_bytes == 128 * MiB
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
            nbytes = sum(pool.plan.chunks[i].nbytes for i in window)
            assert nbytes <= pool._plan.lookahead_bytes or len(window) == 1, (
                f"window {sorted(window)} over the lookahead"
            )
            largest = max(largest, len(window))
        else:
            window.discard(index)
    assert largest == pool._plan.lookahead_bytes // pool.plan.chunk_bytes == 2  # it ran ahead, as far as allowed
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
    assert pool.plan.unpin_workers == 4 and len(pool.plan.chunks) == 8
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr))
    assert 2 <= fake.max_concurrent_unregisters <= 4
    assert sorted(fake.unregister_calls) == [seen["base"] + c.offset for c in pool.plan.chunks]
    assert_rolled_back(fake)
    assert pool.pinned_bytes == 0


@each_driver
async def test_one_unpin_worker_unregisters_in_reverse_offset_order(mode: str) -> None:
    fake = Logging(unregister_delay=0.002)
    pool = pinpool.PinnedPool(size=8 * MiB, chunk_bytes=MiB, runtime=fake, unpin_workers=1, register_workers=3)
    assert pool.plan.unpin_workers == 1
    seen: dict[str, int] = {}
    await pin_and_run(pool, mode, lambda p: seen.update(base=p.data_ptr))
    assert fake.unregister_calls == [seen["base"] + c.offset for c in reversed(pool.plan.chunks)]
    assert fake.max_concurrent_unregisters == 1
    assert_rolled_back(fake)


def test_unpin_workers_are_capped_by_the_chunk_count(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=3 * MiB, chunk_bytes=MiB, runtime=fake, unpin_workers=8)
    assert pool.plan.unpin_workers == 3


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
def test_bad_options_are_config_errors_before_anything_is_registered(
    fake: FakeRuntime, option: str, value: object
) -> None:
    with pytest.raises(pinpool.ConfigError, match=re.escape(f"{option}={value!r}")):
        pinpool.PinnedPool(size=4 * MiB, chunk_bytes=MiB, runtime=fake, **{option: value})  # type: ignore[arg-type]
    assert fake.register_calls == [] and fake.populate_calls == [] and fake.events == []


@hugetlb_pages
def test_hugetlb_without_free_pages_is_a_config_error(fake: FakeRuntime) -> None:
    free = Path("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
    try:
        free_pages = int(free.read_text())
    except OSError:
        pytest.skip("no 2 MiB hugetlb pool on this kernel")
    if free_pages != 0:
        pytest.skip(f"{free_pages} free hugetlb pages: the pool might fit")
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
    assert pool.plan.order is Order.REGISTER_FIRST and pool._plan.span_bytes == 16 * MiB
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
