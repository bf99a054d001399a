"""The lifecycle's rules with scripted step results: no driver, no thread, microseconds each.

The lifecycle's generators yield steps (``RunThreads``, ``Detach``); here the test is the
driver. It runs a step's bodies inline on this thread, or reports what it likes instead
(interruptions, crashed workers, no threads), and steps a background pool's conductor by hand,
so every ordering (exit before or after a failure, collection during pinning) is exact.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing

import pinpool
from pinpool import PinError, PoolState, PoolStateError, UnclosedPoolWarning, UnpinError
from pinpool._errors import NodeBusyError, NodeWaitCancelled
from pinpool._pin import (
    TRANSITIONS,
    Detach,
    Outcome,
    Ran,
    RunThreads,
    Step,
    StopCause,
    TransitionError,
    check_move,
    decide,
)
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRuntime

from ..conftest import lifecycle_of

MiB = 1 << 20
Gen = Generator[Step, Ran, Any]


# -- the pure rules -------------------------------------------------------------------------------


def test_every_state_change_is_in_the_table_and_nothing_else_is_allowed() -> None:
    allowed = {(a, b) for a, tos in TRANSITIONS.items() for b in tos}
    for a in PoolState:
        for b in PoolState:
            if (a, b) in allowed:
                check_move(a, b)
            else:
                with pytest.raises(TransitionError):
                    check_move(a, b)
    assert TRANSITIONS[PoolState.CLOSED] == frozenset()  # closed is final
    assert PoolState.READY not in TRANSITIONS[PoolState.FAILED]  # a failed pool never becomes ready


@pytest.mark.parametrize("interrupted", [False, True])
@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("cause", [None, *StopCause])
@pytest.mark.parametrize("orphaned", [False, True])
def test_decide_is_total_and_an_interruption_always_wins(
    interrupted: bool, pinned: bool, cause: StopCause | None, orphaned: bool
) -> None:
    outcome = decide(interrupted=interrupted, pinned=pinned, stop_cause=cause, orphaned=orphaned)
    if interrupted:
        assert outcome is Outcome.INTERRUPTED
    elif pinned:
        assert outcome is (Outcome.ORPHANED if orphaned else Outcome.READY)
    else:
        expected = {
            StopCause.EXIT: Outcome.EXITED,
            StopCause.COLLECTED: Outcome.ORPHANED,
        }.get(cause, Outcome.FAILED)  # type: ignore[arg-type]
        assert outcome is expected
    assert (outcome.cause == "failure") == (outcome is Outcome.FAILED)  # only a failure is one


# -- a driver written by the test ------------------------------------------------------------------


def inline(step: Step) -> Ran:
    """Run a RunThreads step's bodies one after the other on this thread."""
    assert isinstance(step, RunThreads)
    ran = Ran(started=len(step.bodies))
    step.on_started()
    for body in step.bodies:
        try:
            body()
        except BaseException as exc:
            ran.crashed.append(exc)
    return ran


def drive(gen: Gen, *script: Callable[[Step], Ran]) -> Any:
    """Drive ``gen``: the n-th step gets ``script[n]`` (then ``inline`` for the rest)."""
    steps = iter(script)
    try:
        step = next(gen)
        while True:
            step = gen.send(next(steps, inline)(step))
    except StopIteration as stop:
        return stop.value


class Conductor:
    """A Detach step's handle whose join runs the detached sequence inline, when the test says."""

    def __init__(self, step: Detach) -> None:
        self.gen = step.steps
        self.stop = step.stop  # what the driver calls when the interpreter starts to exit
        self.done = False
        self.script: list[Callable[[Step], Ran]] = []

    def join(self) -> None:
        if not self.done:
            self.done = True
            drive(self.gen, *self.script)


def detach_into(box: list[Conductor]) -> Callable[[Step], Ran]:
    def run(step: Step) -> Ran:
        assert isinstance(step, Detach)
        box.append(Conductor(step))
        return Ran(started=1, detached=box[-1])

    return run


