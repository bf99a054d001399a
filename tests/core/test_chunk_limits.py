"""Chunk limits: ``max_chunk_bytes=`` (an upper bound, like SGLang's 256 GiB and vLLM's 64 GiB
settings) beside ``chunk_bytes=`` (the exact size), and ``chunk_bytes="buffer"`` (one
registration per buffer, never cut: ROCm kernels address a pool from one base per
registration). Plans over hand-made host facts, and pools on the fake runtime."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pinpool
from pinpool import ConfigError, layouts
from pinpool._plan import CHUNK_ENV, Chunk, PoolOptions, Schedule, plan_pool, retry_splitter
from pinpool._types import Capabilities
from pinpool.testing import FakeRuntime, host_facts

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

HOST = host_facts()
CUDA_LIKE = Capabilities(serial_registration=True, exact_ranges=True, retryable_codes=frozenset({2}))
# Two buffers of different sizes: K (head_dim 16) and V (v_head_dim 8), page_first.
TWO_BUFFERS = layouts.MHA("page_first", 2, 4, 2, 16, torch.float16, v_head_dim=8)


def plan(**kwargs: Any) -> Schedule:
    return plan_pool(PoolOptions.create(**kwargs), HOST, CUDA_LIKE)


def sizes(chunks: Iterable[Chunk]) -> list[int]:
    return [c.nbytes for c in chunks]


# -- max_chunk_bytes: an upper bound ---------------------------------------------------------------------------


def test_max_chunk_bytes_is_rounded_down_to_the_granularity() -> None:
    """SGLang's worked example with the limit given as the upper bound: 900 + 900 + 700 MiB."""
    p = plan(layout=layouts.Raw(granularity_bytes=300 * MiB), size=2500 * MiB, max_chunk_bytes="1GiB",
             register_workers=1, populate=False)  # fmt: skip
    assert sizes(p.chunks) == [900 * MiB, 900 * MiB, 700 * MiB]
    assert p.chunk_limit == GiB and p.chunk_bytes == 900 * MiB


def test_explicit_chunk_options_are_never_split_for_the_workers_the_default_is() -> None:
    """max_chunk_bytes= alone: as few calls as the limit allows, whatever the workers; chunk_bytes=
    exact; only the default limit is split so the workers have chunks to share."""
    bounded = plan(size=64 * GiB, max_chunk_bytes="16GiB", register_workers=8, populate=False)
    assert sizes(bounded.chunks) == [16 * GiB] * 4 and len(bounded.chunks) == 4
    assert "max_chunk_bytes=16 GiB: as few calls" in bounded.registrations_reason
    exact = plan(size=64 * GiB, chunk_bytes="16GiB", register_workers=8, populate=False)
    assert sizes(exact.chunks) == [16 * GiB] * 4
    default = plan(size=64 * GiB, register_workers=8, populate=False)
    assert set(sizes(default.chunks)) == {2 * GiB} and len(default.chunks) == 32
    assert default.registrations_reason == (
        "32 registrations: the default limit 256 GiB split to 2 GiB so 8 workers get 4 chunks each "
        "(give max_chunk_bytes= for fewer calls)"
    )


def test_sglang_limit_makes_one_registration_of_a_buffer_under_it() -> None:
    """SGLang's count: max_chunk_bytes=256GiB over a 1.1 GB buffer is one call, with 8 workers too."""
    p = plan(size=1_100_000_000, max_chunk_bytes="256GiB", register_workers=8, populate_workers=8)
    assert sizes(p.chunks) == [1_100_000_000] and len(p.chunks) == 1
    assert p.registrations_reason.startswith("1 registration: max_chunk_bytes=256 GiB")


def test_max_chunk_bytes_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, "0.25")
    assert PoolOptions.create(size=GiB).chunk_limit == 256 * MiB
    assert PoolOptions.create(size=GiB, max_chunk_bytes="512MiB").chunk_limit == 512 * MiB
    assert PoolOptions.create(size=GiB, chunk_bytes="1GiB", max_chunk_bytes="1GiB").chunk_limit == GiB


