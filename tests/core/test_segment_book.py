"""The book of an elastic pool's segments (DESIGN-elastic.md): random sequences of grow, start, pin, fail,
cancel, shrink (page runs or the tail), release, leak, give back, a teardown that raised (stall), its
resumption by the next shrink or grow, and teardown keep every rule: a page once usable stays usable until
the caller names it; only whole pinned segments the caller named are released; grows take only free, whole
segments, one grow at a time; a stalled segment is never usable and is resumed by exactly one caller; a
refusal changes nothing; teardown ends closed. Every run ends with the pool's exit (the machine's teardown)."""

from __future__ import annotations

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pinpool import ConfigError, PoolStateError
from pinpool._errors import LedgerError
from pinpool._plan import PageRun, RunGrid, SegmentBook, SegmentState, Shrink, merged, plan_reservation

S = SegmentState
NUM_PAGES, FLOOR, STEP = 40, 8, 8  # a floor [0, 8), segments [8, 16) ... [32, 40)


def _book(floor: int = FLOOR) -> SegmentBook:
    runs = [RunGrid(PageRun(k * NUM_PAGES * 512, (k + 1) * NUM_PAGES * 512, 512), "kv", 0, None, 4096) for k in (0, 1)]
    return SegmentBook(plan_reservation(runs, NUM_PAGES, floor_pages=floor, step_pages=STEP, chunk_limit=1 << 20))


def _pages(runs: tuple[range, ...]) -> set[int]:
    return {page for r in runs for page in r}


def _snapshot(book: SegmentBook) -> tuple[object, ...]:
    return tuple(book.states), book.unreturned, book.grow, book.closed, book.stalled, book.rolling_back


def _stalled(book: SegmentBook, state: SegmentState) -> list[int]:
    return sorted(i for i in book.stalled if book.states[i] is state)


page_runs_st = st.lists(
    st.tuples(st.integers(0, NUM_PAGES - 1), st.integers(1, 20)).map(lambda p: range(p[0], min(NUM_PAGES, sum(p)))),
    min_size=1, max_size=4,
)  # fmt: skip


