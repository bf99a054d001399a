"""Each registrar's registrations are runs of whole chunks: boundaries on chunk boundaries (so on the copy
page and the OS page), within its limits, and a transfer's pieces never cross one."""

from __future__ import annotations

import json

import pytest

import pinpool
from pinpool import ConfigError, layouts
from pinpool._plan import (
    ChunkTable,
    PoolOptions,
    check_engine_pins,
    plan_pool,
    plan_transfer,
    split_at_registrations,
)
from pinpool.registrars import RegistrarLimits
from pinpool.testing import FakeRegistrar, FakeRuntime, host_facts

from ..conftest import config_error

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40
HOST = host_facts()
CAPS = FakeRuntime().capabilities


def plan_of(size: int, *, transfers: list[tuple[str, RegistrarLimits]], **options: object) -> pinpool.PoolPlan:
    return plan_pool(PoolOptions.create(size=size, **options), HOST, CAPS, transfers=transfers)


def test_one_registration_per_chunk_by_default() -> None:
    plan = plan_of(64 * MiB, chunk_bytes=4 * MiB, transfers=[("a", RegistrarLimits())])
    (transfer,) = plan.transfers
    assert tuple(transfer.registrations) == tuple(plan.chunks) and transfer.name == "a"


def test_preferred_bytes_joins_chunks_and_max_bytes_bounds_them() -> None:
    plan = plan_of(
        66 * MiB,
        chunk_bytes=4 * MiB,
        transfers=[("few", RegistrarLimits(preferred_bytes=16 * MiB, max_bytes=32 * MiB))],
    )
    registrations = plan.transfers[0].registrations
    assert [r.nbytes for r in registrations] == [16 * MiB] * 4 + [2 * MiB]
    assert {r.offset for r in registrations} <= {c.offset for c in plan.chunks}  # boundaries are chunk boundaries
    assert sum(r.nbytes for r in registrations) == plan.nbytes
    # No chunk option: chunks are planned within the smallest max_bytes of all registrars.
    bounded = plan_of(256 * MiB, transfers=[("big", RegistrarLimits()), ("small", RegistrarLimits(max_bytes=8 * MiB))])
    assert bounded.chunk_bytes <= 8 * MiB and bounded.chunk_limit <= 8 * MiB
    assert all(r.nbytes <= 8 * MiB for t in bounded.transfers for r in t.registrations)
    capped = plan_of(256 * MiB, max_chunk_bytes=64 * MiB, transfers=[("small", RegistrarLimits(max_bytes=8 * MiB))])
    assert capped.chunk_bytes <= 8 * MiB


def test_an_exact_chunk_larger_than_a_registrar_accepts_is_refused_before_pinning() -> None:
    text = config_error(
        lambda: plan_of(64 * MiB, chunk_bytes=16 * MiB, transfers=[("mooncake", RegistrarLimits(max_bytes=8 * MiB))])
    )
    assert "chunk_bytes=16777216" in text and "'mooncake'" in text and "max_bytes=8388608" in text


def test_a_page_table_budget_is_checked_against_the_pages_backing_the_pool() -> None:
    efa = RegistrarLimits(page_table_entries=1000)
    text = config_error(lambda: plan_of(8 * MiB, transfers=[("efa", efa)]))  # 2048 pages of 4 KiB
    assert "2048" in text and "page-table budget of 1000" in text and 'huge_pages="hugetlb"' in text
    assert plan_of(2 * MiB, transfers=[("efa", efa)]).transfers[0].registrations  # 512 entries fit
    fits = plan_transfer("efa", efa, ChunkTable([(0, 2 * MiB, 2)]), page_size=2 * MiB)  # hugetlb pages: 2 entries
    assert len(fits.registrations) == 2


@pytest.mark.parametrize(
    "layout",
    [
        layouts.Raw(),
        layouts.MHA("layer_first", 3, 16, 2, 64, "bfloat16"),
        layouts.MHA("page_first", 3, 16, 2, 64, "float16"),
        layouts.MLA("layer_first", 3, 64, 576, "bfloat16"),
        layouts.PagedBytes("layer_first", 3, 12288),
        layouts.Indexer("page_first", 3, 64, 128, 128),
        layouts.Dense((64, 1000), "float32"),
        layouts.Mamba(2, (4, 32), ((8, 16),), "bfloat16"),
    ],
    ids=lambda layout: layout.name,
)
def test_no_copy_page_is_ever_split_between_two_registrations(layout: layouts.Layout) -> None:
    limits = RegistrarLimits(max_bytes=3 * MiB, preferred_bytes=2 * MiB)
    plan = plan_pool(
        PoolOptions.create(layout=layout, size=40 * MiB, max_chunk_bytes=MiB), HOST, CAPS, transfers=[("a", limits)]
    )
    schedule_buffers = plan.buffers  # type: ignore[attr-defined]
    boundaries = {r.offset for r in plan.transfers[0].registrations} | {r.end for r in plan.transfers[0].registrations}
    for buffer in schedule_buffers:
        if buffer.plan is None:
            continue
        unit = buffer.spec.granularity or 1
        inside = [b for b in boundaries if buffer.offset < b < buffer.offset + buffer.spec.nbytes]
        assert all((b - buffer.offset) % unit == 0 for b in inside), (buffer.spec.name, unit)
        assert all(b % HOST.page_size == 0 for b in inside)
    assert all(r.nbytes <= 3 * MiB for r in plan.transfers[0].registrations)