def test_chunk_bytes_must_not_exceed_max_chunk_bytes() -> None:
    options = PoolOptions.create(size=GiB, chunk_bytes="256MiB", max_chunk_bytes="1GiB")
    assert (options.chunk_bytes, options.chunk_limit, options.max_chunk_bytes) == (256 * MiB, 256 * MiB, GiB)
    with pytest.raises(ConfigError, match=r"chunk_bytes=2147483648 \(2 GiB\) is more than max_chunk_bytes=1073741824"):
        PoolOptions.create(size=GiB, chunk_bytes="2GiB", max_chunk_bytes="1GiB")
    with pytest.raises(ConfigError, match="is more than max_chunk_bytes"):
        PoolOptions(size=GiB, chunk_bytes=2 * GiB, max_chunk_bytes=GiB)


@pytest.mark.parametrize(("value", "match"), [("abc", "max_chunk_bytes='abc' is not a size"),
                                              (0, "max_chunk_bytes=0 is not positive"),
                                              (True, "max_chunk_bytes=True is a bool")])  # fmt: skip
def test_bad_max_chunk_bytes(fake: FakeRuntime, value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        pinpool.PinnedPool(size=MiB, runtime=fake, registry=None, max_chunk_bytes=value)  # type: ignore[arg-type]


def test_a_granularity_over_max_chunk_bytes_names_it() -> None:
    with pytest.raises(ConfigError, match="or max_chunk_bytes= where that sets the limit"):
        plan(layout=layouts.Raw(granularity_bytes=3 * MiB), size=16 * MiB, max_chunk_bytes="1MiB")


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(1, 1 << 36),
    bound=st.integers(1 << 12, 1 << 34),
    granularity=st.none() | st.integers(1, 1 << 22),
    workers=st.integers(1, 16),
)
def test_max_chunk_bytes_bounds_every_chunk(size: int, bound: int, granularity: int | None, workers: int) -> None:
    try:
        p = plan(layout=layouts.Raw(granularity_bytes=granularity), size=size, max_chunk_bytes=bound,
                 register_workers=workers, populate=False)  # fmt: skip
    except ConfigError:
        return  # one aligned unit does not fit under the bound (or a page of the layout above the size)
    assert p.chunk_limit == bound
    assert p.chunk_bytes <= bound and p.chunks.nbytes == size
    for run_offset, run_bytes, _count in p.chunks.runs:
        assert run_bytes <= bound
        if granularity is not None:
            assert run_offset % granularity == 0


# -- chunk_bytes="buffer": one registration per buffer -----------------------------------------------------------


def test_one_registration_per_buffer() -> None:
    p = plan(layout=TWO_BUFFERS, size=64 * MiB, chunk_bytes="buffer", register_workers=8)
    buffers = p.buffers
    assert len(buffers) == 2 and buffers[0].spec.nbytes != buffers[1].spec.nbytes
    assert list(p.chunks) == [Chunk(b.offset, b.spec.nbytes) for b in buffers]
    assert p.chunk_limit == max(b.spec.nbytes for b in buffers)
    # Never cut: no retry halves, no stall-budget pieces.
    cutter = retry_splitter(p, 4096)
    for chunk in p.chunks:
        assert cutter.split(chunk) is None and cutter.first_piece(chunk, 4096) == chunk


def test_one_registration_per_buffer_holds_a_large_buffer_whole() -> None:
    """Beyond the environment's limit and the split for workers: the buffer is the call."""
    p = plan(size=512 * GiB, chunk_bytes="buffer", register_workers=8, populate_workers=16)
    assert sizes(p.chunks) == [512 * GiB] and p.chunk_limit == 512 * GiB


def test_one_registration_per_buffer_within_max_chunk_bytes() -> None:
    p = plan(layout=TWO_BUFFERS, size=64 * MiB, chunk_bytes="buffer", max_chunk_bytes="1GiB")
    assert len(p.chunks) == 2 and p.chunk_limit == GiB
    with pytest.raises(ConfigError, match=r"buffer 'data' holds 4194304 B = 4 MiB, more than max_chunk_bytes="):
        plan(size=4 * MiB, chunk_bytes="buffer", max_chunk_bytes="1MiB")


