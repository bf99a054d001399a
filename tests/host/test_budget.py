"""One byte budget for paired pools (pinpool.share) and the budget this host or container can give
a rank (pinpool.host_budget): exact page counts on hand-made hosts, pools sized from the host's
budget passing their own pre-flight (every rank's pools together), and real mlocked pools whose
mapped bytes add up to what the sizing said, within the budget."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import pinpool
from pinpool import ConfigError, layouts
from pinpool._plan import HostFacts, PoolOptions, check_host, place, resident_fit
from pinpool.runtimes import pinning_capabilities
from pinpool.testing import host_facts, locked_bytes

from ..conftest import needs_mlock

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# 16 GiB available, no cgroup limit, CAP_IPC_LOCK (RLIMIT_MEMLOCK does not apply).
HOST = host_facts(memlock_soft=8 * MiB, memlock_hard=8 * MiB, mem_available=16 * GiB)
# A container whose cgroup is tighter than MemAvailable: room = 2 GiB - (300 MiB - 12 MiB page cache) = 1760 MiB.
CONTAINER = dataclasses.replace(
    HOST, cgroup_memory_limit=2 * GiB, cgroup_memory_usage=300 * MiB, cgroup_memory_reclaimable=12 * MiB,
    cgroup_version=2, cgroup_path="/kubepods/pod1/c1",
)  # fmt: skip
# No CAP_IPC_LOCK: RLIMIT_MEMLOCK 64 MiB with 8 MiB locked already leaves 56 MiB to mlock.
NO_CAP = dataclasses.replace(
    CONTAINER, cap_ipc_lock=False, memlock_soft=64 * MiB, memlock_hard=GiB, locked_bytes=8 * MiB
)

# A DSA model with a speculative draft model, as SGLang pairs them (page i of each belongs together):
KV = layouts.MLA("page_first", 2, 64, 576, torch.bfloat16)  # 147456 B a page (36 OS pages)
INDEXER = layouts.Indexer("page_first", 2, 64, 128, 128)  # 16896 B a page (4.125 OS pages: its buffer rounds up)
DRAFT = layouts.MHA("page_first", 1, 64, 2, 64, torch.bfloat16)  # 32768 B a page
TRIO = {"kv": KV, "indexer": INDEXER, "draft": DRAFT}  # 197120 B a page of all three


def mapped(pages: int, page_bytes: int, align: int = 4096) -> int:
    """One page_first buffer of ``pages`` pages, as mapped: rounded up to ``align``."""
    return -(-pages * page_bytes // align) * align


# -- share(): one page count, the total never above the budget -----------------------------------------------


def test_three_pools_share_one_budget_with_one_page_count() -> None:
    shares = pinpool.share("64MiB", TRIO, host=HOST)
    # 340 pages: 50135040 + 5746688 (340 * 16896 = 5744640, rounded up to 4 KiB) + 11141120 = 67022848
    assert shares.num_pages == 340
    assert dict(shares.bytes) == {"kv": 50135040, "indexer": 5746688, "draft": 11141120}
    assert shares.total_bytes == 67022848 <= shares.budget == 64 * MiB
    # one page more would overshoot: 341 pages map 67219456 B
    assert sum(mapped(341, layout.page_bytes) for layout in TRIO.values()) > 64 * MiB
    # each share is what a pool of that many pages maps
    for name, layout in TRIO.items():
        options = PoolOptions.create(layout=layout, num_pages=340)
        assert place(options, HOST, check=False).mapping_bytes == shares.bytes[name]


def test_the_pair_the_docs_used_to_overshoot_now_fits() -> None:
    """Sizing the indexer from the KV pool's page count (the old advice) put 32 MiB of KV pages
    plus 3.7 MiB of indexer pages in a 32 MiB budget; shared, the pair gets 204 pages."""
    shares = pinpool.share(32 * MiB, {"kv": KV, "indexer": INDEXER}, host=HOST)
    assert shares.num_pages == 204
    assert shares.total_bytes == 30081024 + 3448832 <= 32 * MiB
    assert 32 * MiB // KV.page_bytes == 227  # the old way: the KV pool alone takes the whole budget


def test_huge_pages_round_every_buffer_to_the_huge_page() -> None:
    shares = pinpool.share("64MiB", TRIO, host=HOST, huge_pages=True)
    # each buffer rounds up to 2 MiB: 327 pages map 46 + 6 + 12 MiB, exactly 64 MiB (328 pages would not fit)
    assert shares.num_pages == 327
    assert dict(shares.bytes) == {"kv": 46 * MiB, "indexer": 6 * MiB, "draft": 12 * MiB}
    assert shares.total_bytes == 64 * MiB
    assert dict(shares.options) == {"huge_pages": True}


def test_one_layout_is_its_own_whole_page_count() -> None:
    shares = pinpool.share(GiB, {"kv": KV}, host=HOST)
    assert shares.num_pages == GiB // KV.page_bytes == 7281
    assert shares.total_bytes == 7281 * KV.page_bytes


def test_a_budget_below_one_page_of_every_pool_is_refused_naming_what_one_page_maps() -> None:
    # one page of each maps 147456 + 20480 (the indexer's 16896 B rounded to 4 KiB) + 32768 = 200704 B
    assert pinpool.share(200704, TRIO, host=HOST).num_pages == 1
    with pytest.raises(ConfigError) as info:
        pinpool.share(200703, TRIO, host=HOST)
    message = str(info.value)
    assert message.startswith("budget=200703 (200703 B = 196 KiB) is smaller than the fewest pages of every pool")
    assert "1 page(s) map 200704 B = 196 KiB (kv 144 KiB, indexer 20 KiB, draft 32 KiB)" in message
    assert "give a budget of at least 200704 bytes" in message


@pytest.mark.parametrize(
    ("call", "text"),
    [
        (lambda: pinpool.share("lots", TRIO, host=HOST), "budget='lots' is not a size"),
        (lambda: pinpool.share(0, TRIO, host=HOST), "budget=0 is not positive"),
        (lambda: pinpool.share(GiB, {}, host=HOST), "give a non-empty mapping of pool names to layouts"),
        (lambda: pinpool.share(GiB, [KV], host=HOST), "give a non-empty mapping of pool names to layouts"),
        (lambda: pinpool.share(GiB, {"": KV}, host=HOST), "pool name '' must be a non-empty str"),
        (lambda: pinpool.share(GiB, {"kv": object()}, host=HOST), "is not a layout; use one from pinpool.layouts"),
        (lambda: pinpool.share(GiB, {"kv": object()}, host=HOST), "'kv': <object object at"),
        (lambda: pinpool.share(GiB, TRIO, host=HOST, num_pages=3), "num_pages=...): not a pool option that decides"),
        (lambda: pinpool.share(GiB, TRIO, host=HOST, node_slots=2), "node_slots=...): not a pool option that decides"),
        (lambda: pinpool.share(GiB, TRIO, host=HOST, huge_pages="yes"), "huge_pages='yes'"),
    ],
)
def test_bad_input_to_share_is_a_config_error_naming_it(call: Any, text: str) -> None:
    with pytest.raises(ConfigError) as info:
        call()
    assert text in str(info.value)


def test_shares_pool_builds_each_pool_with_the_one_page_count_and_refuses_other_sizes() -> None:
    shares = pinpool.share("64MiB", TRIO, host=HOST)
    pool = shares.pool("indexer", name="indexer-host", runtime=pinpool.testing.FakeRuntime())
    assert (pool.num_pages, pool.layout, pool.name) == (340, INDEXER, "indexer-host")
    assert shares.pool("draft", runtime=pinpool.testing.FakeRuntime()).name == "draft"  # the share's name by default
    with pytest.raises(ConfigError, match=r"Shares.pool\('mamba'\): no pool of that name was sized"):
        shares.pool("mamba")
    with pytest.raises(ConfigError, match=r"the shares give the layout and num_pages=340"):
        shares.pool("kv", num_pages=341)
    with pytest.raises(ConfigError, match=r"were sized with huge_pages=False, which decides what they map"):
        pinpool.share("64MiB", TRIO, host=HOST, huge_pages=False).pool("kv", huge_pages=True)


# -- host_budget(): a fraction of what this host or container can give, after a reserve, per rank ------------


def test_a_fraction_after_a_reserve_split_across_ranks_from_an_argument() -> None:
    budget = pinpool.host_budget(0.8, reserve="10GiB", ranks=2, host=HOST, environ={})
    # (16 GiB - 10 GiB) * 0.8 = 5153960755 B; / 2 ranks = 2576980377; less page tables (8 B a 4 KiB page),
    # in whole pages: 2576980377 * 4096 // 4104 rounded down to 4 KiB
    assert budget == 2571956224
    shares = pinpool.share(budget, TRIO, host=HOST)
    assert shares.num_pages == 13047
    assert shares.total_bytes == 2571825152


def test_ranks_come_from_local_world_size_when_not_given() -> None:
    assert pinpool.host_budget(0.8, ranks=None, host=HOST, environ={"LOCAL_WORLD_SIZE": "4"}) == 1285976064
    assert pinpool.share(1285976064, TRIO, host=HOST).num_pages == 6523
    # the argument wins over the variable; neither: this process alone
    assert pinpool.host_budget(0.8, ranks=2, host=HOST, environ={"LOCAL_WORLD_SIZE": "4"}) == 2571956224
    assert pinpool.host_budget(0.8, host=HOST, environ={}) == pinpool.host_budget(0.8, ranks=1, host=HOST, environ={})


def test_a_cgroup_tighter_than_mem_available_is_what_the_host_can_give() -> None:
    # the container's room, 1760 MiB, not MemAvailable's 16 GiB: 880 MiB, less page tables
    budget = pinpool.host_budget("50%", reserve=0, host=CONTAINER, environ={})
    assert budget == 920944640
    assert budget == resident_fit(CONTAINER.memory_available // 2, 4096)
    shares = pinpool.share(budget, TRIO, host=CONTAINER)
    assert (shares.num_pages, shares.total_bytes) == (4672, 920944640)


def test_rlimit_memlock_caps_the_budget_only_where_the_runtime_is_charged_to_it() -> None:
    # without CAP_IPC_LOCK, mlock may lock 64 MiB - 8 MiB already locked = 56 MiB
    assert pinpool.host_budget(0.8, reserve=0, runtime="mlock", host=NO_CAP, environ={}) == 56 * MiB
    assert pinpool.share(56 * MiB, TRIO, host=NO_CAP).num_pages == 297
    # CUDA's registrations are not charged to RLIMIT_MEMLOCK: the cgroup's room decides
    cuda = pinpool.host_budget(0.8, reserve=0, runtime="cuda", host=NO_CAP, environ={})
    assert cuda == resident_fit(1760 * MiB * 8 // 10, 4096)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"fraction": 0}, "fraction=0.0: a fraction of the available memory must be in (0, 1]"),
        ({"fraction": 1.5}, "fraction=1.5: a fraction of the available memory must be in (0, 1]"),
        ({"fraction": "120%"}, "fraction='120%': a fraction of the available memory must be in (0, 1]"),
        ({"fraction": float("nan")}, "fraction=nan: a fraction of the available memory must be in (0, 1]"),
        ({"fraction": "0.8GiB"}, "fraction='0.8GiB' is not a fraction"),
        ({"fraction": True}, "fraction=True has type bool"),
        ({"fraction": "٨٠%"}, "is not a number"),
        ({"reserve": "20GiB"}, "reserve='20GiB' (21474836480 B = 20 GiB) leaves nothing of the 16 GiB"),
        ({"reserve": -1}, "reserve=-1 is not positive"),
        ({"ranks": 0}, "ranks=0 must be a positive int"),
        ({"ranks": 2.0}, "ranks=2.0 must be a positive int"),
        ({"environ": {"LOCAL_WORLD_SIZE": "0"}}, "LOCAL_WORLD_SIZE='0' is not a positive integer"),
        ({"environ": {"LOCAL_WORLD_SIZE": "eight"}}, "pass ranks= to host_budget(), or fix or unset LOCAL_WORLD_SIZE"),
        ({"ranks": 1 << 40}, "less than one OS page; give a larger fraction, a smaller reserve, or fewer ranks"),
    ],
)
def test_bad_input_to_host_budget_is_a_config_error_naming_the_value_and_the_fix(
    kwargs: dict[str, Any], text: str
) -> None:
    given: dict[str, Any] = {"host": HOST, "environ": {}, **kwargs}
    with pytest.raises(ConfigError) as info:
        pinpool.host_budget(**given)
    assert text in str(info.value)


def test_unknown_memory_is_refused_rather_than_guessed() -> None:
    with pytest.raises(ConfigError, match="the memory this process may still make resident is unknown"):
        pinpool.host_budget(host=dataclasses.replace(HOST, mem_available=None), environ={})


# -- the pre-flight agrees: pools sized from host_budget() pass their own pre-flight -------------------------


def build_all(host: HostFacts, num_pages: int, ranks: int, runtime: str) -> None:
    """Every rank builds every pool of TRIO with ``num_pages`` pages, one after the other: each pool's
    pre-flight runs on the host as the pools before it left it (their pages and page tables
    resident, charged to the cgroup; their locked bytes charged to their own rank's RLIMIT_MEMLOCK)."""
    caps = pinning_capabilities(runtime, host)
    for _rank in range(ranks):
        locked = host.locked_bytes  # per process
        for layout in TRIO.values():
            options = PoolOptions.create(layout=layout, num_pages=num_pages)
            rank_host = dataclasses.replace(host, locked_bytes=locked)
            check_host(options, rank_host, caps)  # raises the first failure
            nbytes = place(options, host, check=False).mapping_bytes
            used = nbytes + nbytes // host.page_size * 8
            host = dataclasses.replace(
                host, mem_available=(host.mem_available or 0) - used,
                cgroup_memory_usage=None if host.cgroup_memory_usage is None else host.cgroup_memory_usage + used,
            )  # fmt: skip
            locked += nbytes


@pytest.mark.parametrize(
    ("host", "fraction", "reserve", "ranks", "runtime"),
    [
        (HOST, 1.0, 0, 1, "mlock"),
        (HOST, 0.8, "10GiB", 2, "cuda"),
        (CONTAINER, 1.0, 0, 4, "auto"),
        (CONTAINER, "90%", "100MiB", 3, "mlock"),
        (NO_CAP, 1.0, 0, 1, "mlock"),
        (NO_CAP, 1.0, 0, 2, "cuda"),
    ],
)
def test_pools_sized_from_host_budget_pass_their_pre_flight_and_one_page_more_does_not(
    host: HostFacts, fraction: float | str, reserve: int | str, ranks: int, runtime: str
) -> None:
    budget = pinpool.host_budget(fraction, reserve=reserve, ranks=ranks, runtime=runtime, host=host, environ={})
    shares = pinpool.share(budget, TRIO, host=host)
    build_all(host, shares.num_pages, ranks, runtime)  # every rank's pools fit, together
    if fraction == 1.0 and reserve == 0:  # all of it: the sizing is tight, one page more fails a pre-flight
        with pytest.raises(ConfigError, match=r"cannot be pinned here|RLIMIT_MEMLOCK leaves only"):
            build_all(host, shares.num_pages + 1, ranks, runtime)


# -- real pools under mlock ----------------------------------------------------------------------------------


def mapped_vmas(addresses: list[int]) -> int:
    """Bytes of the /proc/self/maps entries holding ``addresses`` (each entry counted once)."""
    found = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if any(start <= a < end for a in addresses):
                found.add((start, end))
    return sum(end - start for start, end in found)


@needs_mlock
def test_real_pools_sized_from_one_budget_map_and_lock_no_more_than_it(vmlck_baseline: int) -> None:
    budget = 24 * MiB
    shares = pinpool.share(budget, {"kv": KV, "indexer": INDEXER})
    assert shares.num_pages == 153  # 22560768 + 2588672 (153 * 16896 = 2585088, rounded up to 4 KiB)
    with shares.pool("kv", runtime="mlock") as kv, shares.pool("indexer", runtime="mlock") as index:
        assert kv.num_pages == index.num_pages == 153
        locked = locked_bytes() - vmlck_baseline
        real = mapped_vmas([kv.data_ptr, index.data_ptr])
        assert locked == real == shares.total_bytes == 25149440 <= budget
    assert locked_bytes() == vmlck_baseline
