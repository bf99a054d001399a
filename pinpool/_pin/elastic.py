"""An elastic pool's grows and shrinks (docs/elastic-design.md): each segment above the floor is pinned by one
unchanged :class:`PinSession` and released by that session's teardown, then its pages go back to the host.
The rules are the pure :class:`SegmentBook`'s; this module makes the sessions and yields the steps a driver
runs, as the lifecycle does (it imports no driver). Every book change is made under ``_lock``."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import _probe
from .._errors import ConfigError, PoolStateError, RegionInUseError, UnpinError
from .._node.pacing import NodeAdmission
from .._observe import Observer
from .._plan.chunks import Chunk
from .._plan.options import PoolOptions
from .._plan.plan import Schedule
from .._plan.preflight import check_pinning
from .._plan.reservation import segment_schedule
from .._plan.segment_book import SegmentBook, SegmentState, Shrink, merged
from .._plan.segments import Reservation
from .._plan.transfers import split_at_registrations
from .._units import format_bytes
from ..registrars import TransferPiece, TransferRegistration
from .engine import Memory, PinSession
from .gates import PoolAdmission
from .ledger import Phase, StopCause
from .outcome import Ran, RunThreads, Steps, pin_error, unpin_error
from .teardown import TEARDOWN_TRIES, tear_down

if TYPE_CHECKING:
    from .._types import Capabilities
    from ..registrars import TransferRegistrar
    from ..runtimes import Runtime


@dataclass(frozen=True)
class Grown:
    """What ``pool.grow()`` pinned: the page ranges now usable that it added."""

    pages: tuple[range, ...]

    @property
    def num_pages(self) -> int:
        return sum(len(r) for r in self.pages)


@dataclass(frozen=True)
class Shrunk:
    """What ``pool.shrink()`` did: ``released`` (pages unpinned and given back), ``kept`` (named pages of
    segments not named whole: still usable), ``unreturned`` (released or recovered pages whose give-back failed),
    ``recovered`` (pages earlier shrinks gave up but could not release, their teardown having raised: this one
    unpinned them and gave them back; counted by the shrink that failed, so not in ``released``)."""

    released: tuple[range, ...]
    kept: tuple[range, ...]
    unreturned: tuple[range, ...] = ()
    recovered: tuple[range, ...] = ()


class Elastic:
    """The segments of one elastic pool: the book, each live segment's session, the grow under way."""

    def __init__(
        self, schedule: Schedule, reservation: Reservation, options: PoolOptions, *, runtime: Runtime,
        caps: Capabilities, observer: Observer, registrars: tuple[TransferRegistrar, ...] = (),
        admission: NodeAdmission | None = None,
    ) -> None:  # fmt: skip
        self.schedule, self.reservation = schedule, reservation
        self.options, self.grow_options = options, options.growing()
        self.runtime, self.caps, self.observer, self.registrars = runtime, caps, observer, registrars
        self.admission = admission
        self.name = options.name
        self.book = SegmentBook(reservation)
        self.sessions: dict[int, PinSession] = {}
        self._schedules: dict[int, Schedule] = {}
        # Re-entrant: a close() run by a signal handler on a thread inside a read or a booking here goes on (its
        # teardown tolerates a booking it interrupted: a segment started without a session is simply free again).
        self._lock = threading.RLock()
        # Give-backs under way (madvise by address, on a thread): the pool's teardown waits for them before the
        # mapping goes, and none starts once it began. It waits for nothing else a grow or shrink does: a close()
        # on the event loop running an async shrink would wait for ever; it takes their segments over instead.
        # A lock of their own: a thread giving back never waits for ``_lock``, which the closing thread may hold.
        self._giving = 0
        self._gives = threading.Condition(threading.Lock())
        self._closing = False  # the pool exits: no new grow or shrink (set under both locks)
        # The grow's segment in flight while it pins (a closer may take it over: stop it and roll it back itself).
        self._pinning: tuple[int, PinSession, PoolAdmission] | None = None
        self._pacings: dict[int, PoolAdmission] = {}  # each live segment's node budget share
        self._taken = False  # the closer took the grow's segment over: its driver only raises
        self.leaked_chunks: tuple[Chunk, ...] = ()
        self.leaked_sessions: dict[int, PinSession] = {}  # their chunks may stay pinned: still counted and listed
        self._pid = os.getpid()  # a forked child lets go: it never grows, shrinks or gives back its parent's pages

    def segment_plan(self, index: int) -> Schedule:
        with self._lock:
            plan = self._schedules.get(index)
            if plan is None:
                plan = self._schedules[index] = segment_schedule(self.schedule, self.reservation, index)
            return plan

    # -- reading -----------------------------------------------------------------------------

    def usable_runs(self, floor_usable: int) -> tuple[range, ...]:
        with self._lock:
            return self.book.usable_runs(floor_usable)

    def pinned_pages(self, floor_usable: int) -> int:
        with self._lock:
            return self.book.pinned_pages(floor_usable)

    def live_sessions(self) -> tuple[tuple[int, PinSession], ...]:
        """Every segment session holding pages now: growing, pinned, releasing, and leaked ones."""
        with self._lock:
            return tuple(sorted({**self.leaked_sessions, **self.sessions}.items()))

    def usable_session(self, index: int) -> PinSession | None:
        """The session of segment ``index`` if its pages are usable now (PINNED), else None."""
        with self._lock:
            return self.sessions.get(index) if self.book.states[index] is SegmentState.PINNED else None

    # -- growing -----------------------------------------------------------------------------

    def grow(self, memory: Memory, pages: int) -> Steps[Grown]:
        """Pin the lowest free segments holding ``pages`` pages, one session each, announcing each once pinned;
        a failure or an interruption rolls back the segment in flight and raises (those pinned before stay)."""
        with self._lock:
            self._open(f"grow(pages={pages!r})")
            stuck = self.book.resume_rollback(pages)
            indices = self.book.begin_grow(pages) if stuck is None else ()
        if stuck is not None:
            yield from self._resume_rollback(memory, stuck, f"grow(pages={pages!r})")
            with self._lock:
                self._open(f"grow(pages={pages!r})")
                indices = self.book.begin_grow(pages)
        try:
            for index in indices:
                yield from self._grow_segment(memory, index)
        except BaseException as exc:
            with self._lock:
                grown = tuple(i for i in indices if self.book.states[i] is SegmentState.PINNED)
                if grown:
                    shown = ", ".join(f"[{r.start}, {r.stop})" for r in self.book.pages_of(grown))
                    exc.add_note(f"pinpool: pages {shown} grew before it, and stay usable")
            raise
        finally:
            with self._lock:
                # closing: the closer ends it (a rollback that raised ended it already: the segment is stalled)
                if self.book.grow is not None and not self._closing and not self.book.in_state(SegmentState.GROWING):
                    self.book.end_grow()
                grown = tuple(i for i in indices if self.book.states[i] is SegmentState.PINNED)
        return Grown(self.book.pages_of(grown))

    def _grow_segment(self, memory: Memory, index: int) -> Steps[None]:
        segment = self.reservation.segments[index]
        plan = self.segment_plan(index)
        pacing = PoolAdmission(
            self.admission, name=self.name, nbytes=segment.nbytes, describe=self._describe(index),
            observer=self.observer,
        )  # fmt: skip
        with self._lock:
            self._open(f"grow: segment {index}, pages [{segment.pages.start}, {segment.pages.stop})")
            self.book.start(index)
            try:
                session = PinSession(
                    plan, self.grow_options, runtime=self.runtime, caps=self.caps, observer=self.observer,
                    memory=memory, registrars=self.registrars,
                )  # fmt: skip
            except BaseException:
                self.book.rolled_back(index, returned=True)  # nothing was touched
                raise
            self.sessions[index], self._pacings[index] = session, pacing
            self._pinning = (index, session, pacing)
        ran, error = Ran(), None
        try:
            with self._lock:  # a close() run by a signal handler inside the booking above: its teardown freed it
                if self._closing:
                    raise PoolStateError(f"{self._describe(index)}: the pool was closed while it grew; undone")
            self._check_memory(plan)
            self._take_back(memory, index)
            yield from pacing.admit()
            ran = yield RunThreads(
                bodies=session.worker_bodies(), name=f"pinpool-{self.name}-grow", interruptible=True,
                on_interrupt=session.cancel, on_started=session.go,
            )  # fmt: skip
        except BaseException as exc:
            error = exc
        finally:
            pacing.release_slot()
        with self._lock:
            if self._taken:  # close() tore the pool down meanwhile, this segment with it
                self._taken = False
                raise PoolStateError(
                    f"{self._describe(index)}: the pool was closed while it grew; the segment was rolled back"
                ) from error
            self._pinning = None
            crashed = bool(ran.crashed) or (error is None and ran.started == 0)
            if crashed or error is not None:
                failure = error is None or isinstance(error, Exception)
                session.stop(StopCause.FAILURE if failure else StopCause.CANCELLED)
            phase = session.finish_pinning()
            interruption = error or (ran.interrupts[0] if ran.interrupts else None)
            if interruption is None and self._closing:
                interruption = PoolStateError(f"{self._describe(index)}: the pool was closed while it grew; undone")
            if phase is Phase.PINNED and interruption is None:
                self.book.grown(index)  # announced: pinned_runs, pinned_pages
                return
        unpinned: UnpinError | None = None
        interrupts: list[BaseException] = []
        raised: BaseException | None = None
        try:
            unpinned, interrupts = yield from self._undo(memory, index, session)
        except GeneratorExit:
            raise
        except BaseException as exc:  # raised TEARDOWN_TRIES times: left growing, the next grow() resumes it
            with self._lock:
                self._stall(index)
            raised = exc
        failed = None
        if interruption is None:  # read after the rollback: the chunks it could not unregister are named
            causes = ran.crashed or ran.start_errors
            failed = pin_error(
                describe=self._describe(index), nbytes=segment.nbytes, chunk_limit=plan.chunk_limit,
                failures=session.ledger.failures_in("populate", "register"), leaked=session.leaked(),
                retries=session.retries, cause=causes[0] if causes else None, crashed=bool(ran.crashed), kept=None,
            )  # fmt: skip
        if raised is not None:  # the grow's own error goes on (an interruption as itself), this one said with it
            first = interruption or (None if isinstance(raised, Exception) else raised) or failed
            assert first is not None
            first.add_note(f"pinpool: {self._stuck(index, raised, 'rolling back', 'growing', 'grow()')}")
            raise first
        first = interruption or (interrupts[0] if interrupts else None) or failed or unpinned
        assert first is not None
        if unpinned is not None and first is not unpinned:
            first.add_note(f"pinpool: {unpinned}")
        raise first

    def _resume_rollback(self, memory: Memory, index: int, what: str) -> Steps[None]:
        """A grow whose rollback raised left segment ``index`` growing: roll it back now (FREE after, and the
        grow goes on); :class:`PoolStateError` naming it if that raises again (it stays growing)."""
        with self._lock:
            session = self.sessions[index]
        try:
            unpinned, interrupts = yield from self._undo(memory, index, session)
        except GeneratorExit:
            raise
        except BaseException as exc:
            with self._lock:
                self._stall(index)
            stuck = self._stuck(index, exc, "resuming the rollback", "growing", "grow()")
            if not isinstance(exc, Exception):
                exc.add_note(f"pinpool: {stuck}")
                raise
            raise PoolStateError(f"{what}: {stuck}") from exc
        with self._lock:
            if self.book.grow is not None and not self._closing:
                self.book.end_grow()
        problem = unpinned or (interrupts[0] if interrupts else None)
        if problem is not None:  # leaked (booked: it never grows again) or interrupted: the grow stops here
            raise problem

    def _check_memory(self, plan: Schedule) -> None:
        """The memory pre-flight for the segment's bytes, read now (a grow may come long after entry)."""
        host = _probe.probe_host()
        check_pinning(
            self.options, host, self.caps, mapping_bytes=plan.nbytes,
            buffer_bytes=[end - start for start, end in ((r.start, r.end) for r in plan.page_runs)],
        )  # fmt: skip

    # -- giving pages up ---------------------------------------------------------------------

    def shrink(self, memory: Memory, *, pages: object = None, to_pages: object = None) -> Steps[Shrunk]:
        """Release the pinned segments the caller gave up whole (``pages``: ranges; ``to_pages``: the tail from
        there): their sessions torn down, then their pages given back. Refusals change nothing."""
        with self._lock:
            self._open("shrink()")
            if (pages is None) == (to_pages is None):
                raise ConfigError("shrink(): give pages=[range(first, stop), ...] or to_pages=k, one of them")
            shrink: Shrink = (
                self.book.begin_shrink_to(to_pages) if to_pages is not None  # type: ignore[arg-type]
                else self.book.begin_shrink(pages)  # type: ignore[arg-type]
            )  # fmt: skip
            sessions = {index: self.sessions[index] for index in (*shrink.resumed, *shrink.released)}
        unreturned: list[range] = []
        problems: list[BaseException] = []  # every released segment is torn down whatever happens to one
        # Those earlier shrinks left releasing first, then the named ones; each highest first, as the pool's teardown
        for index in (*reversed(shrink.resumed), *reversed(shrink.released)):
            try:
                unpinned, interrupts = yield from self._undo(memory, index, sessions[index])
            except GeneratorExit:
                raise
            except BaseException as exc:  # raised TEARDOWN_TRIES times: left releasing, the next shrink resumes it
                with self._lock:
                    self._stall(index)
                stuck = self._stuck(index, exc, "tearing down", "releasing", "shrink()")
                if isinstance(exc, Exception):  # typed, the cause kept; an interruption goes on as itself
                    problems.append(UnpinError(f"shrink(): {stuck}", failures=(), leaked=()))
                    problems[-1].__cause__ = exc
                else:
                    exc.add_note(f"pinpool: {stuck}")
                    problems.append(exc)
                continue
            problems += [unpinned] if unpinned is not None else []
            problems += interrupts
            if index in self.book.unreturned:
                unreturned.append(self.reservation.segments[index].pages)
        recovered = self.book.pages_of(shrink.resumed)
        if problems:
            first = problems[0]
            for more in problems[1:]:
                first.add_note(f"pinpool: then {more!r}")
            raise first
        return Shrunk(shrink.pages, shrink.kept, merged(unreturned), recovered)

    def _stall(self, index: int) -> None:
        """(Under the lock.) Segment ``index``'s teardown raised TEARDOWN_TRIES times: booked stalled for the next
        shrink or grow to resume, unless the pool's teardown took it over (then that one finishes it)."""
        if self._booked(index) and not self._closing and index not in self.book.stalled:
            self.book.stall(index)

    def _stuck(self, index: int, exc: BaseException, what: str, state: str, resumes: str) -> str:
        return (
            f"{what} {self._describe(index)} raised {exc!r} {TEARDOWN_TRIES} times: the segment stays {state} "
            f"(never usable; its pages may stay pinned, and are not given back); the next {resumes} resumes it, "
            "and the pool's exit tears it down"
        )

    # -- a segment's teardown ----------------------------------------------------------------

    def _undo(
        self, memory: Memory | None, index: int, session: PinSession, *, join: bool = True
    ) -> Generator[RunThreads, Ran, tuple[UnpinError | None, list[BaseException]]]:
        """Tear ``session`` down (registrars first, then the runtime; resumed TEARDOWN_TRIES times), then give
        its pages back; the book says FREE, or LEAKED with the UnpinError returned."""
        # Raised TEARDOWN_TRIES times, the segment stays as it is (GROWING, RELEASING) and its caller books it stalled:
        # the next grow (growing) or shrink (releasing) resumes it, or the exit. Each step here is resumable.
        failures, interrupts = yield from tear_down(
            session, self.observer, f"pinpool-{self.name}-shrink", lambda failures: failures, join=join
        )
        leaked = session.leaked()
        if leaked:
            pacing = None
            with self._lock:
                if self._booked(index):  # the first of the shrink and a close() taking it over books it
                    self.book.leaked(index)
                    self.leaked_sessions[index] = self.sessions.pop(index, session)
                    self.leaked_chunks += leaked
                    pacing = self._pacings.pop(index, None)
            if pacing is not None:
                pacing.release_budget(keep=True)
            return unpin_error(self.name, failures, leaked), interrupts
        returned: list[bool] = []
        if memory is not None:  # on a thread: a GiB takes ~0.2 s, not the event loop's to spend
            shrinking = self.book.states[index] is SegmentState.RELEASING  # not a grow's rollback: counted released
            give = functools.partial(self._give_back, memory, index, returned, counted=shrinking)
            ran = yield RunThreads(bodies=(give,), name=f"pinpool-{self.name}-give")
            interrupts += ran.interrupts
        pacing = None
        with self._lock:
            if self._booked(index):
                self._book_free(index, returned=bool(returned))
                self.sessions.pop(index, None)
                pacing = self._pacings.pop(index, None)
        if pacing is not None:
            pacing.release_budget()
        return None, interrupts

    def _book_free(self, index: int, *, returned: bool) -> None:
        if self.book.states[index] is SegmentState.GROWING:
            self.book.rolled_back(index, returned=returned)
        else:
            self.book.released(index, returned=returned)

    def _booked(self, index: int) -> bool:
        """Whether segment ``index``'s teardown is still to be booked (under the lock): a shrink and a close()
        that took its segment over both finish it, and the book takes it once."""
        return not self.book.closed and self.book.states[index] in (SegmentState.GROWING, SegmentState.RELEASING)

    def _give_back(self, memory: Memory, index: int, returned: list[bool], *, counted: bool) -> None:
        """The segment's pages back to the host (they are unpinned); ``returned`` gets True once done. Never once
        the pool's teardown began: the mapping goes next, and its addresses may be another mapping's then."""
        give_back: Callable[[int, int], None] | None = getattr(memory, "give_back", None)
        with self._gives:
            if give_back is None or self._closing or os.getpid() != self._pid:
                return
            self._giving += 1
        try:
            for lo, hi in self._whole_pages(index):
                give_back(lo, hi - lo)
        except RegionInUseError:  # no failure: another process's pool may be using them; unreturned, and said why
            segment = self.reservation.segments[index]
            self.observer.kept_in_region(segment.pages, segment.nbytes)
        except Exception as exc:  # still unpinned: counted as unreturned, retried by no one but a regrow
            self.observer.failed_in_background(exc)
        else:
            returned.append(True)
            if counted:  # a shrink's: pinpool_released_bytes_total
                self.observer.gave_back(sum(hi - lo for lo, hi in self._whole_pages(index)))
        finally:
            with self._gives:
                self._giving -= 1
                self._gives.notify_all()

    def _take_back(self, memory: Memory, index: int) -> None:
        """A shared region's pages of the segment allocated in its file before they are faulted: a hole punched
        by a shrink that a full file system cannot fill is a ConfigError here, not a SIGBUS in a pin worker."""
        take_back: Callable[[int, int], None] | None = getattr(memory, "take_back", None)
        if take_back is not None:
            for lo, hi in self._whole_pages(index):
                take_back(lo, hi - lo)

    def _whole_pages(self, index: int) -> list[tuple[int, int]]:
        """The segment's slices, each cut to the whole pages inside it (a page shared with a neighbour stays)."""
        grain = max(self.schedule.page_size, self.schedule.align)
        cut = [
            (-(-start // grain) * grain, end // grain * grain) for start, end in self.reservation.segments[index].slices
        ]
        return [(lo, hi) for lo, hi in cut if hi > lo]

    # -- the pool's teardown -------------------------------------------------------------------

    def teardown(
        self, *, join: bool = True
    ) -> Generator[RunThreads, Ran, tuple[UnpinError | None, list[BaseException]]]:
        """Every live segment's session, highest first, before the floor's: a grow in flight is stopped and rolled
        back here (its driver then raises), a shrink under way is waited for. Resumable."""
        with self._lock:
            with self._gives:
                self._closing = True
            taken = self._pinning
            if taken is not None:
                self._pinning, self._taken = None, True
                taken[2].cancel.set()
                taken[1].stop(StopCause.EXIT)
        interrupts: list[BaseException] = []
        if taken is not None:
            ran = yield RunThreads(bodies=(taken[1].wait_idle,), name=f"pinpool-{self.name}-stop-grow")
            interrupts += ran.interrupts
        if self._giving:  # read once closing is set: none starts now
            ran = yield RunThreads(bodies=(self._wait_giving,), name=f"pinpool-{self.name}-wait-give")
            interrupts += ran.interrupts
        first: UnpinError | None = None
        with self._lock:
            if self.book.closed:
                return None, interrupts
            order = self.book.begin_teardown()
            sessions = {index: self.sessions[index] for index in order if index in self.sessions}
            for index in order:  # started, and interrupted before its session was made: nothing of it is pinned
                if index not in sessions:
                    self._book_free(index, returned=False)
        for index in order:  # a shrink's too: its session's teardown resumes here, and is booked once
            if index in sessions:
                unpinned, more = yield from self._undo(None, index, sessions[index], join=join)  # the mapping next
                interrupts += more
                first = first or unpinned
        with self._lock:
            if self.book.grow is not None:
                self.book.end_grow()
            self.book.close()
        return first, interrupts

    def _wait_giving(self) -> None:
        """Until no give-back is under way (none starts once the teardown began: a bounded wait, on no loop)."""
        with self._gives:
            self._gives.wait_for(lambda: not self._giving)

    def let_go_in_child(self) -> None:
        """A forked child: its sessions are its parent's (their teardown disowns them); no page is usable here."""
        self.sessions.clear()
        self.leaked_sessions.clear()
        self._closing = True
        self.book.closed = True  # takes no lock: one may have been held by a thread at fork

    def _open(self, what: str) -> None:
        if os.getpid() != self._pid:
            raise PoolStateError(
                f"pool {self.name!r}: {what} in a forked child: the pool and its pages are the parent's; grow and "
                "shrink it in the process that entered it"
            )
        if self._closing:
            raise PoolStateError(f"pool {self.name!r}: {what}: the pool is being exited; create a new pool to grow")

    def _describe(self, index: int) -> str:
        segment = self.reservation.segments[index]
        return (
            f"pool {self.name!r} segment {index} (pages [{segment.pages.start}, {segment.pages.stop}), "
            f"{format_bytes(segment.nbytes)}, {len(segment.chunks)} chunks, runtime {self.runtime.name})"
        )

    # -- transfers ---------------------------------------------------------------------------

    def transfer_pieces(
        self, index: int, name: str, spans: Sequence[tuple[int, int]], floor: PinSession, base: int, what: str
    ) -> tuple[TransferPiece, ...]:
        """Registrar ``index``'s pieces of ``spans`` (bytes from the pool's start): each span cut at segment
        slices, then at that segment's registrations; :class:`PoolStateError` for bytes of a segment not usable."""
        segments = self.reservation.segments
        pieces: list[TransferPiece] = []
        for span_start, length in spans:
            start, end = span_start, span_start + length
            while start < end:
                at = self.reservation.segment_of(start)
                stop = min(end, next(hi for lo, hi in segments[at].slices if lo <= start < hi))
                session = floor if segments[at].floor else self.usable_session(at)
                plan = self.segment_plan(at).transfers[index]
                cut = split_at_registrations(plan, start, stop - start)
                held = {} if session is None or session.transfers is None else session.transfers.held(
                    index, {r for _offset, _nbytes, r in cut}
                )  # fmt: skip
                for piece_offset, piece_bytes, r in cut:
                    run = plan.registrations[r]
                    if r not in held:
                        pages = segments[at].pages
                        raise PoolStateError(
                            f"pool {self.name!r}: bytes [{run.offset}, {run.end}) (pages [{pages.start}, "
                            f"{pages.stop}), segment {at}) are not registered with {name!r} now ({what}): grow "
                            "the pool (or wait_ready()) for the pages first, and address only pool.pinned_runs"
                        )
                    registration = TransferRegistration(name, run.offset, run.nbytes, base + run.offset, held[r])
                    pieces.append(TransferPiece(piece_offset, piece_bytes, base + piece_offset, registration))
                start = stop
        return tuple(pieces)

    def transfer_registrations(self, index: int, name: str, base: int) -> list[TransferRegistration]:
        """What registrar ``index`` holds of the segments now (the floor's are the lifecycle's session's)."""
        return [
            TransferRegistration(name, run.offset, run.nbytes, base + run.offset, handle)
            for _segment, session in self.live_sessions()
            if session.transfers is not None
            for run, handle in session.transfers.live(index)
        ]
