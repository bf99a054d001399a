"""The engine alone: one PinSession over a pool's plan, its workers run on this thread.

No lifecycle and no driver: each test builds the session the lifecycle would build (from the
plan and the options, whole), runs a pinning worker and the unpin workers by hand, and reads the
books, the fake runtime's calls and what came back. The paths here are the engine's own: calls
paced by the stall budget and stopped between them, a scheduling bug, the books disagreeing
with "every worker is done", a forked child, an unpin worker interrupted mid-batch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import pinpool
from pinpool._pin import ChunkState, Phase, PinSession, StopCause
from pinpool.testing import FakeRuntime

from ..conftest import lifecycle_of

MiB = 1 << 20


class Where:
    """The memory a session pins: the engine only needs its address (the fake touches nothing)."""

    address = 1 << 40


def session_of(fake: FakeRuntime, **options: Any) -> PinSession:
    return session_for(pinpool.PinnedPool(runtime=fake, registry=None, **options))


def session_for(pool: pinpool.PinnedPool) -> PinSession:
    """A session built from a pool's plan and options whole, as its lifecycle builds one."""
    return PinSession(
        lifecycle_of(pool).plan,
        lifecycle_of(pool).options,
        runtime=pool._runtime,
        caps=pool._caps,
        observer=pool._observer,
        memory=Where(),
    )


def pin(session: PinSession) -> Phase:
    """One pinning worker, on this thread, until the pipeline has nothing left for it."""
    session.go()
    session.work()
    return session.finish_pinning()


def unpin(session: PinSession) -> tuple[pinpool.ChunkFailure, ...]:
    for body in session.begin_teardown():
        body()
    return session.end_teardown()


def stop_after(session: list[PinSession], op: str, calls: int) -> Any:
    """A before_call hook that cancels the session once ``calls`` calls of ``op`` have returned."""
    seen = [0]

    def hook(called: str, _ptr: int, _nbytes: int) -> None:
        if called == op:
            seen[0] += 1
            if seen[0] == calls + 1:
                session[0].cancel()  # lands between two calls: this one still runs

    return hook


# One 256 MiB chunk and span: under a 20 ms budget it takes at least three calls (the sizer's
# 16 MiB probe, then at most 4x the last one: 64 MiB, then the 176 MiB left, at the fastest).
PACED: dict[str, Any] = {
    "size": 256 * MiB, "max_chunk_bytes": 256 * MiB, "populate_workers": 1, "register_workers": 1,
    "max_call_seconds": 0.02,
}  # fmt: skip


def test_a_paced_span_lands_its_progress_then_its_failure() -> None:
    fake = FakeRuntime(fail_populate_on=2)
    session = session_of(fake, **PACED)
    assert session.pipeline.spans[0].nbytes == 256 * MiB
    assert pin(session) is Phase.ROLLED_BACK
    assert len(fake.populate_calls) == 2 and fake.populate_calls[0][1] == 16 * MiB  # the probe, then the failure
    (failure,) = session.ledger.failures
    assert failure.phase == "populate" and "injected" in failure.error.message
    assert fake.register_calls == [] and session.pipeline.in_flight == 0


@pytest.mark.parametrize("lock_on_fault", [False, True])
def test_a_paced_span_stops_between_its_calls(lock_on_fault: bool) -> None:
    box: list[PinSession] = []
    fake = FakeRuntime(lock_on_fault=lock_on_fault, before_call=stop_after(box, "populate", 1))
    box.append(session_of(fake, **PACED))
    session = box[0]
    assert pin(session) is Phase.ROLLED_BACK
    assert len(fake.populate_calls) == 2 and session.ledger.failures == []  # the call under way ends
    assert session.ledger.stop_cause is StopCause.CANCELLED
    # Lock-on-fault: the chunk is registered (and its first part locked): the rollback undoes it.
    assert session.ledger.teardown_order() == ([0] if lock_on_fault else [])
    assert unpin(session) == () and fake.registered == {}


