"""Chunk options mean what they say, in foreground and background, with and without a stall budget.

``chunk_bytes=N``: every registration exactly N, the last one shorter; an ``"auto"`` budget
yields to it (``pool.pin.start`` says so), a numeric one with it is a ConfigError.
``max_chunk_bytes=N``: as few registrations as N and the alignment allow, never split for the
workers; an ``"auto"`` budget yields, a numeric one cuts further. Neither: the default, split
for the workers and cut by the budget. Registration sizes as the runtime saw them.
"""

from __future__ import annotations

from typing import Any

import pytest
import structlog

import pinpool
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import lifecycle_of

MiB = 1 << 20
SIZE = 68 * MiB  # 8 calls of 8 MiB and a short one of 4 MiB with chunk_bytes="8MiB"
PROBE = 16 * MiB  # the stall budget's first call, before any rate is known (pinpool._plan.calls.PROBE_BYTES)
CHUNKING: dict[str, dict[str, Any]] = {
    "chunk_bytes": {"chunk_bytes": "8MiB"},
    "max_chunk_bytes": {"max_chunk_bytes": "256GiB"},  # SGLang's limit
    "neither": {},
}


def pin_and_record(background: bool, budget: object, chunking: str) -> tuple[list[int], pinpool.PinnedPool, Any]:
    fake = FakeRuntime()
    events: list[dict[str, Any]] = []

    def keep(_logger: object, _method: str, event: dict[str, Any]) -> dict[str, Any]:
        events.append(dict(event))
        return event

    logger = structlog.wrap_logger(structlog.testing.CapturingLogger(), processors=[keep])
    pool = pinpool.PinnedPool(
        size=SIZE, runtime=fake, registry=None, populate=False, background=background, max_call_seconds=budget,
        register_workers=8, logger=logger, **CHUNKING[chunking],
    )  # fmt: skip
    with pool:
        pool.wait_ready_sync(timeout=60)
        calls = sorted(fake.register_calls)
        base = pool.data_ptr
    assert [ptr - base for ptr, _ in calls] == [sum(n for _, n in calls[:i]) for i in range(len(calls))]  # contiguous
    start = next(e for e in events if e["event"] == "pool.pin.start")
    return [nbytes for _, nbytes in calls], pool, start


@pytest.mark.parametrize("chunking", list(CHUNKING))
@pytest.mark.parametrize("budget", ["auto", 0.5, None])
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_registration_sizes_for_every_combination(background: bool, budget: object, chunking: str) -> None:
    effective = budget == 0.5 or (budget == "auto" and background)  # "auto": 50 ms for a background pool
    if chunking == "chunk_bytes" and budget == 0.5:
        with pytest.raises(pinpool.ConfigError, match=r"chunk_bytes=8388608 \(8 MiB\) makes every registration"):
            pin_and_record(background, budget, chunking)
        return
    sizes, pool, start = pin_and_record(background, budget, chunking)
    assert sum(sizes) == SIZE and pool.stats.retries == 0
    if chunking == "chunk_bytes":
        assert sizes == [8 * MiB] * 8 + [4 * MiB] and len(pool.plan.chunks) == 9  # exact, the budget or not
    elif effective and not (budget == "auto" and chunking == "max_chunk_bytes"):
        assert sizes[0] == PROBE and len(sizes) > 1  # the budget cuts the one planned chunk as it goes
        assert len(pool.plan.chunks) == 1
    else:
        assert sizes == [SIZE] and len(pool.plan.chunks) == 1  # one call, as SGLang makes, 8 workers or not
    yields = "chunk_bytes" if chunking == "chunk_bytes" else "max_chunk_bytes" if chunking != "neither" else None
    expected = yields if budget == "auto" and background else None
    assert start["budget_yields_to"] == expected and lifecycle_of(pool).options.budget_yields_to == expected
    assert pool._plan.registrations_reason.startswith(f"{len(pool.plan.chunks)} registration")


def test_max_chunk_bytes_alone_makes_as_few_calls_as_the_limit_allows_with_many_workers(fake: FakeRuntime) -> None:
    """A 1.1 GB pool under SGLang's 256 GiB limit was 2 registrations "for the workers"; now 1.
    The default still splits for throughput, and says so."""
    pool = pinpool.PinnedPool(size=1_100_000_000, runtime=fake, registry=None, populate=False,
                              max_chunk_bytes="256GiB", register_workers=8)  # fmt: skip
    with pool:
        assert [n for _, n in fake.register_calls] == [pool.nbytes]
    default = pinpool.PinnedPool(size=8 << 30, runtime=FakeRuntime(), registry=None, populate=False,
                                 register_workers=8)  # fmt: skip
    assert len(default.plan.chunks) == 8 and "split to 1 GiB so 8 workers" in default._plan.registrations_reason


def test_a_retry_under_chunk_bytes_is_a_failure_not_a_plan() -> None:
    """chunk_bytes is the plan; a failed call's halves still come (a failure, not a plan)."""
    fake = FakeRuntime(fail_register_larger_than="4MiB")
    with pinpool.PinnedPool(size=16 * MiB, chunk_bytes="8MiB", runtime=fake, registry=None, populate=False,
                            register_workers=1) as pool:  # fmt: skip
        assert [n for _, n in fake.register_calls] == [8 * MiB, 4 * MiB, 4 * MiB] * 2
        assert len(pool.plan.chunks) == 2 and pool.stats.retries == 2


def _locked_kib() -> int:
    return locked_bytes() // 1024


def test_a_real_mlock_background_pool_registers_exact_chunks() -> None:
    """mlock, in the background with its "auto" budget: chunk_bytes gives exact locks, really held."""
    before = _locked_kib()
    seen: list[int] = []
    pool = pinpool.PinnedPool(size=36 * MiB, chunk_bytes="8MiB", runtime="mlock", registry=None, background=True)
    runtime = pool.runtime
    lock = runtime.lock_on_fault if pool.plan.order.value == "register_first" else runtime.register

    def recording(ptr: int, nbytes: int, call: Any = lock) -> None:
        seen.append(nbytes)
        call(ptr, nbytes)

    if pool.plan.order.value == "register_first":
        runtime.lock_on_fault = recording  # type: ignore[method-assign]
    else:
        runtime.register = recording  # type: ignore[method-assign]
    with pool:
        pool.wait_ready_sync(timeout=60)
        assert sorted(seen) == [4 * MiB] + [8 * MiB] * 4
        assert _locked_kib() - before >= 36 * 1024
        assert lifecycle_of(pool).options.budget_yields_to == "chunk_bytes"
    assert _locked_kib() == before