class Events(list[dict[str, Any]]):
    """Every event a pool logs, as dicts with ``event`` and ``log_level``."""

    def logger(self) -> Any:
        def keep(_logger: Any, method: str, event: dict[str, Any]) -> Any:
            self.append({**event, "log_level": method})
            raise structlog.DropEvent

        return structlog.wrap_logger(structlog.testing.CapturingLogger(), processors=[keep])

    def of(self, name: str, field: str = "cause") -> list[Any]:
        return [e[field] for e in self if e["event"] == name]


def pool_of(fake: FakeRuntime, logs: Events | None = None, **kw: Any) -> pinpool.PinnedPool:
    options: dict[str, Any] = {
        "size": 8 * MiB, "chunk_bytes": MiB, "runtime": fake, "registry": None, "register_workers": 1,
        "populate": False, "populate_workers": 1, "unpin_workers": 1, "name": "scripted", "max_retries": 0,
        "logger": (logs if logs is not None else Events()).logger(),
    }  # fmt: skip
    options.update(kw)
    pool = pinpool.PinnedPool(**options)
    assert lifecycle_of(pool).plan.threads == 1
    return pool


def report(ran: Ran) -> Callable[[Step], Ran]:
    return lambda _step: ran


@pytest.fixture(autouse=True)
def _no_claims_left() -> Any:
    before = PINNED_RANGES.snapshot()  # earlier tests' leaked chunks stay claimed for the process's life
    yield
    assert PINNED_RANGES.snapshot() == before


# -- foreground ------------------------------------------------------------------------------------


def test_foreground_ready_then_exit_then_exit_again_is_a_no_op(fake: FakeRuntime) -> None:
    pool = pool_of(fake)
    life = lifecycle_of(pool)
    drive(life.enter())
    assert life.state is PoolState.READY and len(fake.registered) == 8 and life.pinned_pages == pool.num_pages
    assert drive(life.exit(None)) is None
    assert life.state is PoolState.CLOSED and fake.registered == {}
    assert drive(life.exit(None)) is None and len(fake.unregister_calls) == 8


def test_foreground_failure_rolls_back_then_raises_a_pin_error() -> None:
    fake = FakeRuntime(fail_register_on=4)
    logs = Events()
    life = lifecycle_of(pool_of(fake, logs))
    with pytest.raises(PinError, match="rolled back") as raised:
        drive(life.enter())
    assert raised.value.failures[0].error.code == 2
    assert life.state is PoolState.CLOSED and fake.registered == {} and life.memory is None
    assert logs.of("pool.rollback") == ["failure"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit, ValueError])
def test_foreground_interruption_rolls_back_and_is_raised_as_itself(
    fake: FakeRuntime, interrupt: type[BaseException]
) -> None:
    logs = Events()
    life = lifecycle_of(pool_of(fake, logs))
    first = interrupt("stop")

    def half_then_interrupted(step: Step) -> Ran:
        assert isinstance(step, RunThreads)
        step.on_interrupt()  # what a driver does with the first interruption
        ran = inline(step)
        ran.interrupts.append(first)
        return ran

    with pytest.raises(interrupt) as raised:
        drive(life.enter(), half_then_interrupted)
    assert raised.value is first
    assert life.state is PoolState.CLOSED and fake.registered == {}
    assert logs.of("pool.rollback") == ["cancelled"]


def test_an_interrupt_during_the_rollback_of_a_failure_propagates_with_the_failure_as_a_note() -> None:
    fake = FakeRuntime(fail_register_on=3)
    life = lifecycle_of(pool_of(fake))

    def teardown_interrupted(step: Step) -> Ran:
        ran = inline(step)  # the teardown completes...
        ran.interrupts.append(KeyboardInterrupt())  # ...and a Ctrl-C arrived meanwhile
        return ran

    with pytest.raises(KeyboardInterrupt) as raised:
        drive(life.enter(), inline, teardown_interrupted)
    assert any("injected failure" in note for note in raised.value.__notes__)
    assert life.state is PoolState.CLOSED and fake.registered == {}