def test_one_registration_per_buffer_has_no_stall_budget() -> None:
    with pytest.raises(ConfigError, match="one registration per buffer cannot be cut to fit a stall budget"):
        PoolOptions.create(size=MiB, chunk_bytes="buffer", max_call_seconds=0.02)
    with pytest.raises(ConfigError, match="cannot be cut to fit a stall budget"):
        PoolOptions(size=MiB, per_buffer=True, max_call_seconds=0.02)
    background = PoolOptions.create(size=MiB, chunk_bytes="buffer", background=True)
    assert background.max_call_seconds is None and background.per_buffer  # "auto" gives it none
    assert PoolOptions.create(size=MiB, background=True).max_call_seconds == 0.05
    assert PoolOptions.create(size=MiB, chunk_bytes="buffer", max_call_seconds=None).chunk_bytes is None


def test_per_buffer_is_its_own_field_in_pool_options() -> None:
    with pytest.raises(ConfigError, match="PoolOptions takes bytes"):
        PoolOptions(size=MiB, chunk_bytes="buffer")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="has no chunk size"):
        PoolOptions(size=MiB, chunk_bytes=MiB, per_buffer=True)
    options = dataclasses.replace(PoolOptions(size=8 * MiB), per_buffer=True)
    assert sizes(plan_pool(options, HOST, CUDA_LIKE).chunks) == [8 * MiB]


def test_a_per_buffer_pool_makes_one_call_per_buffer_even_in_the_background() -> None:
    fake = FakeRuntime(register_delay=0.01)
    pool = pinpool.PinnedPool(layout=TWO_BUFFERS, size=64 * MiB, runtime=fake, registry=None, chunk_bytes="buffer",
                              background=True, register_workers=4)  # fmt: skip
    with pool:
        pool.wait_ready_sync(timeout=60)
        assert len(fake.registered) == 2
    assert [n for _ptr, n in fake.register_calls] == [b.spec.nbytes for b in pool._plan.buffers]


def test_a_failed_per_buffer_registration_is_not_halved() -> None:
    fake = FakeRuntime(fail_register_larger_than="4MiB")  # retryable (code 2), and halves would fit
    pool = pinpool.PinnedPool(size=16 * MiB, runtime=fake, registry=None, chunk_bytes="buffer", populate=False)
    with pytest.raises(pinpool.PinError), pool:
        pass
    assert fake.register_calls == [(fake.register_calls[0][0], 16 * MiB)] and fake.registered == {}
    chunked = pinpool.PinnedPool(size=16 * MiB, runtime=FakeRuntime(fail_register_larger_than="4MiB"), registry=None,
                                 chunk_bytes="16MiB", min_chunk_bytes="1MiB", populate=False)  # fmt: skip
    with chunked:
        assert chunked.stats.retries == 3  # the same pool with a chunk size is halved and pinned


def test_pin_one_registration_for_an_unaligned_tensor() -> None:
    """A torch.empty tensor starts 64 B into a page: one registration needs no boundary at all,
    even on a runtime whose neighbours may not share a page."""
    backing = torch.empty(8 * MiB + 8192, dtype=torch.uint8)
    start = (-backing.data_ptr()) % 4096 + 64
    t = backing[start : start + 8 * MiB]
    fake = FakeRuntime(exact_ranges=False)
    with pinpool.pin(t, runtime=fake, registry=None, chunk_bytes="buffer", granularity_bytes=MiB) as p:
        assert list(p.plan.chunks) == [Chunk(0, 8 * MiB)] and len(fake.registered) == 1


def test_the_command_line_plans_one_registration_per_buffer(capsys: pytest.CaptureFixture[str]) -> None:
    from pinpool import _cli

    argv = ["plan", "--size", "1GiB", "--chunk-bytes", "buffer", "--layout", "mha", "--kv-layout", "page_first",
            "--layer-num", "2", "--page-size", "4", "--head-num", "2", "--head-dim", "16", "--v-head-dim", "8",
            "--dtype", "float16", "--json"]  # fmt: skip
    assert _cli.main(argv) == 0
    report = __import__("json").loads(capsys.readouterr().out)
    assert report["chunks"]["count"] == len(report["buffers"]) == 2
    assert [b["chunks"] for b in report["buffers"]] == [1, 1] and report["pinning"]["per_buffer"] is True