def test_a_paced_span_under_lock_on_fault_counts_each_part_as_it_is_locked() -> None:
    seen: list[int] = []
    box: list[PinSession] = []

    def before(op: str, _ptr: int, _nbytes: int) -> None:
        if op == "populate":
            seen.append(box[0].ledger.pinned_bytes)

    fake = FakeRuntime(lock_on_fault=True, before_call=before)
    box.append(session_of(fake, **PACED))
    session = box[0]
    assert pin(session) is Phase.PINNED
    assert len(seen) >= 3 and seen[:2] == [0, 16 * MiB] and seen == sorted(set(seen))  # part by part, as locked
    assert session.ledger.pinned_bytes == 256 * MiB and session.prefix.pages == session.prefix.num_pages
    assert unpin(session) == () and fake.registered == {}


def test_a_chunk_stopped_between_its_pieces_is_undone_piece_by_piece() -> None:
    box: list[PinSession] = []
    fake = FakeRuntime(before_call=stop_after(box, "register", 2))
    box.append(session_of(fake, size=1 << 30, max_chunk_bytes=1 << 30, populate=False, max_call_seconds=0.02))
    session = box[0]
    assert len(session.ledger.chunks) == 1
    assert pin(session) is Phase.ROLLED_BACK
    calls = [n for _, n in fake.register_calls]  # 16 MiB, then at most 4x the last: never the whole GiB
    assert len(calls) == 3 and calls[0] == 16 * MiB and sum(calls) < 1 << 30  # the third was under way
    assert session.ledger.states == [ChunkState.FAULTING] and session.ledger.failures == []
    assert len(session.ledger.pieces[0]) == 3 and len(session.registrations()) == 3
    assert unpin(session) == ()
    assert fake.registered == {} and fake.unregister_calls == sorted((p for p, _ in fake.register_calls), reverse=True)


def test_a_scheduling_bug_stops_every_worker_and_is_raised(fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    session = session_of(fake, size=4 * MiB, chunk_bytes=MiB, populate=False)

    def next_work() -> Any:
        raise RuntimeError("scheduling bug")

    monkeypatch.setattr(session.pipeline, "next_work", next_work)
    session.go()
    with pytest.raises(RuntimeError, match="scheduling bug"):
        session.work()
    assert session.ledger.stop_cause is StopCause.CANCELLED  # the others would not sleep forever
    assert session.finish_pinning() is Phase.ROLLED_BACK and fake.register_calls == []


def test_books_that_disagree_with_every_worker_done_are_rolled_back(fake: FakeRuntime) -> None:
    session = session_of(fake, size=4 * MiB, chunk_bytes=MiB, populate=False)
    with session.lock:
        batch = session.pipeline.next_work()  # handed out, and the worker that took it died
    assert batch is not None and session.pipeline.in_flight > 0
    assert session.finish_pinning() is Phase.ROLLED_BACK
    assert session.ledger.stop_cause is StopCause.FAILURE
    assert {session.ledger.states[i] for i in batch.items} == {ChunkState.FAILED}  # type: ignore[union-attr,index]
    assert unpin(session) == () and fake.unregister_calls == []


def test_a_forked_child_neither_lists_nor_unregisters_the_parents_registrations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeRuntime()
    session = session_of(fake, size=4 * MiB, chunk_bytes=MiB, populate=False)
    assert pin(session) is Phase.PINNED and len(session.registrations()) == 4
    parent = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: parent + 1)
    assert session.registrations() == ()
    assert session.begin_teardown() == () and session.ledger.phase is Phase.CLOSED
    assert fake.unregister_calls == [] and len(fake.registered) == 4  # the parent's, untouched