def test_pieces_are_cut_at_registration_boundaries_and_gaps_are_refused() -> None:
    transfer = plan_transfer("a", RegistrarLimits(), ChunkTable([(0, 4 * MiB, 2), (10 * MiB, 4 * MiB, 1)]), 4096)
    assert split_at_registrations(transfer, 3 * MiB, 2 * MiB) == [(3 * MiB, MiB, 0), (4 * MiB, MiB, 1)]
    assert split_at_registrations(transfer, 10 * MiB, 4 * MiB) == [(10 * MiB, 4 * MiB, 2)]
    with pytest.raises(ConfigError, match="byte 8388608 is in no registration"):
        split_at_registrations(transfer, 7 * MiB, 2 * MiB)  # runs into the gap [8 MiB, 10 MiB)
    with pytest.raises(ConfigError, match="in no registration"):
        split_at_registrations(transfer, 14 * MiB, 1)


def test_a_plan_of_a_vast_pool_of_tiny_chunks_is_a_table_of_runs() -> None:
    plan = plan_of(100 * TiB, chunk_bytes=4096, transfers=[("a", RegistrarLimits(preferred_bytes=1 * GiB))])
    registrations = plan.transfers[0].registrations
    assert isinstance(registrations, ChunkTable) and len(registrations.runs) <= 2
    assert len(registrations) == 100 * 1024 and registrations.nbytes == 100 * TiB


def test_registrars_are_checked_before_anything_is_mapped(fake: FakeRuntime) -> None:
    def pool(registrars: object, **options: object) -> object:
        return pinpool.PinnedPool(size=8 * MiB, runtime=fake, registry=None, registrars=registrars, **options)  # type: ignore[arg-type]

    assert "is an object with a non-empty str name" in config_error(lambda: pool([object()]))
    assert "must be a list" in config_error(lambda: pool("mooncake"))
    twice = config_error(lambda: pool([FakeRegistrar("x"), FakeRegistrar("x")]))
    assert "names ['x'] more than once" in twice
    same = FakeRegistrar("y")
    assert "the same registrar twice" in config_error(lambda: pool([same, same]))
    assert "preferred_bytes=" in config_error(lambda: pool([FakeRegistrar(max_bytes=MiB, preferred_bytes=2 * MiB)]))
    assert "limits.max_bytes=0" in config_error(lambda: pool([FakeRegistrar(max_bytes=0)]))

    class NoLimits:
        name = "bare"
        limits = ("max_bytes", 1)

        def register(self, ptr: int, nbytes: int) -> object: ...

        def unregister(self, ptr: int, nbytes: int, handle: object) -> None: ...

    assert "not a pinpool.registrars.RegistrarLimits" in config_error(lambda: pool([NoLimits()]))
    assert fake.register_calls == []


def test_pinpool_plan_shows_each_registrars_calls(capsys: pytest.CaptureFixture[str]) -> None:
    from pinpool import _cli

    argv = ["plan", "--size", "4GiB", "--registrar", "mooncake:max=256MiB", "--registrar", "nixl:preferred=2GiB,serial"]
    assert _cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    mooncake, nixl = report["transfers"]
    assert (mooncake["name"], mooncake["registrations"], mooncake["largest_bytes"]) == ("mooncake", 16, 256 * MiB)
    assert (nixl["registrations"], nixl["largest_bytes"], nixl["parallel"], nixl["workers"]) == (2, 2 * GiB, False, 1)
    assert report["chunk_bytes"] <= 256 * MiB and "registrar 'mooncake'" in report["registrations_reason"]
    assert _cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "registrar: mooncake: 16 registration(s) of <= 256 MiB (max 256 MiB)" in text
    assert _cli.main(["plan", "--size", "4GiB", "--registrar", "x:foo=1"]) == 2
    assert "'foo=1' is not a limit" in capsys.readouterr().err
    assert _cli.main(["plan", "--size", "8GiB", "--registrar", "efa:pte=1000"]) == 2
    assert "page-table budget of 1000" in capsys.readouterr().err


def test_one_registration_per_buffer_larger_than_a_registrar_accepts_is_refused() -> None:
    text = config_error(
        lambda: plan_of(32 * MiB, chunk_bytes="buffer", transfers=[("e", RegistrarLimits(max_bytes=4 * MiB))])
    )
    assert "chunk_bytes='buffer'" in text and "'e'" in text and "give max_chunk_bytes <= 4194304" in text


def test_an_engine_that_pins_pages_is_held_to_rlimit_memlock() -> None:
    tight = host_facts(memlock_soft=8 * MiB, cap_ipc_lock=False)
    text = config_error(lambda: check_engine_pins([("rdma", True)], 16 * MiB, tight))
    assert "'rdma' pins the pool's pages itself" in text and "ulimit -l" in text
    check_engine_pins([("tcp", False)], 16 * MiB, tight)  # a TCP engine pins nothing
    check_engine_pins([("rdma", True)], 8 * MiB, tight)
    check_engine_pins([("rdma", True)], 16 * MiB, host_facts(memlock_soft=8 * MiB, cap_ipc_lock=True))
