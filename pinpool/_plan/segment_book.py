"""The book of an elastic pool's segments (DESIGN-elastic.md): which are free, growing, pinned (usable), being
released or leaked, and the rules: grow only free, whole segments inside the reservation, one grow at a time;
announce a segment only once it is pinned whole; release only pinned segments every page of which the caller
gave up; a segment whose teardown raised stays growing or releasing, stalled, until the next grow or shrink
resumes it. Pure, called under the pool's lock: every check comes before the first change, so a refusal (a
typed error for the caller's mistake, LedgerError for pinpool's) changes nothing."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .._errors import ConfigError, LedgerError, PoolStateError
from .segments import Reservation


class SegmentState(enum.Enum):
    FLOOR = "floor"  # pinned by the pool's entry and kept until exit: usable as far as that session's prefix
    FREE = "free"  # reserved, nothing pinned (its pages given back, unless ``unreturned`` says not)
    QUEUED = "queued"  # part of the grow under way, not started: nothing pinned yet
    GROWING = "growing"  # its session pins, or rolls back: never usable, whatever it pinned
    PINNED = "pinned"  # its session pinned it whole: usable until the caller gives it up
    RELEASING = "releasing"  # given up: its session unpins, then its pages go back; never usable again
    LEAKED = "leaked"  # an unregister failed: it may stay pinned; never grown again


_SESSION = frozenset({SegmentState.GROWING, SegmentState.PINNED, SegmentState.RELEASING})  # a live session


@dataclass(frozen=True)
class Shrink:
    """What a shrink released (segments now RELEASING, and their pages) and the pages it named but kept:
    those of segments it did not name whole, still usable; ``resumed``: segments earlier shrinks left
    releasing (their teardown raised), which this one tears down first."""

    released: tuple[int, ...]
    pages: tuple[range, ...]
    kept: tuple[range, ...]
    resumed: tuple[int, ...]


def merged(ranges: Iterable[range]) -> tuple[range, ...]:
    """Non-empty ``ranges`` sorted and joined where they touch or overlap."""
    out: list[range] = []
    for r in sorted((r for r in ranges if r), key=lambda r: r.start):
        if out and r.start <= out[-1].stop:
            out[-1] = range(out[-1].start, max(out[-1].stop, r.stop))
        else:
            out.append(r)
    return tuple(out)


def _text(ranges: Sequence[range]) -> str:
    return ", ".join(f"[{r.start}, {r.stop})" for r in ranges)


class SegmentBook:
    """Every segment of one reservation, through grows, shrinks and the pool's teardown."""

    def __init__(self, reservation: Reservation) -> None:
        self.reservation = reservation
        self.states = [SegmentState.FLOOR if s.floor else SegmentState.FREE for s in reservation.segments]
        self.unreturned: frozenset[int] = frozenset()  # free or queued, but giving their pages back failed or waits
        self.grow: tuple[int, ...] | None = None  # the segments of the grow under way, in the order they pin
        # Growing or releasing, but nobody tears them down now: their teardown raised TEARDOWN_TRIES times. The
        # next shrink resumes the releasing ones, the next grow the growing one (at most one), the exit all.
        self.stalled: frozenset[int] = frozenset()
        self.rolling_back: int | None = None  # a stalled growing segment a grow took back: booked free or leaked only
        self.closed = False

    # -- reading -----------------------------------------------------------------------------

    def pages_of(self, indices: Iterable[int]) -> tuple[range, ...]:
        return merged(self.reservation.segments[i].pages for i in indices)

    def in_state(self, *states: SegmentState) -> tuple[int, ...]:
        return tuple(i for i, state in enumerate(self.states) if state in states)

    def bytes_in(self, *states: SegmentState) -> int:
        return sum(self.reservation.segments[i].nbytes for i in self.in_state(*states))

    def usable_runs(self, floor_usable: int) -> tuple[range, ...]:
        """Pages usable now: the floor's first ``floor_usable`` (its session's prefix) and every pinned segment."""
        if self.closed:
            return ()
        floor = range(0, max(0, min(floor_usable, self.reservation.floor_pages)))
        return merged([floor, *(self.reservation.segments[i].pages for i in self.in_state(SegmentState.PINNED))])

    def pinned_pages(self, floor_usable: int) -> int:
        """``pool.pinned_pages``: pages ``[0, k)`` usable (a hole ends it)."""
        runs = self.usable_runs(floor_usable)
        return runs[0].stop if runs and runs[0].start == 0 else 0

    def growable_pages(self) -> int:
        return sum(len(self.reservation.segments[i].pages) for i in self.in_state(SegmentState.FREE))

    def _describe(self) -> str:
        counts = dict.fromkeys(SegmentState, 0)
        for index, state in enumerate(self.states):
            counts[state] += len(self.reservation.segments[index].pages)
        shown = ", ".join(f"{state.value} {pages}" for state, pages in counts.items() if pages)
        return f"the reservation's {self.reservation.num_pages} pages: {shown}"

    def _open(self, what: str) -> None:
        if self.closed:
            raise PoolStateError(f"{what}: the pool was exited and its segments torn down; create a new pool")

    # -- growing -----------------------------------------------------------------------------

    def _check_grow(self, pages: int) -> str:
        what = f"grow(pages={pages!r})"
        self._open(what)
        if isinstance(pages, bool) or not isinstance(pages, int) or pages <= 0:
            raise ConfigError(f"{what}: give a number of pages > 0 (whole segments of the reservation are pinned)")
        if self.grow is not None:
            raise PoolStateError(
                f"{what}: a grow of pages {_text(self.pages_of(self.grow))} is under way, and a pool grows once at "
                "a time; wait for it (or cancel it) and grow again"
            )
        return what

    def resume_rollback(self, pages: int) -> int | None:
        """A grow of ``pages`` begins: the segment a rollback that raised left growing, if any, taken back for a
        new try as a grow of its own (roll it back, then :meth:`end_grow`); None: :meth:`begin_grow` now."""
        self._check_grow(pages)
        stuck = [i for i in self.stalled if self.states[i] is SegmentState.GROWING]
        if not stuck:
            return None
        (index,) = stuck  # one grow at a time: one segment of it pins, or is left growing
        self.stalled = self.stalled - {index}
        self.grow, self.rolling_back = (index,), index
        return index

    def begin_grow(self, pages: int) -> tuple[int, ...]:
        """Queue the lowest free segments holding at least ``pages`` pages (whole segments): the grow's segments."""
        what = self._check_grow(pages)
        if any(self.states[i] is SegmentState.GROWING for i in self.stalled):
            raise LedgerError(f"{what} while a segment is left growing: resume_rollback() takes it first")
        chosen: list[int] = []
        found = 0
        for index in self.in_state(SegmentState.FREE):
            if found >= pages:
                break
            chosen.append(index)
            found += len(self.reservation.segments[index].pages)
        if found < pages:
            raise PoolStateError(
                f"{what}: at most {self.growable_pages()} pages can grow now ({self._describe()}); ask for fewer "
                "pages, wait for segments being released, or give the pool a larger reserve="
            )
        for index in chosen:
            self.states[index] = SegmentState.QUEUED
        self.grow = tuple(chosen)
        return self.grow

    def _expect(self, index: int, *was: SegmentState) -> None:
        if not 0 <= index < len(self.states) or self.states[index] not in was:
            state = self.states[index].value if 0 <= index < len(self.states) else "no segment"
            raise LedgerError(f"segment {index} is {state}, not {' or '.join(s.value for s in was)}")

    def start(self, index: int) -> None:
        """The grow's next segment begins to pin (its session is made)."""
        self._expect(index, SegmentState.QUEUED)
        assert self.grow is not None  # QUEUED only inside a grow
        if any(self.states[i] is SegmentState.GROWING for i in self.grow):
            raise LedgerError(f"segment {index} started while another segment of the grow pins")
        if index != next(i for i in self.grow if self.states[i] is SegmentState.QUEUED):
            raise LedgerError(f"segment {index} started out of the grow's order {self.grow}")
        # Pages never given back are faulted and pinned again now; a rollback gives them back (or marks them).
        self.unreturned = self.unreturned - {index}
        self.states[index] = SegmentState.GROWING

    def grown(self, index: int) -> None:
        """Its session pinned every chunk (and every registrar holds it): its pages are usable from now on."""
        self._expect(index, SegmentState.GROWING)
        if index in self.stalled or index == self.rolling_back:
            raise LedgerError(f"segment {index} grown while its rollback is under way or left by one that raised")
        self.states[index] = SegmentState.PINNED

    def rolled_back(self, index: int, *, returned: bool) -> None:
        """A growing segment's session was undone (failure, cancellation, exit); ``returned``: its pages given back."""
        self._expect(index, SegmentState.GROWING)
        self._free(index, returned)

    def end_grow(self) -> tuple[int, ...]:
        """The grow is over (done, failed or cancelled): its unstarted segments are free again; those it pinned."""
        if self.grow is None:
            raise LedgerError("end_grow with no grow under way")
        if any(self.states[i] is SegmentState.GROWING for i in self.grow):
            raise LedgerError("end_grow while a segment still pins: roll it back (or book it grown) first")
        for index in self.grow:
            if self.states[index] is SegmentState.QUEUED:
                self.states[index] = SegmentState.FREE
        grown = tuple(i for i in self.grow if self.states[i] is SegmentState.PINNED)
        self.grow = None
        return grown

    # -- giving pages up ---------------------------------------------------------------------

    def begin_shrink(self, pages: Iterable[range]) -> Shrink:
        """The caller gives up ``pages`` (ranges of pages its allocator freed): every one must be usable now.
        Pinned segments named whole are RELEASING (no longer usable); the other named pages are kept."""
        self._open("shrink(pages=...)")
        named = merged(self._checked_ranges(pages))
        if not named:
            raise ConfigError("shrink(pages=...) names no page: give the ranges of pages your allocator freed")
        reservation = self.reservation
        floor = [r for r in named if r.start < reservation.floor_pages]
        if floor:
            raise PoolStateError(
                f"shrink(pages=...): pages {_text(floor)} are in the pool's floor (size=: pages [0, "
                f"{reservation.floor_pages})), pinned until exit; give up pages from [{reservation.floor_pages}, "
                f"{reservation.num_pages}) only"
            )
        released: list[int] = []
        kept: list[range] = []
        for r in named:
            for index in reservation.segments_in(r):
                segment, state = reservation.segments[index], self.states[index]
                inside = range(max(r.start, segment.pages.start), min(r.stop, segment.pages.stop))
                if state is not SegmentState.PINNED:
                    raise PoolStateError(
                        f"shrink(pages=...): pages [{inside.start}, {inside.stop}) are not usable now (their segment, "
                        f"pages [{segment.pages.start}, {segment.pages.stop}), is {state.value}); give up only pages "
                        "pool.pinned_runs lists"
                    )
                if inside == segment.pages:
                    released.append(index)
                else:
                    kept.append(inside)
        return self._release(released, merged(kept))

    def begin_shrink_to(self, stop: int) -> Shrink:
        """The caller gives up every usable page from ``stop`` on (the tail): pinned segments wholly above it
        are RELEASING; the one ``stop`` cuts is kept."""
        what = f"shrink(to_pages={stop!r})"
        self._open(what)
        reservation = self.reservation
        if isinstance(stop, bool) or not isinstance(stop, int) or not 0 <= stop <= reservation.num_pages:
            raise ConfigError(f"{what}: give a page count from 0 to the reservation's {reservation.num_pages}")
        if stop < reservation.floor_pages:
            raise PoolStateError(
                f"{what}: pages [{stop}, {reservation.floor_pages}) are in the pool's floor (size=), pinned until "
                f"exit; shrink to at least {reservation.floor_pages} pages"
            )
        released: list[int] = []
        kept: list[range] = []
        for index in self.in_state(SegmentState.PINNED):
            pages = reservation.segments[index].pages
            if pages.start >= stop:
                released.append(index)
            elif pages.stop > stop:
                kept.append(range(stop, pages.stop))
        return self._release(released, tuple(kept))

    def _checked_ranges(self, pages: Iterable[range]) -> list[range]:
        num_pages = self.reservation.num_pages
        fix = f"give ranges of pages, range(first, stop) with 0 <= first < stop <= {num_pages}, step 1"
        if isinstance(pages, range) or not isinstance(pages, Iterable):
            raise ConfigError(f"shrink(pages={pages!r}): not a sequence of ranges; {fix}")
        checked = list(pages)
        for r in checked:
            if not isinstance(r, range) or r.step != 1 or not 0 <= r.start < r.stop <= num_pages:
                raise ConfigError(f"shrink(pages=...): {r!r} is not a range of the reservation's pages; {fix}")
        return checked

    def _release(self, released: list[int], kept: tuple[range, ...]) -> Shrink:
        for index in released:  # checked above: every one PINNED; nothing raises from here
            self.states[index] = SegmentState.RELEASING
        resumed = tuple(sorted(i for i in self.stalled if self.states[i] is SegmentState.RELEASING))
        self.stalled = self.stalled - set(resumed)  # this shrink tears them down: no other takes them meanwhile
        return Shrink(tuple(released), self.pages_of(released), kept, resumed)

    def released(self, index: int, *, returned: bool) -> None:
        """A releasing segment's session is torn down; ``returned``: its pages are given back to the host."""
        self._expect(index, SegmentState.RELEASING)
        self._free(index, returned)

    def leaked(self, index: int) -> None:
        """Unregistering a growing or releasing segment failed: it may stay pinned, and is never grown again."""
        self._expect(index, SegmentState.GROWING, SegmentState.RELEASING)
        self._settled(index)
        self.states[index] = SegmentState.LEAKED

    def stall(self, index: int) -> None:
        """The teardown of a growing or releasing segment raised TEARDOWN_TRIES times: it stays as it is (never
        usable, maybe pinned) until the next shrink (releasing) or grow (growing) resumes it, or the exit. A
        growing one ends its grow: the segments it had not started are free again."""
        self._expect(index, SegmentState.GROWING, SegmentState.RELEASING)
        if index in self.stalled:
            raise LedgerError(f"segment {index} stalled twice")
        self.stalled = self.stalled | {index}
        if self.states[index] is SegmentState.GROWING:
            self.rolling_back = None
            assert self.grow is not None  # GROWING only inside a grow
            for queued in self.grow:
                if self.states[queued] is SegmentState.QUEUED:
                    self.states[queued] = SegmentState.FREE
            self.grow = None

    def returned(self, index: int) -> None:
        """Giving a free segment's pages back, which failed or was interrupted before, was done."""
        if index not in self.unreturned:
            raise LedgerError(f"segment {index} returned but had nothing to give back")
        self.unreturned = self.unreturned - {index}

    def _settled(self, index: int) -> None:
        """Its teardown is done: no longer stalled, nor a rollback under way."""
        self.stalled = self.stalled - {index}
        self.rolling_back = None if self.rolling_back == index else self.rolling_back

    def _free(self, index: int, returned: bool) -> None:
        self._settled(index)
        self.unreturned = self.unreturned - {index} if returned else self.unreturned | {index}
        self.states[index] = SegmentState.FREE

    # -- the pool's teardown -------------------------------------------------------------------

    def begin_teardown(self) -> tuple[int, ...]:
        """The pool exits: every pinned segment is given up; the segments to tear down (growing ones: roll back),
        highest first. The floor's session is the lifecycle's: it goes after these."""
        for index in self.in_state(SegmentState.PINNED):
            self.states[index] = SegmentState.RELEASING
        self.stalled = frozenset()  # the exit takes every segment over, those left stalled too
        return tuple(reversed(self.in_state(*_SESSION)))

    def close(self) -> None:
        """Every segment's session is torn down: close the book (idempotent)."""
        left = self.in_state(*_SESSION, SegmentState.QUEUED)
        if left:
            raise LedgerError(f"close with segments {left} still holding a session or queued")
        self.grow, self.stalled, self.rolling_back = None, frozenset(), None
        self.closed = True