def test_a_crashed_worker_and_no_threads_are_pin_errors_after_a_full_rollback(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))

    def crashed(step: Step) -> Ran:
        ran = inline(step)
        ran.crashed.append(RuntimeError("worker bug"))
        return ran

    with pytest.raises(PinError, match="pinpool bug") as raised:
        drive(life.enter(), crashed)
    assert isinstance(raised.value.__cause__, RuntimeError) and fake.registered == {}

    life = lifecycle_of(pool_of(fake))
    with pytest.raises(PinError, match="out of threads"):
        drive(life.enter(), report(Ran(started=0, start_errors=[RuntimeError("can't start new thread")])))
    assert life.state is PoolState.CLOSED and fake.registered == {}


def test_on_progress_raising_at_the_final_report_is_raised_as_itself(fake: FakeRuntime) -> None:
    calls: list[int] = []

    def on_progress(pinned: int, total: int, done: int, chunks: int) -> None:
        calls.append(done)
        raise LookupError("the callback's own error")

    life = lifecycle_of(pool_of(fake, on_progress=on_progress))
    with pytest.raises(LookupError, match="own error"):
        drive(life.enter())
    assert calls == [8] and life.state is PoolState.CLOSED and fake.registered == {}


def test_an_entry_step_that_raises_leaves_nothing_claimed(fake: FakeRuntime) -> None:
    pool = pool_of(fake)
    life = lifecycle_of(pool)
    life._open_session = lambda _memory: (_ for _ in ()).throw(KeyboardInterrupt())  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        drive(life.enter())
    assert life.state is PoolState.CLOSED and life.memory is None and fake.register_calls == []


def test_exit_of_a_pool_never_entered_is_an_error_and_close_is_not(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))
    with pytest.raises(PoolStateError, match="only after it was entered"):
        drive(life.exit(None))
    assert drive(life.exit(None, closing=True)) is None
    assert life.state is PoolState.CLOSED
    with pytest.raises(PoolStateError, match="entered once"):
        drive(life.enter())


def test_an_unpin_failure_is_raised_on_exit_noted_on_a_body_error_or_returned() -> None:
    for mode in ("raise", "note", "return"):
        fake = FakeRuntime(fail_unregister_on=1)
        life = lifecycle_of(pool_of(fake, name=f"unpin-{mode}"))
        drive(life.enter())
        if mode == "raise":
            with pytest.raises(UnpinError, match="failed to unregister"):
                drive(life.exit(None))
        elif mode == "note":
            body = KeyError("body")
            assert drive(life.exit(body)) is None
            assert any("failed to unregister" in n for n in body.__notes__)
        else:
            assert isinstance(drive(life.exit(None, closing=True, raise_errors=False)), UnpinError)
        assert life.state is PoolState.CLOSED and len(fake.registered) == 1  # the leaked chunk
        PINNED_RANGES.pop(next(iter(fake.registered)) - 7 * MiB)  # kept claimed: part may be pinned


# -- background --------------------------------------------------------------------------------------


def enter_background(fake: FakeRuntime, logs: Events | None = None, **kw: Any) -> tuple[pinpool.PinnedPool, Conductor]:
    pool = pool_of(fake, logs, background=True, **kw)
    box: list[Conductor] = []
    drive(lifecycle_of(pool).enter(), detach_into(box))
    assert pool.state is PoolState.PINNING and lifecycle_of(pool).tensors is not None
    return pool, box[0]


def test_background_failure_keeps_every_registered_chunk_until_exit() -> None:
    fake = FakeRuntime(fail_register_on=4)
    logs = Events()
    pool, conductor = enter_background(fake, logs)
    life = lifecycle_of(pool)
    conductor.join()  # pins chunks 0-2, the 4th call fails
    assert life.state is PoolState.FAILED and len(fake.registered) == 3 and fake.unregister_calls == []
    assert life.pinned_pages == 3 * MiB // pool.plan.page_bytes  # frozen, not 0: the body may use them
    assert isinstance(life.error, PinError) and "stay pinned" in str(life.error)
    assert logs.of("pool.rollback") == ["failure"] and logs.of("pool.rollback", "kept_bytes") == [3 * MiB]
    assert logs.of("pool.failed", "log_level") == ["error"]
    with pytest.raises(PinError):
        life.reached(None)  # a waiter gets it (and it counts as seen)
    assert pool.tensor.numel() == pool.nbytes  # the views stay usable
    assert drive(life.exit(None)) is None  # seen: not raised again
    assert life.state is PoolState.CLOSED and fake.registered == {}


