"""The transfer books, pure: a registration is handed out once its chunks are pinned, a page is usable where
every registrar holds it, and teardown undoes every registrar's registrations in reverse offset order."""

from __future__ import annotations

import pytest

from pinpool import RuntimeCallError
from pinpool._errors import LedgerError
from pinpool._pin import RunState, TransferLedger
from pinpool._plan import Chunk, ChunkTable, PageRun, PrefixTracker, plan_transfer
from pinpool.registrars import RegistrarLimits

KiB = 1 << 10
CHUNKS = ChunkTable([(0, 4 * KiB, 8)])  # 32 KiB in 8 chunks
ERROR = RuntimeCallError(op="register", code=5, reason="Injected", message="x", ptr=0, nbytes=1)


def books(*limits: RegistrarLimits, prefix: PrefixTracker | None = None) -> TransferLedger:
    return TransferLedger([plan_transfer(f"r{k}", lim, CHUNKS, 4096) for k, lim in enumerate(limits)], prefix)


def test_a_registration_is_handed_out_once_every_chunk_it_spans_is_pinned() -> None:
    ledger = books(RegistrarLimits(preferred_bytes=8 * KiB))  # registrations of 2 chunks
    assert ledger.claim() is None
    ledger.chunk_pinned(CHUNKS[1])
    assert ledger.claim() is None
    ledger.chunk_pinned(CHUNKS[0])
    assert ledger.claim() == (0, 0) and ledger.claim() is None and ledger.in_flight == 1
    ledger.registered((0, 0), "h")
    assert ledger.live(0) == [(Chunk(0, 8 * KiB), "h")] and ledger.left == 3 and not ledger.complete


def test_a_serial_registrar_gets_one_call_at_a_time() -> None:
    ledger = books(RegistrarLimits(parallel=False), RegistrarLimits())
    for chunk in CHUNKS[:2]:
        ledger.chunk_pinned(chunk)
    claimed = [ledger.claim() for _ in range(4)]
    assert claimed == [(0, 0), (1, 0), (1, 1), None]  # registrar 0's second waits for its first
    ledger.registered((0, 0), None)
    assert ledger.claim() == (0, 1)


def test_pages_are_usable_only_where_every_registrar_holds_them() -> None:
    prefix = PrefixTracker([PageRun(0, 32 * KiB, 4 * KiB)], 8)
    ledger = books(RegistrarLimits(preferred_bytes=16 * KiB), RegistrarLimits(), prefix=prefix)
    for chunk in CHUNKS[:4]:
        ledger.chunk_pinned(chunk)
    items = [ledger.claim() for _ in range(5)]
    assert sorted(items) == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]  # type: ignore[type-var]
    for item in items:
        if item != (0, 0):
            ledger.registered(item, None)  # type: ignore[arg-type]
    assert prefix.pages == 0  # registrar 0 holds nothing yet
    ledger.registered((0, 0), None)
    assert prefix.pages == 4


def test_failures_and_teardown_in_reverse_offset_order_across_registrars() -> None:
    ledger = books(RegistrarLimits(preferred_bytes=16 * KiB), RegistrarLimits(preferred_bytes=8 * KiB))
    for chunk in CHUNKS:
        ledger.chunk_pinned(chunk)
    while (item := ledger.claim()) is not None:
        if item == (1, 3):
            failure = ledger.failed(item, ERROR, maybe=True)
            assert failure.registrar == "r1" and failure.call == "r1 register"
        elif item == (1, 2):
            ledger.failed(item, ERROR, maybe=False)
        else:
            ledger.registered(item, item)
    order = ledger.teardown_order()
    offsets = [ledger.run(item).offset for item in order]
    assert offsets == sorted(offsets, reverse=True) and (1, 3) in order and (1, 2) not in order
    assert ledger.states[1][3] is RunState.MAYBE
    with pytest.raises(LedgerError, match="still registered"):
        ledger.close()
    first, *rest = order
    leaked = ledger.unregister_failed(first, ERROR)
    assert leaked.phase == "unregister" and ledger.leaked() == (ledger.run(first),)
    for item in rest:
        ledger.unregistered(item)
    ledger.close()
    assert ledger.teardown_order() == [] and ledger.closed


def test_abort_books_calls_in_flight_as_maybe_registered() -> None:
    ledger = books(RegistrarLimits())
    ledger.chunk_pinned(CHUNKS[0])
    item = ledger.claim()
    assert item is not None
    ledger.abort()
    assert ledger.in_flight == 0 and ledger.teardown_order() == [item]
    with pytest.raises(LedgerError):
        ledger.registered(item, None)  # it is no longer in flight


def test_a_serial_registrar_is_undone_by_one_worker_at_a_time() -> None:
    ledger = books(RegistrarLimits(parallel=False))
    assert ledger.may_undo((0, 0))
    ledger.undoing[0] += 1
    assert not ledger.may_undo((0, 1)) and ledger.may_undo((0, 1), frozenset({0})) and ledger.unpinning