class Segments(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = _book()
        self.floor_usable = 0  # the floor's session prefix, as a background entry makes it grow
        self.usable = _pages(self.book.usable_runs(self.floor_usable))
        self.given_up: set[int] = set()  # pages the caller named since the last check
        self.committed: set[int] = set()  # pages of segments booked grown since the last check

    def _refused(self, call, error: type[BaseException]) -> None:  # type: ignore[no-untyped-def]
        before = _snapshot(self.book)
        with pytest.raises(error):
            call()
        assert _snapshot(self.book) == before, "a refusal changed the book"

    @rule(pages=st.integers(1, FLOOR))
    def floor_pins(self, pages: int) -> None:
        self.floor_usable = max(self.floor_usable, pages)
        self.committed |= set(range(self.floor_usable))

    @rule(pages=st.integers(-2, NUM_PAGES + 4))
    def grow(self, pages: int) -> None:
        book = self.book
        if pages <= 0 or book.grow is not None:
            self._refused(lambda: book.begin_grow(pages), PoolStateError if pages > 0 else ConfigError)
            return
        if _stalled(book, S.GROWING):  # the pool's grow takes it back first (resume_rollback): a bug otherwise
            self._refused(lambda: book.begin_grow(pages), LedgerError)
            return
        if pages > book.growable_pages():
            self._refused(lambda: book.begin_grow(pages), PoolStateError)
            return
        free = set(book.in_state(S.FREE))
        queued = book.begin_grow(pages)
        assert set(queued) <= free and list(queued) == sorted(queued)  # the lowest free segments first
        got = sum(len(book.reservation.segments[i].pages) for i in queued)
        assert got >= pages and got - len(book.reservation.segments[queued[-1]].pages) < pages  # whole, no more

    @precondition(
        lambda self: self.book.grow is None and self.book.growable_pages() > 0 and not _stalled(self.book, S.GROWING)
    )
    @rule(data=st.data())
    def grow_and_pin(self, data: st.DataObject) -> None:
        """A grow that pins every segment it queued (the happy path, so that many runs hold pinned segments)."""
        book = self.book
        queued = book.begin_grow(data.draw(st.integers(1, book.growable_pages())))
        for index in queued:
            book.start(index)
            book.grown(index)
            self.committed |= set(book.reservation.segments[index].pages)
        assert book.end_grow() == queued

    @precondition(lambda self: bool(self.book.in_state(S.PINNED)))
    @rule(data=st.data())
    def shrink_usable(self, data: st.DataObject) -> None:
        """Give up random runs of usable pages above the floor (whole segments or not)."""
        usable = sorted(p for p in self.usable if p >= FLOOR)
        if not usable:
            return
        pages = [
            range(first, min(first + n, NUM_PAGES))
            for first, n in data.draw(st.lists(st.tuples(st.sampled_from(usable), st.integers(1, 12)), min_size=1))
        ]
        pages = [range(r.start, next((p for p in range(r.start, r.stop) if p not in self.usable), r.stop))
                 for r in pages]  # fmt: skip
        self.shrink(pages)

    @precondition(lambda self: self.book.grow is not None and not self.book.in_state(S.GROWING))
    @rule()
    def start_next(self) -> None:
        queued = self.book.in_state(S.QUEUED)
        if queued:
            self.book.start(queued[0])

    @precondition(lambda self: bool(set(self.book.in_state(S.GROWING)) - self.book.stalled))
    @rule(outcome=st.sampled_from(["pinned", "rolled back", "unreturned", "leaked"]))
    def land(self, outcome: str) -> None:
        (index,) = set(self.book.in_state(S.GROWING)) - self.book.stalled
        if outcome == "pinned" and index == self.book.rolling_back:  # a rollback under way never announces it
            event("a resumed rollback refused grown")
            self._refused(lambda: self.book.grown(index), LedgerError)
        elif outcome == "pinned":
            self.book.grown(index)
            self.committed |= set(self.book.reservation.segments[index].pages)
        elif outcome == "leaked":
            self.book.leaked(index)
        else:
            self.book.rolled_back(index, returned=outcome == "rolled back")

    @precondition(lambda self: self.book.grow is not None and not self.book.in_state(S.GROWING))
    @rule()
    def end_grow(self) -> None:
        grow = self.book.grow
        grown = self.book.end_grow()
        assert set(grown) <= set(grow or ()) and all(self.book.states[i] is S.PINNED for i in grown)
        assert not self.book.in_state(S.QUEUED)

    @precondition(lambda self: bool(set(self.book.in_state(S.GROWING, S.RELEASING)) - self.book.stalled))
    @rule(data=st.data())
    def stall(self, data: st.DataObject) -> None:
        """A teardown raised TEARDOWN_TRIES times: the segment stays growing or releasing, taken by nobody."""
        book = self.book
        index = data.draw(st.sampled_from(sorted(set(book.in_state(S.GROWING, S.RELEASING)) - book.stalled)))
        growing = book.states[index] is S.GROWING
        book.stall(index)
        assert index in book.stalled and book.states[index] in (S.GROWING, S.RELEASING)
        if growing:  # its grow ended: what it had not started is free again
            assert book.grow is None and not book.in_state(S.QUEUED) and book.rolling_back is None
        self._refused(lambda: book.stall(index), LedgerError)

    @rule(pages=st.integers(-1, NUM_PAGES))
    def resume_rollback(self, pages: int) -> None:
        """A grow begins by taking back the segment a raised rollback left growing, if any."""
        book = self.book
        if pages <= 0 or book.grow is not None:
            self._refused(lambda: book.resume_rollback(pages), PoolStateError if pages > 0 else ConfigError)
            return
        stuck = _stalled(book, S.GROWING)
        index = book.resume_rollback(pages)
        if not stuck:
            assert index is None and book.grow is None
            return
        event("a rollback resumed")
        assert [index] == stuck and book.grow == (index,) and book.rolling_back == index
        assert index not in book.stalled and book.states[index] is S.GROWING

    def _resumed(self, shrink: Shrink, stalled: list[int]) -> None:
        event(f"shrink resumed {len(stalled)}")
        assert list(shrink.resumed) == stalled, "a shrink resumes exactly the releases left stalled"
        assert not _stalled(self.book, S.RELEASING) and all(self.book.states[i] is S.RELEASING for i in stalled)

    @rule(pages=page_runs_st)
    def shrink(self, pages: list[range]) -> None:
        book = self.book
        named = _pages(tuple(pages))
        if any(p < FLOOR for p in named) or not named <= self.usable:
            self._refused(lambda: book.begin_shrink(pages), PoolStateError)
            return
        stalled = _stalled(book, S.RELEASING)
        shrink = book.begin_shrink(pages)
        self._resumed(shrink, stalled)
        event(f"shrink released {len(shrink.released)}, kept {len(shrink.kept)}")
        released = _pages(shrink.pages)
        assert released <= named, "released a page the caller did not give up"
        assert released == _pages(book.pages_of(shrink.released))
        assert all(book.states[i] is S.RELEASING for i in shrink.released)
        assert _pages(shrink.kept) == named - released and _pages(shrink.kept) <= _pages(book.usable_runs(99))
        self.given_up |= named

    @rule(stop=st.integers(0, NUM_PAGES))
    def shrink_tail(self, stop: int) -> None:
        book = self.book
        if stop < FLOOR:
            self._refused(lambda: book.begin_shrink_to(stop), PoolStateError)
            return
        stalled = _stalled(book, S.RELEASING)
        shrink = book.begin_shrink_to(stop)
        self._resumed(shrink, stalled)
        assert all(page >= stop for page in _pages(shrink.pages) | _pages(shrink.kept))
        self.given_up |= {page for page in self.usable if page >= stop}

    @precondition(lambda self: bool(set(self.book.in_state(S.RELEASING)) - self.book.stalled))
    @rule(data=st.data(), outcome=st.sampled_from(["returned", "unreturned", "leaked"]))
    def release(self, data: st.DataObject, outcome: str) -> None:
        index = data.draw(st.sampled_from(sorted(set(self.book.in_state(S.RELEASING)) - self.book.stalled)))
        if outcome == "leaked":
            self.book.leaked(index)
        else:
            self.book.released(index, returned=outcome == "returned")

    @precondition(lambda self: bool(self.book.unreturned))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        index = data.draw(st.sampled_from(sorted(self.book.unreturned)))
        self.book.returned(index)

    @rule(
        index=st.integers(0, 5),
        call=st.sampled_from(["start", "grown", "rolled_back", "released", "leaked", "stall"]),
    )
    def wrong_transition(self, index: int, call: str) -> None:
        book = self.book
        allowed = {"start": (S.QUEUED,), "grown": (S.GROWING,), "rolled_back": (S.GROWING,),
                   "released": (S.RELEASING,), "leaked": (S.GROWING, S.RELEASING),
                   "stall": (S.GROWING, S.RELEASING)}[call]  # fmt: skip
        if index < len(book.states) and book.states[index] in allowed:
            return  # a legal one: the other rules make those (a stalled one's refusals: see stall and land)
        kwargs = {"returned": True} if call in ("rolled_back", "released") else {}
        self._refused(lambda: getattr(book, call)(index, **kwargs), LedgerError)

    def teardown(self) -> None:
        """Every run ends with the pool's exit: every segment given up and torn down, highest first."""
        book = self.book
        event(f"exit with {len(book.in_state(S.PINNED))} pinned, {len(book.in_state(S.RELEASING))} releasing, "
              f"{len(book.in_state(S.LEAKED))} leaked, {len(book.stalled)} stalled")  # fmt: skip
        stalled = book.stalled
        order = book.begin_teardown()
        assert list(order) == sorted(order, reverse=True)
        assert stalled <= set(order) and not book.stalled, "the exit takes the stalled segments over"
        assert not book.in_state(S.PINNED) and book.usable_runs(0) == ()
        for index in order:
            if book.states[index] is S.GROWING:
                book.rolled_back(index, returned=True)
            else:
                book.released(index, returned=True)
        if book.grow is not None:
            book.end_grow()
        book.close()
        assert book.usable_runs(FLOOR) == () and book.pinned_pages(FLOOR) == 0
        assert set(book.states) <= {S.FLOOR, S.FREE, S.LEAKED}
        self._refused(lambda: book.begin_grow(1), PoolStateError)
        self._refused(lambda: book.begin_shrink_to(FLOOR), PoolStateError)

    @invariant()
    def usable_pages_are_the_floor_and_pinned_segments_and_never_pulled_away(self) -> None:
        book = self.book
        now = _pages(book.usable_runs(self.floor_usable))
        pinned = {p for i in book.in_state(S.PINNED) for p in book.reservation.segments[i].pages}
        assert now == set(range(self.floor_usable)) | pinned
        assert now <= self.usable | self.committed, "a page became usable that no segment pinned whole"
        assert self.usable - now <= self.given_up, "a usable page was pulled away that the caller did not give up"
        runs = book.usable_runs(self.floor_usable)
        assert runs == merged(runs)
        first = runs[0].stop if runs and runs[0].start == 0 else 0
        assert book.pinned_pages(self.floor_usable) == first
        self.usable, self.given_up, self.committed = now, set(), set()

    @invariant()
    def one_grow_at_a_time_over_free_whole_segments(self) -> None:
        book = self.book
        growing = set(book.in_state(S.GROWING, S.QUEUED)) - book.stalled
        assert len(book.in_state(S.GROWING)) <= 1
        assert growing <= set(book.grow or ())
        assert all(book.states[i] is not S.FLOOR for i in growing)
        assert book.states[0] is S.FLOOR  # the floor is never grown, released or leaked
        assert all(book.states[i] in (S.FREE, S.QUEUED) for i in book.unreturned)  # regrowing clears it
        assert book.growable_pages() == sum(len(book.reservation.segments[i].pages) for i in book.in_state(S.FREE))

    @invariant()
    def a_stalled_segment_waits_for_one_resumer(self) -> None:
        book = self.book
        assert all(book.states[i] in (S.GROWING, S.RELEASING) for i in book.stalled)
        stuck = _stalled(book, S.GROWING)
        assert len(stuck) <= 1 and (not stuck or book.grow is None), "a stalled rollback ended its grow"
        growing = set(book.in_state(S.GROWING)) - book.stalled
        assert growing <= set(book.grow or ())
        if book.rolling_back is not None:
            assert book.grow == (book.rolling_back,) and book.states[book.rolling_back] is S.GROWING


Segments.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_segment_book = Segments.TestCase


def test_refusals_name_the_pages_and_the_fix() -> None:
    book = _book()
    with pytest.raises(PoolStateError, match=r"pages \[0, 4\) are in the pool's floor \(size=: pages \[0, 8\)\)"):
        book.begin_shrink([range(0, 4)])
    with pytest.raises(PoolStateError, match=r"pages \[8, 10\) are not usable now \(their segment, pages \[8, 16\), "
                       r"is free\); give up only pages pool.pinned_runs lists"):  # fmt: skip
        book.begin_shrink([range(8, 10)])
    with pytest.raises(ConfigError, match=r"range\(0, 50\) is not a range of the reservation's pages"):
        book.begin_shrink([range(0, 50)])
    with pytest.raises(ConfigError, match=r"not a sequence of ranges"):
        book.begin_shrink(range(8, 16))
    with pytest.raises(PoolStateError, match=r"at most 32 pages can grow now \(the reservation's 40 pages: floor 8, "
                       r"free 32\)"):  # fmt: skip
        book.begin_grow(33)
    assert book.begin_grow(9) == (1, 2)  # whole segments: 16 pages for 9
    with pytest.raises(PoolStateError, match=r"a grow of pages \[8, 24\) is under way"):
        book.begin_grow(1)
    book.start(1)
    book.grown(1)
    assert book.end_grow() == (1,)
    assert book.usable_runs(FLOOR) == (range(0, 16),) and book.pinned_pages(4) == 4
    shrink = book.begin_shrink([range(10, 16)])  # part of a segment: kept, still usable
    assert shrink.released == () and shrink.kept == (range(10, 16),) and book.pinned_pages(FLOOR) == 16
    assert book.begin_shrink_to(12).kept == (range(12, 16),)
    shrink = book.begin_shrink([range(8, 12), range(12, 16)])  # named whole across two runs: released
    assert shrink.released == (1,) and shrink.pages == (range(8, 16),) and book.pinned_pages(FLOOR) == 8
    with pytest.raises(PoolStateError, match=r"shrink to at least 8 pages"):
        book.begin_shrink_to(7)
    book.released(1, returned=False)
    assert book.unreturned == {1} and book.begin_teardown() == ()
    book.close()
    with pytest.raises(PoolStateError, match=r"the pool was exited"):
        book.begin_grow(1)


def test_a_pool_without_a_floor_starts_empty() -> None:
    book = _book(floor=0)
    assert SegmentState.FLOOR not in book.states and book.usable_runs(0) == () and book.pinned_pages(0) == 0
    assert book.begin_grow(1) == (0,)