def test_background_unseen_failure_is_raised_on_exit_after_unpinning() -> None:
    fake = FakeRuntime(fail_register_on=2)
    pool, conductor = enter_background(fake)
    conductor.join()
    with pytest.raises(PinError, match="stay pinned"):
        drive(lifecycle_of(pool).exit(None))
    assert fake.registered == {} and pool.state is PoolState.CLOSED


def test_background_exit_while_pinning_is_a_normal_shutdown_not_a_failure(fake: FakeRuntime) -> None:
    logs = Events()
    pool, conductor = enter_background(fake, logs)
    assert drive(lifecycle_of(pool).exit(None)) is None  # its join step runs the conductor: stopped at once
    assert conductor.done and fake.registered == {} and pool.state is PoolState.CLOSED
    assert logs.of("pool.rollback") == ["exit"] and logs.of("pool.rollback", "log_level") == ["info"]
    assert logs.of("pool.failed") == []


def test_background_on_progress_error_is_kept_as_itself_and_counted_as_cancelled(fake: FakeRuntime) -> None:
    logs = Events()
    pool, conductor = enter_background(fake, logs, on_progress=lambda *_: None)
    error = OverflowError("callback")

    def interrupted(step: Step) -> Ran:
        ran = inline(step)
        ran.interrupts.append(error)
        return ran

    conductor.script = [interrupted]
    conductor.join()
    assert pool.state is PoolState.FAILED and lifecycle_of(pool).error is error and len(fake.registered) == 8
    assert logs.of("pool.rollback") == ["cancelled"]
    with pytest.raises(OverflowError):
        drive(lifecycle_of(pool).exit(None))
    assert fake.registered == {}


def test_collected_while_pinning_the_conductor_unpins_and_says_collected(fake: FakeRuntime) -> None:
    logs = Events()
    pool, conductor = enter_background(fake, logs)
    life = lifecycle_of(pool)
    with pytest.warns(UnclosedPoolWarning, match="unpinning what it pinned"):
        drive(life.finalize())  # the façade is gone; the conductor still runs
    assert life._orphaned and life.state is PoolState.PINNING
    conductor.join()
    assert life.state is PoolState.CLOSED and fake.registered == {}
    assert logs.of("pool.rollback") == ["collected"]


def test_collected_after_a_background_failure_unpins_in_the_finalizer_and_warns_of_the_unseen_error() -> None:
    fake = FakeRuntime(fail_register_on=3)
    pool, conductor = enter_background(fake)
    conductor.join()
    with pytest.warns(UnclosedPoolWarning) as warned:
        drive(lifecycle_of(pool).finalize())
    assert any("nobody saw why" in str(w.message) for w in warned)
    assert pool.state is PoolState.CLOSED and fake.registered == {}


def test_the_interpreter_exit_hook_stops_pinning_and_keeps_the_prefix_for_the_finalizer(fake: FakeRuntime) -> None:
    logs = Events()
    pool, conductor = enter_background(fake, logs)
    life = lifecycle_of(pool)
    conductor.stop()
    conductor.join()
    assert life.state is PoolState.PINNING and not life._conducting  # nothing unpinned under live threads
    assert logs.of("pool.rollback") == ["exit"] and logs.of("pool.rollback", "log_level") == ["info"]
    with pytest.warns(UnclosedPoolWarning):
        drive(life.finalize())  # atexit, once every thread is done
    assert life.state is PoolState.CLOSED and fake.registered == {}


