"""The pure `Ledger` state machine: pinning, rollback, teardown."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pinpool import Chunk, ChunkFailure, RuntimeCallError
from pinpool._errors import LedgerError
from pinpool._pin import ChunkState, Ledger, Phase, StopCause

SIZES = (100, 200, 300, 400, 500)  # distinct, so registered_bytes tells which chunks count


def make_chunks(sizes: tuple[int, ...] = SIZES) -> list[Chunk]:
    chunks, offset = [], 0
    for size in sizes:
        chunks.append(Chunk(offset, size))
        offset += size
    return chunks


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(make_chunks())


def error(op: str = "register", code: int = 12) -> RuntimeCallError:
    return RuntimeCallError(op=op, code=code, reason="ENOMEM", message="out of memory", ptr=0x1000, nbytes=100)


def register_all(ledger: Ledger) -> None:
    while (index := ledger.claim()) is not None:
        ledger.registered(index)


def pinned(sizes: tuple[int, ...] = SIZES) -> Ledger:
    ledger = Ledger(make_chunks(sizes))
    register_all(ledger)
    assert ledger.finish_pinning() is Phase.PINNED
    return ledger


# -- initial state and claiming -------------------------------------------------------------------------


def test_initial_state(ledger: Ledger) -> None:
    assert ledger.chunks == tuple(make_chunks())
    assert ledger.states == [ChunkState.PENDING] * 5
    assert ledger.phase is Phase.PINNING
    assert ledger.stop_cause is None
    assert ledger.failures == []
    assert ledger.in_flight == 0
    assert ledger.registered_bytes == 0
    assert ledger.chunks_done == 0
    assert ledger.leaked() == ()


def test_claim_hands_out_chunks_in_offset_order_then_none(ledger: Ledger) -> None:
    claimed = [ledger.claim() for _ in range(5)]
    assert claimed == [0, 1, 2, 3, 4]
    offsets = [ledger.chunks[i].offset for i in claimed]  # type: ignore[index]
    assert offsets == sorted(offsets)
    assert ledger.states == [ChunkState.IN_FLIGHT] * 5
    assert ledger.in_flight == 5
    assert ledger.claim() is None  # exhausted
    assert ledger.claim() is None
    assert ledger.stop_cause is None  # running out is not a stop cause
    assert ledger.in_flight == 5


def test_in_flight_counts_claims_minus_landings(ledger: Ledger) -> None:
    a, b, c = ledger.claim(), ledger.claim(), ledger.claim()
    assert (a, b, c) == (0, 1, 2)
    assert ledger.in_flight == 3
    ledger.registered(1)  # landing out of order is fine
    assert ledger.in_flight == 2
    ledger.failed(2, "register", error())
    assert ledger.in_flight == 1
    ledger.registered(0)
    assert ledger.in_flight == 0
    assert ledger.states[:3] == [ChunkState.REGISTERED, ChunkState.REGISTERED, ChunkState.FAILED]


def test_registered_bytes_and_chunks_done(ledger: Ledger) -> None:
    for expected_bytes, expected_done in [(100, 1), (300, 2), (600, 3)]:
        ledger.registered(ledger.claim())  # type: ignore[arg-type]
        assert ledger.registered_bytes == expected_bytes
        assert ledger.chunks_done == expected_done
    ledger.failed(ledger.claim(), "populate", error("populate"))  # type: ignore[arg-type]
    assert ledger.registered_bytes == 600  # a failed chunk registered nothing
    assert ledger.chunks_done == 3


# -- stopping ----------------------------------------------------------------------------------------


def test_failure_stops_claims_and_records_the_failure(ledger: Ledger) -> None:
    first, second = ledger.claim(), ledger.claim()
    err = error()
    ledger.failed(second, "register", err)  # type: ignore[arg-type]
    assert ledger.stop_cause is StopCause.FAILURE
    assert ledger.claim() is None
    assert ledger.claim() is None
    assert ledger.failures == [ChunkFailure(ledger.chunks[1], "register", err)]
    assert ledger.failures_in("register") == (ChunkFailure(ledger.chunks[1], "register", err),)
    assert ledger.failures_in("populate", "unregister") == ()
    # the chunk still in flight may land either way
    ledger.registered(first)  # type: ignore[arg-type]
    assert ledger.states[:3] == [ChunkState.REGISTERED, ChunkState.FAILED, ChunkState.PENDING]
    assert ledger.finish_pinning() is Phase.ROLLED_BACK


def test_cancel_stops_claims_but_in_flight_chunks_land(ledger: Ledger) -> None:
    index = ledger.claim()
    ledger.cancel()
    assert ledger.stop_cause is StopCause.CANCELLED
    assert ledger.claim() is None
    ledger.registered(index)  # type: ignore[arg-type]
    assert ledger.registered_bytes == 100
    assert ledger.finish_pinning() is Phase.ROLLED_BACK
    assert ledger.teardown_order() == [0]


def test_first_stop_cause_wins_failure_then_cancel(ledger: Ledger) -> None:
    ledger.failed(ledger.claim(), "populate", error("populate"))  # type: ignore[arg-type]
    ledger.cancel()
    assert ledger.stop_cause is StopCause.FAILURE


def test_first_stop_cause_wins_cancel_then_failure(ledger: Ledger) -> None:
    index = ledger.claim()
    ledger.cancel()
    ledger.failed(index, "register", error())  # type: ignore[arg-type]
    assert ledger.stop_cause is StopCause.CANCELLED
    assert len(ledger.failures) == 1  # still recorded


def test_failures_accumulate_in_landing_order(ledger: Ledger) -> None:
    a, b, c = ledger.claim(), ledger.claim(), ledger.claim()
    ledger.failed(c, "register", error(code=1))  # type: ignore[arg-type]
    ledger.failed(a, "populate", error("populate", code=2))  # type: ignore[arg-type]
    ledger.registered(b)  # type: ignore[arg-type]
    assert [(f.chunk.offset, f.phase, f.error.code) for f in ledger.failures] == [
        (300, "register", 1),
        (0, "populate", 2),
    ]
    assert [f.phase for f in ledger.failures_in("populate", "register")] == ["register", "populate"]


def test_cancel_after_finish_is_a_no_op() -> None:
    ledger = pinned()
    ledger.cancel()
    assert ledger.stop_cause is None
    assert ledger.phase is Phase.PINNED


# -- finish_pinning ----------------------------------------------------------------------------------


def test_finish_refuses_while_chunks_are_in_flight(ledger: Ledger) -> None:
    ledger.claim()
    ledger.claim()
    with pytest.raises(LedgerError, match="2 chunks still in flight"):
        ledger.finish_pinning()
    assert ledger.phase is Phase.PINNING
    # a failure does not release the in-flight rule either
    ledger.failed(0, "register", error())
    with pytest.raises(LedgerError, match="1 chunks still in flight"):
        ledger.finish_pinning()
    assert ledger.phase is Phase.PINNING
    ledger.registered(1)
    assert ledger.finish_pinning() is Phase.ROLLED_BACK


def test_finish_pinned_when_everything_registered(ledger: Ledger) -> None:
    register_all(ledger)
    assert ledger.finish_pinning() is Phase.PINNED
    assert ledger.phase is Phase.PINNED
    assert ledger.registered_bytes == sum(SIZES)
    assert ledger.chunks_done == 5


def test_cancel_after_everything_registered_still_rolls_back(ledger: Ledger) -> None:
    register_all(ledger)
    ledger.cancel()  # arrived after the last chunk landed, before the driver finished
    assert ledger.finish_pinning() is Phase.ROLLED_BACK
    assert ledger.teardown_order() == [4, 3, 2, 1, 0]


def test_finish_with_pending_chunks_is_rolled_back(ledger: Ledger) -> None:
    ledger.registered(ledger.claim())  # type: ignore[arg-type]
    assert ledger.finish_pinning() is Phase.ROLLED_BACK  # chunks 1..4 never registered
    assert ledger.teardown_order() == [0]


def test_finish_twice_raises(ledger: Ledger) -> None:
    register_all(ledger)
    ledger.finish_pinning()
    with pytest.raises(LedgerError, match="finish_pinning in phase pinned"):
        ledger.finish_pinning()


def test_claim_after_finish_returns_none() -> None:
    ledger = Ledger(make_chunks())
    ledger.registered(ledger.claim())  # type: ignore[arg-type]
    ledger.finish_pinning()
    assert ledger.claim() is None
    assert ledger.states[1] is ChunkState.PENDING


# -- teardown ---------------------------------------------------------------------------------------


def test_teardown_order_is_reverse_offset_of_registered_only(ledger: Ledger) -> None:
    for _ in range(4):
        ledger.claim()
    ledger.registered(0)
    ledger.failed(1, "register", error())
    ledger.registered(3)
    ledger.registered(2)
    assert ledger.finish_pinning() is Phase.ROLLED_BACK
    assert ledger.teardown_order() == [3, 2, 0]  # not 1 (failed) nor 4 (never claimed)


def test_teardown_while_pinning_raises(ledger: Ledger) -> None:
    register_all(ledger)
    with pytest.raises(LedgerError, match="finish_pinning first"):
        ledger.teardown_order()


def test_full_teardown_then_close() -> None:
    ledger = pinned()
    order = ledger.teardown_order()
    assert order == [4, 3, 2, 1, 0]
    remaining = sum(SIZES)
    for index in order:
        ledger.unregistered(index)
        remaining -= SIZES[index]
        assert ledger.registered_bytes == remaining
        assert index not in ledger.teardown_order()
    assert ledger.states == [ChunkState.UNREGISTERED] * 5
    assert ledger.teardown_order() == []
    ledger.close()
    assert ledger.phase is Phase.CLOSED
    assert ledger.leaked() == ()


def test_reference_three_chunks_teardown_twice() -> None:
    # limit 1 GiB, buffer 2 GiB + 17 B: bases base+2G, base+1G, base; the second teardown does nothing
    g = 1 << 30
    ledger = Ledger([Chunk(0, g), Chunk(g, g), Chunk(2 * g, 17)])
    register_all(ledger)
    ledger.finish_pinning()
    order = ledger.teardown_order()
    assert [ledger.chunks[i].offset for i in order] == [2 * g, g, 0]
    for index in order:
        ledger.unregistered(index)
    ledger.close()
    assert ledger.teardown_order() == []
    ledger.close()  # closing again is harmless
    assert ledger.phase is Phase.CLOSED


def test_reference_second_registration_fails_rolls_back_exactly_the_first() -> None:
    g = 1 << 30
    ledger = Ledger([Chunk(0, g), Chunk(g, g), Chunk(2 * g, 17)])
    ledger.registered(ledger.claim())  # type: ignore[arg-type]
    ledger.failed(ledger.claim(), "register", error())  # type: ignore[arg-type]
    assert ledger.claim() is None
    assert ledger.finish_pinning() is Phase.ROLLED_BACK
    assert ledger.teardown_order() == [0]
    assert ledger.failures[0].chunk.offset == 1073741824
    ledger.unregistered(0)
    ledger.close()
    assert ledger.states == [ChunkState.UNREGISTERED, ChunkState.FAILED, ChunkState.PENDING]


def test_unregister_failed_is_leaked() -> None:
    ledger = pinned()
    err = error("unregister", 713)
    ledger.unregistered(4)
    ledger.unregister_failed(3, err)
    ledger.unregistered(2)
    assert ledger.states[3] is ChunkState.LEAKED
    assert ledger.leaked() == (ledger.chunks[3],)
    assert ledger.failures_in("unregister") == (ChunkFailure(ledger.chunks[3], "unregister", err),)
    assert ledger.failures_in("register") == ()
    assert ledger.teardown_order() == [1, 0]  # a leaked chunk is not retried
    ledger.unregistered(1)
    ledger.unregistered(0)
    ledger.close()  # leaked chunks do not block close
    assert ledger.phase is Phase.CLOSED
    assert ledger.leaked() == (ledger.chunks[3],)
    # a leaked chunk may still be pinned, so it keeps counting (pool.pinned_bytes reports it)
    assert ledger.registered_bytes == SIZES[3]


def test_close_raises_while_anything_is_registered() -> None:
    ledger = pinned()
    ledger.unregistered(4)
    ledger.unregistered(2)
    with pytest.raises(LedgerError, match=r"close with chunks \[0, 1, 3\] still registered"):
        ledger.close()
    assert ledger.phase is Phase.PINNED
    assert ledger.teardown_order() == [3, 1, 0]


def test_close_while_pinning_raises(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="close while still pinning"):
        ledger.close()
    assert ledger.phase is Phase.PINNING


def test_close_after_rollback_with_nothing_registered() -> None:
    ledger = Ledger(make_chunks())
    ledger.failed(ledger.claim(), "register", error())  # type: ignore[arg-type]
    assert ledger.finish_pinning() is Phase.ROLLED_BACK
    assert ledger.teardown_order() == []
    ledger.close()
    assert ledger.phase is Phase.CLOSED


# -- disown ---------------------------------------------------------------------------------------


def test_disown_returns_registered_chunks_and_closes() -> None:
    ledger = Ledger(make_chunks())
    for _ in range(3):
        ledger.claim()
    ledger.registered(2)
    ledger.failed(1, "register", error())
    ledger.registered(0)
    ledger.finish_pinning()
    kept = ledger.disown()
    assert kept == (ledger.chunks[0], ledger.chunks[2])
    assert ledger.phase is Phase.CLOSED
    assert ledger.teardown_order() == []  # nothing left for this process to unregister
    assert ledger.states[0] is ChunkState.REGISTERED  # untouched: the registrations are the parent's
    with pytest.raises(LedgerError, match="unregister in phase closed"):
        ledger.unregistered(0)


def test_disown_while_pinning_raises(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="disown while still pinning"):
        ledger.disown()
    assert ledger.phase is Phase.PINNING


# -- illegal transitions ----------------------------------------------------------------------------


def test_landing_twice_raises(ledger: Ledger) -> None:
    index = ledger.claim()
    ledger.registered(index)  # type: ignore[arg-type]
    with pytest.raises(LedgerError, match="chunk 0 landed as registered but was registered"):
        ledger.registered(index)  # type: ignore[arg-type]
    with pytest.raises(LedgerError, match="chunk 0 landed as failed but was registered"):
        ledger.failed(index, "register", error())  # type: ignore[arg-type]
    assert ledger.registered_bytes == 100  # not counted twice
    assert ledger.in_flight == 0
    assert ledger.failures == []


def test_landing_a_failed_chunk_again_raises(ledger: Ledger) -> None:
    index = ledger.claim()
    ledger.failed(index, "register", error())  # type: ignore[arg-type]
    with pytest.raises(LedgerError, match="landed as registered but was failed"):
        ledger.registered(index)  # type: ignore[arg-type]
    assert ledger.registered_bytes == 0


def test_landing_an_unclaimed_chunk_raises(ledger: Ledger) -> None:
    with pytest.raises(LedgerError, match="chunk 3 landed as registered but was pending"):
        ledger.registered(3)
    assert ledger.in_flight == 0
    assert ledger.registered_bytes == 0


def test_unregistering_a_non_registered_chunk_raises() -> None:
    ledger = Ledger(make_chunks())
    for _ in range(3):
        ledger.claim()
    ledger.registered(0)
    ledger.registered(1)
    ledger.failed(2, "register", error())
    ledger.finish_pinning()
    with pytest.raises(LedgerError, match="chunk 2 unregistered but was failed"):
        ledger.unregistered(2)
    with pytest.raises(LedgerError, match="chunk 3 unregistered but was pending"):
        ledger.unregistered(3)
    ledger.unregistered(1)
    with pytest.raises(LedgerError, match="chunk 1 unregistered but was unregistered"):
        ledger.unregistered(1)
    assert ledger.registered_bytes == 100  # chunk 1 subtracted once
    ledger.unregister_failed(0, error("unregister"))
    with pytest.raises(LedgerError, match="chunk 0 unregistered but was leaked"):
        ledger.unregister_failed(0, error("unregister"))
    with pytest.raises(LedgerError, match="chunk 0 unregistered but was leaked"):
        ledger.unregistered(0)
    assert ledger.registered_bytes == 100  # chunk 0 leaked: still counted
    assert len(ledger.failures_in("unregister")) == 1


def test_unregister_while_pinning_raises(ledger: Ledger) -> None:
    index = ledger.claim()
    ledger.registered(index)  # type: ignore[arg-type]
    with pytest.raises(LedgerError, match="unregister in phase pinning"):
        ledger.unregistered(index)  # type: ignore[arg-type]
    with pytest.raises(LedgerError, match="unregister in phase pinning"):
        ledger.unregister_failed(index, error("unregister"))  # type: ignore[arg-type]
    assert ledger.states[0] is ChunkState.REGISTERED
    assert ledger.registered_bytes == 100


def test_ledger_error_is_a_runtime_error() -> None:
    assert issubclass(LedgerError, RuntimeError)


# -- random interleavings ------------------------------------------------------------------------------


@settings(deadline=None)
@given(
    sizes=st.lists(st.integers(1, 10_000), min_size=1, max_size=12).map(tuple),
    workers=st.integers(1, 4),
    data=st.data(),
)
def test_random_interleavings(sizes: tuple[int, ...], workers: int, data: st.DataObject) -> None:
    ledger = Ledger(make_chunks(sizes))
    busy: dict[int, int] = {}  # worker -> chunk index in flight
    claimed: list[int] = []
    cancelled = failed = False
    flakiness = data.draw(st.sampled_from([0, 1, 5]), label="failures in 10 landings")  # 0: a clean run can pin

    def check_invariants() -> None:
        states = ledger.states
        assert ledger.in_flight == len(busy) == states.count(ChunkState.IN_FLIGHT)
        assert sorted(busy.values()) == [i for i, s in enumerate(states) if s is ChunkState.IN_FLIGHT]
        maybe_pinned = (ChunkState.REGISTERED, ChunkState.LEAKED)
        assert ledger.registered_bytes == sum(
            c.nbytes for c, s in zip(ledger.chunks, states, strict=True) if s in maybe_pinned
        )
        assert ledger.chunks_done == states.count(ChunkState.REGISTERED)

    def land(worker: int) -> None:
        nonlocal failed
        index = busy.pop(worker)
        if data.draw(st.integers(0, 9), label=f"chunk {index} outcome") >= flakiness:
            ledger.registered(index)
        else:
            ledger.failed(index, data.draw(st.sampled_from(["populate", "register"])), error())
            failed = True
        check_invariants()

    def claim(worker: int) -> int | None:
        index = ledger.claim()
        if failed or cancelled or len(claimed) == len(sizes):
            assert index is None
        else:
            assert index == len(claimed)  # offset order, no chunk twice
            claimed.append(index)
            busy[worker] = index
        check_invariants()
        return index

    # A random prefix of interleaved claims, landings and cancellations ...
    steps = data.draw(st.lists(st.sampled_from(["claim", "land", "cancel"]), max_size=30), label="steps")
    for step in steps:
        worker = data.draw(st.integers(0, workers - 1), label="worker")
        if step == "cancel":
            ledger.cancel()
            cancelled = cancelled or not failed
            check_invariants()
        elif step == "claim" and worker not in busy:
            claim(worker)
        elif step == "land" and worker in busy:
            land(worker)

    if busy and data.draw(st.booleans(), label="finish too early"):
        with pytest.raises(LedgerError, match="still in flight"):
            ledger.finish_pinning()
        assert ledger.phase is Phase.PINNING

    # ... then the workers run to completion: each claims until the ledger says stop, and the
    # driver finishes only once every worker has returned.
    running = set(range(workers))
    while running:
        worker = data.draw(st.sampled_from(sorted(running)), label="next worker")
        if worker in busy:
            land(worker)
        elif claim(worker) is None:
            running.discard(worker)
    assert not busy
    assert ledger.claim() is None
    if data.draw(st.booleans(), label="cancel after the workers returned"):
        ledger.cancel()  # must still win over a complete pin, and must not displace a failure
        cancelled = cancelled or not failed
    expected_cause = StopCause.CANCELLED if cancelled else StopCause.FAILURE if failed else None
    assert ledger.stop_cause is expected_cause
    if expected_cause is None:
        assert claimed == list(range(len(sizes)))  # nothing stopped them: every chunk was handed out

    phase = ledger.finish_pinning()
    all_registered = all(s is ChunkState.REGISTERED for s in ledger.states)
    assert (phase is Phase.PINNED) == (all_registered and not failed and not cancelled)
    assert phase in (Phase.PINNED, Phase.ROLLED_BACK)
    assert ledger.phase is phase

    before = list(ledger.states)
    order = ledger.teardown_order()
    assert order == sorted((i for i, s in enumerate(before) if s is ChunkState.REGISTERED), reverse=True)
    offsets = [ledger.chunks[i].offset for i in order]
    assert all(a > b for a, b in pairwise(offsets))
    leaked = []
    for index in order:
        if data.draw(st.booleans(), label=f"unregister {index} ok"):
            ledger.unregistered(index)
        else:
            ledger.unregister_failed(index, error("unregister"))
            leaked.append(ledger.chunks[index])
        check_invariants()
    ledger.close()

    assert ChunkState.REGISTERED not in ledger.states
    for was, now in zip(before, ledger.states, strict=True):
        if was is ChunkState.REGISTERED:
            assert now in (ChunkState.UNREGISTERED, ChunkState.LEAKED)
        else:
            assert now is was  # teardown touches registered chunks only
    assert ledger.leaked() == tuple(sorted(leaked))
    assert len(ledger.failures_in("unregister")) == len(leaked)
    assert ledger.registered_bytes == sum(c.nbytes for c in leaked)  # only what may still be pinned
    assert ledger.teardown_order() == []
    assert ledger.phase is Phase.CLOSED
