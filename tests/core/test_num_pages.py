"""Pools sized by page count, ``num_pages=``, instead of a byte budget (issue 12, item 5).

SGLang sizes paired host pools (an MLA KV pool and its DSA indexer pool; an attention pool and
its Mamba state pool) to the same page count: page *i* of one belongs with page *i* of the
other. A byte budget cannot do that (the pools' pages differ in size), so ``num_pages=N`` gives
exactly N pages, ``size = N * layout.page_bytes``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import pinpool
from pinpool import layouts
from pinpool._plan import PoolOptions
from pinpool.layouts import BufferSpec, Layout
from pinpool.testing import FakeRuntime

from ..conftest import config_error

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# DeepSeek-V3.2-like per-rank pools, shrunk in layers so the tests stay small.
MLA = layouts.MLA("page_first", 4, 64, 656, torch.bfloat16)
INDEXER = layouts.Indexer("page_first", 4, 64, 128, 128)

LAYOUTS: dict[str, Layout] = {
    "raw": layouts.Raw(),
    "mha-lf": layouts.MHA("layer_first", 2, 16, 2, 64, torch.float16),
    "mha-pf": layouts.MHA("page_first", 2, 16, 2, 64, torch.bfloat16),
    "mha-kv": layouts.MHA("page_first_direct", 2, 16, 2, 64, torch.bfloat16, v_head_dim=32),
    "mla-lf": layouts.MLA("layer_first", 3, 32, 576, torch.bfloat16),
    "mla-pf": MLA,
    "mamba": layouts.Mamba(2, (4, 8, 8), ((64, 3),), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16),
    "indexer": INDEXER,
    "paged-lf": layouts.PagedBytes("layer_first", 3, 1000),
    "state-pf": layouts.PagedBytes.state("page_first", 2, 2, 300),
}


def pool(**kwargs: Any) -> pinpool.PinnedPool:
    return pinpool.PinnedPool(runtime=FakeRuntime(), registry=None, **kwargs)


@pytest.mark.parametrize("num_pages", [1, 7, 1000])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_pool_holds_exactly_num_pages(name: str, num_pages: int) -> None:
    layout = LAYOUTS[name]
    p = pool(layout=layout, num_pages=num_pages)
    assert p.num_pages == num_pages
    assert p.plan.page_bytes == layout.page_bytes
    assert sum(b.spec.nbytes for b in p._plan.buffers) == num_pages * layout.page_bytes
    assert [b.spec for b in p._plan.buffers] == list(layout.buffers(num_pages))


def test_a_byte_pool_by_page_count_holds_whole_copy_pages() -> None:
    raw = layouts.Raw(granularity_bytes=4096)  # a byte pool's page is one byte
    assert pool(layout=raw, num_pages=3 * 4096).nbytes == 3 * 4096
    assert "give num_pages=4096 or more" in config_error(lambda: pool(layout=raw, num_pages=4095))


def test_the_same_page_count_as_a_byte_budget_of_exactly_that_many_pages() -> None:
    by_pages = pool(layout=MLA, num_pages=300)
    by_bytes = pool(layout=MLA, size=300 * MLA.page_bytes)
    assert by_pages.num_pages == by_bytes.num_pages == 300
    assert by_pages.nbytes == by_bytes.nbytes
    assert by_pages.plan.chunks == by_bytes.plan.chunks


def test_paired_mla_and_indexer_pools_get_the_same_page_count() -> None:
    # What a byte budget does: one budget, two page sizes, two page counts.
    budget = 256 * MiB
    assert budget // MLA.page_bytes != budget // INDEXER.page_bytes
    kv = pinpool.PinnedPool(layout=MLA, size=budget, runtime=FakeRuntime(), name="kv-host", registry=None)
    # The indexer pool follows the KV pool's page count, whatever its own page size.
    index = pinpool.PinnedPool(
        layout=INDEXER, num_pages=kv.num_pages, runtime=FakeRuntime(), name="indexer", registry=None
    )
    assert index.num_pages == kv.num_pages == budget // MLA.page_bytes
    with kv, index:
        assert kv.tensor.shape[0] == kv.num_pages * MLA.page_size  # page_first: (tokens, L, 1, dim)
        assert index.tensor.shape[0] == index.num_pages
        # Page i of both pools is addressable, the last one included.
        last = kv.num_pages - 1
        kv.tensor[last * MLA.page_size : (last + 1) * MLA.page_size].fill_(1)
        index.tensor[last].fill_(7)
        assert int(index.tensor[last].sum()) == 7 * INDEXER.page_bytes


@pytest.mark.anyio
async def test_paired_pools_pin_together_by_page_count() -> None:
    num_pages = 500
    kv_fake, index_fake = FakeRuntime(), FakeRuntime()
    async with (
        pinpool.PinnedPool(layout=MLA, num_pages=num_pages, runtime=kv_fake, name="kv-host", registry=None) as kv,
        pinpool.PinnedPool(
            layout=INDEXER, num_pages=num_pages, runtime=index_fake, name="indexer", registry=None
        ) as index,
    ):
        assert kv.num_pages == index.num_pages == num_pages
        assert kv.pinned_bytes == num_pages * MLA.page_bytes
        assert index.pinned_bytes == num_pages * INDEXER.page_bytes
    assert kv_fake.registered == {} and index_fake.registered == {}


def test_mha_and_mamba_pair_by_slot_count() -> None:
    mha = layouts.MHA("page_first", 4, 1, 8, 128, torch.bfloat16)  # page size 1: one token a page
    mamba = layouts.Mamba(4, (8, 64, 64), ((256, 3),), temporal_dtype=torch.float32, conv_dtype=torch.bfloat16)
    attention = pool(layout=mha, size="64MiB")
    states = pool(layout=mamba, num_pages=attention.num_pages)
    assert states.num_pages == attention.num_pages


# -- exactly one of size= and num_pages= ----------------------------------------------------------------


def test_neither_size_nor_num_pages_names_both_and_the_fix() -> None:
    message = config_error(lambda: pinpool.PinnedPool(runtime=FakeRuntime(), registry=None))
    assert "size=" in message and "num_pages=" in message
    assert "neither was given" in message and "give exactly one of size=" in message


@pytest.mark.parametrize("size", ["1GiB", 4096, 0])
def test_both_size_and_num_pages_name_both_and_the_fix(size: object) -> None:
    message = config_error(lambda: pool(size=size, num_pages=16))
    assert f"size={size!r}" in message and "num_pages=16" in message
    assert "both were given" in message and "give exactly one of size=" in message


@pytest.mark.parametrize("bad", [True, False, 0, -1, -(2**70), "16", "1GiB", 16.0, 1e3, [16], b"16"], ids=repr)
def test_num_pages_must_be_a_positive_int(bad: object) -> None:
    message = config_error(lambda: pool(layout=MLA, num_pages=bad))
    assert message.startswith(f"num_pages={bad!r} must be a positive int number of layout pages")
    assert "or None to size the pool by size= instead" in message


def test_an_int_subclass_that_is_not_a_bool_is_a_page_count() -> None:
    class Pages(int):
        pass

    assert pool(layout=MLA, num_pages=Pages(3)).num_pages == 3


def test_a_page_count_beyond_the_address_space_is_a_config_error() -> None:
    message = config_error(lambda: pool(layout=MLA, num_pages=10**20))
    assert "more than a process on this host can map" in message


def test_num_pages_below_a_copy_page_names_num_pages_and_the_fix() -> None:
    @dataclasses.dataclass(frozen=True)
    class Coarse:
        """A custom layout whose copy page (300 B) is three of its pages (100 B)."""

        name: str = "coarse"
        page_bytes: int = 100

        def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
            return (BufferSpec("data", (num_pages * 100,), torch.uint8, 300, 1),)

    message = config_error(lambda: pool(layout=Coarse(), num_pages=2))
    assert message.startswith("num_pages=2 (200 B) is smaller than one copy page")
    assert "give num_pages=3 or more" in message
    assert pool(layout=Coarse(), num_pages=3).num_pages == 3


def test_other_options_are_still_checked_first() -> None:
    # The layout is checked before the size; an invalid one is named even with num_pages=.
    assert "layout=" in config_error(lambda: pool(layout="mla", num_pages=4))


# -- PoolOptions carries it -----------------------------------------------------------------------------


def test_pool_options_create_computes_the_size_and_records_the_count() -> None:
    options = PoolOptions.create(layout=INDEXER, num_pages=1234)
    assert options.num_pages == 1234
    assert options.size == 1234 * INDEXER.page_bytes
    by_size = PoolOptions.create(layout=INDEXER, size="1GiB")
    assert by_size.num_pages is None and by_size.size == GiB


def test_pool_options_checks_that_size_and_num_pages_agree() -> None:
    assert PoolOptions(size=10 * MLA.page_bytes, layout=MLA, num_pages=10).num_pages == 10
    message = config_error(lambda: PoolOptions(size=10 * MLA.page_bytes + 1, layout=MLA, num_pages=10))
    assert "size must be num_pages * layout.page_bytes" in message and "num_pages=10" in message
    message = config_error(lambda: PoolOptions(size=10 * MLA.page_bytes, layout=MLA, num_pages=True))
    assert message.startswith("num_pages=True must be a positive int")


def test_pool_options_neither_and_both() -> None:
    assert "neither was given" in config_error(lambda: PoolOptions.create(layout=MLA))
    assert "both were given" in config_error(lambda: PoolOptions.create(layout=MLA, size="1GiB", num_pages=1))