def test_exit_after_a_failure_raced_by_exit_keeps_the_first_cause() -> None:
    fake = FakeRuntime(fail_register_on=2)
    pool, conductor = enter_background(fake)
    life = lifecycle_of(pool)
    assert life.session is not None
    conductor.join()  # the failure lands first...
    life.session.stop(StopCause.EXIT)  # ...an exit afterwards changes nothing
    assert life.session.ledger.stop_cause is StopCause.FAILURE
    with pytest.raises(PinError):
        drive(life.exit(None))


def test_a_conductor_that_cannot_start_rolls_back_at_entry(fake: FakeRuntime) -> None:
    pool = pool_of(fake, background=True)
    life = lifecycle_of(pool)

    class NeverRan:
        done = True

        def join(self) -> None:
            pass

    with pytest.raises(PinError, match="could not be started"):
        drive(life.enter(), report(Ran(start_errors=[RuntimeError("can't start new thread")], detached=NeverRan())))
    assert life.state is PoolState.CLOSED and fake.registered == {}


def test_a_forked_child_lets_go_without_touching_the_parents_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    for background in (False, True):
        fake = FakeRuntime()
        pool = pool_of(fake, background=background, name=f"fork-{background}")
        life = lifecycle_of(pool)
        drive(life.enter(), *([detach_into([])] if background else []))
        assert life.memory is not None
        address = life.memory.address
        parent = os.getpid()
        monkeypatch.setattr(os, "getpid", lambda parent=parent: parent + 1)
        assert drive(life.exit(None)) is None  # no wait for a conductor that does not exist here
        drive(life.finalize())
        monkeypatch.setattr(os, "getpid", lambda parent=parent: parent)
        assert life.state is PoolState.CLOSED and len(fake.registered) == (0 if background else 8)
        assert fake.unregister_calls == []
        # A real child's book of pinned ranges starts empty (tests/pool/test_fork.py): what is at the
        # address there is the child's own claim, which letting go must not pop.
        assert PINNED_RANGES.get(address) is not None
        PINNED_RANGES.pop(address)  # the parent's books, for this test's sake
        fake.registered.clear()


def test_a_background_pool_that_pins_everything_is_ready_and_waits_are_answered(fake: FakeRuntime) -> None:
    pool, conductor = enter_background(fake)
    life = lifecycle_of(pool)
    assert life.pinned_pages == 0 and not life.reached(1) and not life.reached(None)  # nothing pinned yet
    views = life.tensors
    conductor.join()
    assert life.state is PoolState.READY and life.tensors is views  # the body's views are kept, not remade
    assert life.reached(None) and life.reached(pool.num_pages) and life.pinned_pages == pool.num_pages
    assert drive(life.exit(None)) is None
    assert fake.registered == {} and life.pinned_pages == 0


def test_waiting_on_a_pool_that_is_new_or_was_exited_is_a_state_error(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))
    assert life.pinned_pages == 0
    with pytest.raises(PoolStateError, match="is new: enter it"):
        life.reached(None)
    drive(life.enter())
    drive(life.exit(None))
    with pytest.raises(PoolStateError, match="closed: it was exited before it was ready"):
        life.reached(1)


def test_background_views_that_raise_undo_the_pin_at_entry(fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    life = lifecycle_of(pool_of(fake, background=True))

    def views(_memory: Any) -> Any:
        raise MemoryError("views")

    def no_conductor(step: Step) -> Ran:
        assert not isinstance(step, Detach), "no conductor is started for a pool whose views failed"
        return inline(step)

    monkeypatch.setattr(life.source, "views", views)
    with pytest.raises(MemoryError, match="views"):
        drive(life.enter(), no_conductor)
    assert life.state is PoolState.CLOSED and fake.register_calls == [] and life.memory is None


def test_an_interrupt_while_the_conductor_starts_is_raised_after_the_rollback(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake, background=True))
    box: list[Conductor] = []

    def interrupted_in_thread_start(step: Step) -> Ran:
        ran = detach_into(box)(step)  # the thread started (it may run or not)...
        ran.interrupts.append(KeyboardInterrupt())  # ...and Ctrl-C landed in Thread.start
        return ran

    with pytest.raises(KeyboardInterrupt):
        drive(life.enter(), interrupted_in_thread_start)
    assert box[0].done  # stopped (pinning nothing: the stop came first) and waited for
    assert life.state is PoolState.CLOSED and fake.registered == {}