def test_teardown_is_idempotent_and_a_crashed_unpin_worker_leaks_loudly() -> None:
    fake = FakeRuntime()
    session = session_of(fake, size=4 * MiB, chunk_bytes=MiB, populate=False)
    assert pin(session) is Phase.PINNED
    bodies = session.begin_teardown()
    assert bodies  # never run: the unpin workers "crashed" before reaching any chunk
    failures = session.end_teardown(crashed=(RuntimeError("unpin worker bug"),))
    assert len(failures) == 4 and {f.phase for f in failures} == {"unregister"}
    assert all("never unregistered: an unpin worker crashed" in f.error.message for f in failures)
    assert len(session.ledger.leaked()) == 4
    # Closed: nothing more to unregister; a teardown resumed after its books closed (something raised
    # before the pool did) gets the same failures again, so the pool still reports them.
    assert session.begin_teardown() == () and session.end_teardown() == failures


def test_an_unpin_worker_interrupted_mid_batch_queues_its_chunks_again(
    fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    session = session_of(fake, size=8 * MiB, chunk_bytes=MiB, populate=False, unpin_workers=1)
    assert pin(session) is Phase.PINNED
    real = session.observer.call_started
    calls = [0]

    def interrupted_once() -> None:
        calls[0] += 1
        if calls[0] == 3:  # Ctrl-C on the inline runner's thread, before the third unregister call
            raise KeyboardInterrupt
        real()

    monkeypatch.setattr(session.observer, "call_started", interrupted_once)
    (body,) = session.begin_teardown()
    with pytest.raises(KeyboardInterrupt):
        body()
    assert len(fake.unregister_calls) == 2 and len(fake.registered) == 6
    body()  # the inline runner runs it again: the rest of the queue, the interrupted chunk included
    assert session.end_teardown() == ()
    assert fake.registered == {} and len(fake.unregister_calls) == len(set(fake.unregister_calls)) == 8


def test_the_pipeline_walks_the_plans_spans_computed_once() -> None:
    pool = pinpool.PinnedPool(runtime=FakeRuntime(), registry=None, size=64 * MiB, chunk_bytes=16 * MiB, populate=True)
    session = session_for(pool)
    assert len(pool._plan.spans) > 1
    assert session.pipeline.spans is pool._plan.spans  # cut once, in planning; not again by the pipeline
    assert pin(session) is Phase.PINNED


@pytest.mark.parametrize("driver", ["sync", "asyncio", "trio"])
def test_a_second_interrupt_inside_the_stop_is_recorded_and_the_stop_asked_again(driver: str) -> None:
    """A second Ctrl-C landing inside on_interrupt (seen under trio, while the first one stopped
    the workers: the stop's lock was left held and the KeyboardInterrupt left the driver with
    chunks registered) is one more recorded interruption; the stop is asked again and the wait
    goes on until every thread is done."""
    import threading

    import anyio

    from pinpool._pin import RunThreads, run_async, run_sync

    stopped, asked, ticks = threading.Event(), [], []

    def body() -> None:
        assert stopped.wait(30), "never stopped"

    def on_interrupt() -> None:
        asked.append(1)
        if len(asked) == 1:
            raise KeyboardInterrupt("the second Ctrl-C, inside the stop")
        stopped.set()

    def on_tick() -> None:  # the first interruption: on_tick raising counts as one
        ticks.append(1)
        if len(ticks) == 1:
            raise KeyboardInterrupt("the first Ctrl-C")

    step = RunThreads(bodies=(body,), name="t", interruptible=True, on_interrupt=on_interrupt, on_tick=on_tick)
    if driver == "sync":
        ran = run_sync(step)
    else:

        async def main() -> object:
            return await run_async(step)

        ran = anyio.run(main, backend=driver)  # type: ignore[assignment]
    assert [str(e) for e in ran.interrupts] == ["the first Ctrl-C", "the second Ctrl-C, inside the stop"]
    assert len(asked) == 2 and stopped.is_set() and ran.started == 1 and not ran.crashed