def test_an_entry_whose_memory_cannot_be_had_closes_and_a_forked_child_has_nothing_to_let_go(
    fake: FakeRuntime,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    life = lifecycle_of(pool_of(fake))

    def acquire() -> Any:
        raise OSError("mmap")

    monkeypatch.setattr(life.source, "acquire", acquire)
    with pytest.raises(OSError, match="mmap"):
        drive(life.enter())
    assert life.state is PoolState.CLOSED and life.session is None
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    assert drive(life.exit(None)) is None and life.state is PoolState.CLOSED


def on_another_thread(call: Callable[[], object]) -> object:
    """What ``call`` returned or raised, run on a thread of its own."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    assert out, "it did not return"
    return out[0]


def test_exit_while_another_thread_enters_is_refused(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))

    def exit_meanwhile(step: Step) -> Ran:
        refused = on_another_thread(lambda: drive(life.exit(None)))
        assert isinstance(refused, PoolStateError) and "being entered on another thread" in str(refused)
        return inline(step)

    drive(life.enter(), exit_meanwhile)
    assert life.state is PoolState.READY
    drive(life.exit(None))


def test_a_close_on_the_entering_thread_returns_at_once_and_the_entry_rolls_back_and_raises(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))
    returned: list[object] = []

    def close_meanwhile(step: Step) -> Ran:  # a signal handler's close() while this thread pins
        returned.append(drive(life.exit(None, closing=True)))
        return inline(step)

    with pytest.raises(PoolStateError, match="closed while it was being opened"):
        drive(life.enter(), close_meanwhile)
    assert returned == [None] and life.state is PoolState.CLOSED and fake.registered == {}


def test_a_second_exit_waits_for_the_first_and_an_interrupt_of_the_wait_is_raised(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))
    drive(life.enter())
    waiters: list[threading.Thread] = []
    returned: list[object] = []

    def teardown_raced(step: Step) -> Ran:
        assert life.state is PoolState.CLOSING
        # On this very thread (a signal handler) a close cannot wait for itself: it returns at once.
        assert drive(life.exit(None, closing=True)) is None and life.state is PoolState.CLOSING
        # The second close's wait is interrupted: raised, nothing undone.
        interrupted = on_another_thread(lambda: drive(life.exit(None), report(Ran(interrupts=[KeyboardInterrupt()]))))
        assert isinstance(interrupted, KeyboardInterrupt)
        # A second close on another thread waits until the first one closed the pool.
        waiter = threading.Thread(target=lambda: returned.append(drive(life.exit(None, closing=True))))
        waiter.start()
        waiters.append(waiter)
        return inline(step)

    assert drive(life.exit(None), teardown_raced) is None
    waiters[0].join(10)
    assert returned == [None] and life.state is PoolState.CLOSED and fake.registered == {}
    assert len(fake.unregister_calls) == 8  # unpinned once


def test_a_finalizer_warning_without_a_file_to_point_at_is_still_a_warning(fake: FakeRuntime) -> None:
    life = lifecycle_of(pool_of(fake))
    drive(life.enter())
    life.created_at = ("<stdin>", 1)  # made by `python -c` or a REPL
    with pytest.warns(UnclosedPoolWarning, match="in a finalizer"):
        drive(life.finalize())
    assert fake.registered == {}


def test_an_unseen_background_failure_raised_on_exit_carries_the_unpin_failure_as_a_note() -> None:
    fake = FakeRuntime(fail_register_on=3, fail_unregister_on=1)
    pool, conductor = enter_background(fake)
    conductor.join()  # chunks 0 and 1 pinned, the third call failed
    with pytest.raises(PinError, match="stay pinned") as raised:
        drive(lifecycle_of(pool).exit(None))
    assert any("failed to unregister" in note for note in raised.value.__notes__)
    assert pool.state is PoolState.CLOSED and len(fake.registered) == 1  # chunk 1 leaked (unpinned first)
    PINNED_RANGES.pop(next(iter(fake.registered)) - MiB)  # kept claimed: part may be pinned


# -- node pacing, scripted ----------------------------------------------------------------------------


def paced_pool(fake: FakeRuntime, tmp_path: Path, logs: Events, **kw: Any) -> pinpool.PinnedPool:
    options: dict[str, Any] = {"node_slots": 1, "node_budget": 64 * MiB, "node_dir": str(tmp_path / "node"), **kw}
    return pool_of(fake, logs, **options)


@pytest.mark.parametrize("budget", [64 * MiB, None])
def test_an_admitted_pool_holds_a_slot_while_it_pins_and_its_budget_until_closed(
    tmp_path: Path, budget: int | None
) -> None:
    fake, logs = FakeRuntime(), Events()
    life = lifecycle_of(paced_pool(fake, tmp_path, logs, node_budget=budget))
    drive(life.enter())
    assert sorted(logs.of("node.admitted", "kind")) == (["budget", "slot"] if budget else ["slot"])
    assert life.pacing.slot is None and (life.pacing.budget is not None) == bool(budget)  # let go once pinned
    drive(life.exit(None))
    assert life.pacing.budget is None and fake.registered == {}


def test_a_rollback_that_cannot_unregister_a_chunk_says_so_in_the_pin_error() -> None:
    fake = FakeRuntime(fail_register_on=4, fail_unregister_on=1)
    life = lifecycle_of(pool_of(fake))
    with pytest.raises(PinError, match=r"rolled back, 1 chunk\(s\) could not be unregistered") as raised:
        drive(life.enter())
    assert len(raised.value.leaked) == 1 and len(fake.registered) == 1 and life.state is PoolState.CLOSED
    PINNED_RANGES.pop(next(iter(fake.registered)) - 2 * MiB)  # chunk 2 leaked (unpinned first): kept claimed


def test_a_busy_node_an_interrupted_wait_and_no_thread_for_it_close_the_pool_with_nothing_pinned(
    tmp_path: Path,
) -> None:
    busy = NodeBusyError("every slot is taken", directory=str(tmp_path), kind="slots", limit=1, in_use=1)
    for ran, expected in (
        (Ran(started=1, crashed=[busy]), NodeBusyError),
        (Ran(started=1, interrupts=[KeyboardInterrupt()]), KeyboardInterrupt),
        (Ran(start_errors=[RuntimeError("can't start new thread")]), PinError),
    ):
        fake, logs = FakeRuntime(), Events()
        life = lifecycle_of(paced_pool(fake, tmp_path, logs))
        with pytest.raises(expected) as raised:
            drive(life.enter(), report(ran))
        assert life.state is PoolState.CLOSED and life.memory is None and fake.register_calls == []
        assert logs.of("node.busy", "kind") == (["slots"] if expected is NodeBusyError else [])
        if expected is PinError:
            assert "node-pacing wait could not start a thread" in str(raised.value)


@pytest.mark.parametrize("given_up", [True, False])
def test_a_background_conductor_whose_admission_ends_early_pins_nothing(tmp_path: Path, given_up: bool) -> None:
    fake, logs = FakeRuntime(), Events()
    pool, conductor = enter_background(fake, logs, node_slots=1, node_dir=str(tmp_path / "node"))
    life = lifecycle_of(pool)
    busy = NodeBusyError("every slot is taken", directory=str(tmp_path), kind="slots", limit=1, in_use=1)
    conductor.script = [report(Ran(started=1, crashed=[NodeWaitCancelled("exit") if given_up else busy]))]
    if given_up:  # exit gives up the wait (and joins the conductor): a normal shutdown, not a failure
        assert drive(life.exit(None)) is None
        assert conductor.done and logs.of("pool.rollback") == ["exit"]
    else:  # node_wait=False: the node was busy; kept as the pool's error until exit
        conductor.join()
        assert life.state is PoolState.FAILED and life.error is busy and logs.of("pool.rollback") == ["failure"]
        with pytest.raises(NodeBusyError):
            drive(life.exit(None))
    assert life.state is PoolState.CLOSED and fake.register_calls == []
