"""KV-cache layouts (MHA, MLA, Mamba, Indexer, PagedBytes) against SGLang's host-pool table.

Expected shapes and granularities are computed here from docs' reference table (SGLang's host
pools), never by calling ``layout.buffers()``; the no-straddle property is checked through torch
views of a real (FakeRuntime-registered) pool: every copy unit lies inside exactly one chunk.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import math
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool import layouts
from pinpool.testing import FakeRuntime

from ..conftest import config_error, each_driver, lifecycle_of

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
OS_PAGE = 4096

# Itemsizes written down here, not read from torch, so a wrong dtype shows up as a wrong size.
ITEMSIZE = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4, torch.float8_e4m3fn: 1, torch.uint8: 1}
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn]

PROPERTY_SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Above this many copy units per example the pool is shrunk to about two chunks (odd
# granularities force lcm(g, 4096) = 4096 granules per chunk, which is a lot of views).
MAX_UNITS = 24_000


# -- the reference table, written out independently ------------------------------------------------

Views = Callable[[torch.Tensor], Iterator[torch.Tensor]]


@dataclass(frozen=True)
class Expected:
    """One buffer as the reference table describes it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: int | None  # bytes of one copy page; None for a zero-element buffer
    granules: Views  # the copy units, each exactly `granularity` bytes, tiling the buffer
    units_per_page: int  # how many granules + sub-blocks one page contributes (for sizing only)
    blocks: Views | None = None  # finer copy units inside a granule (page_first_direct blocks)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def _leads(lead: tuple[int, ...]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(n) for n in lead)))


def expected_attention(
    name: str, layout: str, lead: tuple[int, ...], L: int, P: int, H: int, D: int, dtype: torch.dtype, np_: int
) -> Expected:
    """MHA (K+V, K-only, K or V of an asymmetric pool) and MLA (H=1, D=kv_cache_dim) rows."""
    it = ITEMSIZE[dtype]
    token_stride = H * D * it
    size = np_ * P
    nlead = math.prod(lead)

    if layout == "layer_first":
        shape = (*lead, L, size, H, D)
        granularity = P * token_stride  # one page of one layer (SGLang passes none)

        def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
            for pre in _leads(lead):
                for layer in range(L):
                    for page in range(np_):
                        yield t[(*pre, layer, slice(page * P, (page + 1) * P))]

        return Expected(name, shape, dtype, granularity, granules, nlead * L)
    if layout == "page_first":
        shape = (*lead, size, L, H, D)
        granularity = P * L * token_stride

        def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
            for pre in _leads(lead):
                for page in range(np_):
                    yield t[(*pre, slice(page * P, (page + 1) * P))]

        return Expected(name, shape, dtype, granularity, granules, nlead)
    if layout == "page_first_direct":
        shape = (*lead, np_, L, P, H, D)
        granularity = P * L * token_stride  # L blocks of (page, layer[, K or V])

        def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
            for pre in _leads(lead):
                for page in range(np_):
                    yield t[(*pre, page)]

        def blocks(t: torch.Tensor) -> Iterator[torch.Tensor]:
            for pre in _leads(lead):
                for page in range(np_):
                    for layer in range(L):
                        yield t[(*pre, page, layer)]

        return Expected(name, shape, dtype, granularity, granules, nlead * (1 + L), blocks)
    assert layout == "page_head"
    shape = (*lead, np_, H, P, L, D)
    granularity = P * L * token_stride  # one page (SGLang passes none)

    def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
        for pre in _leads(lead):
            for page in range(np_):
                yield t[(*pre, page)]

    return Expected(name, shape, dtype, granularity, granules, nlead)


def expected_per_page(name: str, shape: tuple[int, ...], dtype: torch.dtype, np_: int) -> Expected:
    """A buffer whose leading dim is the page (or slot): the copy unit is ``t[page]``."""
    assert shape[0] == np_
    per_page = math.prod(shape[1:]) * ITEMSIZE[dtype]

    def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
        if per_page:
            for page in range(np_):
                yield t[page]

    return Expected(name, shape, dtype, per_page or None, granules, 1)


# -- cases: (family, layout) → strategy of (pinpool layout, expected buffers at num_pages) -----------

Build = tuple[Any, Callable[[int], list[Expected]]]

dims_L = st.integers(1, 4)
dims_P = st.integers(1, 8)
dims_H = st.integers(1, 4)
dims_D = st.integers(1, 64)
dtypes = st.sampled_from(DTYPES)


@st.composite
def mha_case(draw: st.DrawFn, layout: str, kind: str) -> Build:
    L, P, H, D, dtype = draw(dims_L), draw(dims_P), draw(dims_H), draw(dims_D), draw(dtypes)
    if kind == "kv":
        obj = layouts.MHA(layout, L, P, H, D, dtype)
        return obj, lambda n: [expected_attention("kv", layout, (2,), L, P, H, D, dtype, n)]
    if kind == "k":
        obj = layouts.MHA(layout, L, P, H, D, dtype, k_only=True)
        return obj, lambda n: [expected_attention("k", layout, (), L, P, H, D, dtype, n)]
    Dv = draw(dims_D)
    if Dv == D:  # asymmetric means v_head_dim != head_dim
        Dv = D % 64 + 1
    obj = layouts.MHA(layout, L, P, H, D, dtype, v_head_dim=Dv)
    return obj, lambda n: [
        expected_attention("k", layout, (), L, P, H, D, dtype, n),
        expected_attention("v", layout, (), L, P, H, Dv, dtype, n),
    ]


@st.composite
def mla_case(draw: st.DrawFn, layout: str) -> Build:
    L, P, C, dtype = draw(dims_L), draw(dims_P), draw(st.integers(1, 96)), draw(dtypes)
    obj = layouts.MLA(layout, L, P, C, dtype)
    # MLA is a K-only attention pool with one "head" of kv_cache_dim: (.., 1, kv_cache_dim).
    return obj, lambda n: [expected_attention("kv", layout, (), L, P, 1, C, dtype, n)]


state_dims = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
conv_dims = st.lists(st.integers(0, 6), min_size=1, max_size=2).map(tuple)  # a 0 makes an empty buffer


@st.composite
def mamba_case(draw: st.DrawFn, layout: str) -> Build:
    Lm, temporal, dtype = draw(dims_L), draw(state_dims), draw(dtypes)
    convs = tuple(draw(st.lists(conv_dims, min_size=1, max_size=3)))
    obj = layouts.Mamba(Lm, temporal, convs, dtype, layout=layout)
    states = [("temporal", temporal), *((f"conv{i}", c) for i, c in enumerate(convs))]
    return obj, lambda n: [expected_per_page(name, (n, Lm, 1, *s), dtype, n) for name, s in states]


@st.composite
def indexer_case(draw: st.DrawFn, layout: str) -> Build:
    L, P = draw(dims_L), draw(dims_P)
    qbs = draw(st.integers(1, 32))
    ihd = qbs * draw(st.integers(1, 4))
    obj = layouts.Indexer(layout, L, P, ihd, qbs)
    stride = P * (ihd + ihd // qbs * 4)

    def build(n: int) -> list[Expected]:
        if layout == "layer_first":

            def granules(t: torch.Tensor) -> Iterator[torch.Tensor]:
                for layer in range(L):
                    for page in range(n):
                        yield t[layer, page]

            return [Expected("index", (L, n, stride), torch.uint8, stride, granules, L)]
        spec = expected_per_page("index", (n, L, 1, stride), torch.uint8, n)
        assert spec.granularity == stride * L
        return [spec]

    return obj, build


@st.composite
def paged_case(draw: st.DrawFn, layout: str, state: bool) -> Build:
    L = draw(dims_L)
    if state:
        ring, slot = draw(st.integers(1, 4)), draw(st.integers(1, 700))
        obj = layouts.PagedBytes.state(layout, L, ring, slot)
        item = ring * slot  # state_page_bytes
    else:
        item = draw(st.integers(1, 3000))
        obj = layouts.PagedBytes(layout, L, item)

    def build(n: int) -> list[Expected]:
        if layout == "layer_first":
            return [expected_per_page(f"layer{i}", (n, item), torch.uint8, n) for i in range(L)]
        shape = (n, L, item) if layout == "page_first" else (n, L, 1, item)
        return [expected_per_page("data", shape, torch.uint8, n)]

    return obj, build


CASES: dict[str, Callable[[], st.SearchStrategy[Build]]] = {
    **{f"mha/{lay}": (lambda lay=lay: mha_case(lay, "kv")) for lay in ("layer_first", "page_first",
                                                                      "page_first_direct", "page_head")},
    **{f"mha-k/{lay}": (lambda lay=lay: mha_case(lay, "k")) for lay in ("layer_first", "page_first",
                                                                       "page_first_direct")},
    **{f"mha-kv/{lay}": (lambda lay=lay: mha_case(lay, "kv-asym")) for lay in ("page_first", "page_first_direct")},
    **{f"mla/{lay}": (lambda lay=lay: mla_case(lay)) for lay in ("layer_first", "page_first", "page_first_direct")},
    **{f"mamba/{lay}": (lambda lay=lay: mamba_case(lay)) for lay in ("page_first", "page_first_direct")},
    **{f"indexer/{lay}": (lambda lay=lay: indexer_case(lay)) for lay in ("layer_first", "page_first",
                                                                        "page_first_direct")},
    **{f"paged/{lay}": (lambda lay=lay: paged_case(lay, False)) for lay in ("layer_first", "page_first",
                                                                           "page_first_direct")},
    **{f"state/{lay}": (lambda lay=lay: paged_case(lay, True)) for lay in ("layer_first", "page_first",
                                                                          "page_first_direct")},
}  # fmt: skip


# -- independent checks ------------------------------------------------------------------------------


def assert_chunk_invariants(pool: pinpool.PinnedPool, base: int, expected: list[Expected]) -> None:
    """Chunks: sorted, disjoint, contiguous within each buffer, covering each non-empty buffer
    exactly, aligned to the buffer's granularity, page-aligned (no OS page in two chunks)."""
    chunks = list(pool.plan.chunks)
    assert chunks == sorted(chunks, key=lambda c: c.offset)
    assert all(c.nbytes > 0 for c in chunks)
    for a, b in itertools.pairwise(chunks):
        assert a.end <= b.offset
        assert (base + a.end - 1) // OS_PAGE < (base + b.offset) // OS_PAGE  # no shared OS page
    assert base % OS_PAGE == 0
    assert len(pool._plan.buffers) == len(expected)
    claimed = 0
    for buf, exp in zip(pool._plan.buffers, expected, strict=True):
        assert buf.offset % OS_PAGE == 0
        mine = [c for c in chunks if buf.offset <= c.offset < buf.offset + exp.nbytes]
        if exp.nbytes == 0:
            assert buf.plan is None and mine == []  # zero-element buffers are not registered
            continue
        assert exp.granularity is not None
        assert mine, f"buffer {exp.name} has no chunk"
        assert mine[0].offset == buf.offset
        assert mine[-1].end == buf.offset + exp.nbytes
        for a, b in itertools.pairwise(mine):
            assert a.end == b.offset  # contiguous
        # As large as the limit allows: every chunk but the last is the largest multiple of
        # lcm(granularity, OS page) that fits in chunk_bytes.
        step = math.lcm(exp.granularity, OS_PAGE)
        assert all(c.nbytes == pool.plan.chunk_limit // step * step for c in mine[:-1])
        assert 0 < mine[-1].nbytes <= pool.plan.chunk_limit // step * step
        for c in mine:
            assert c.nbytes <= pool.plan.chunk_limit
            assert (base + c.offset) % OS_PAGE == 0
            assert c.end == buf.offset + exp.nbytes or (base + c.end) % OS_PAGE == 0
            assert (c.offset - buf.offset) % exp.granularity == 0
            assert (c.end - buf.offset) % exp.granularity == 0
        claimed += len(mine)
    assert claimed == len(chunks)  # every chunk lies inside exactly one non-empty buffer
    # Buffers do not overlap in the mapping.
    buffers = zip(pool._plan.buffers, expected, strict=True)
    live = sorted((b.offset, b.offset + e.nbytes) for b, e in buffers if e.nbytes)
    for (_, end), (start, _) in itertools.pairwise(live):
        assert end <= start


def assert_inside_one_chunk(view: torch.Tensor, base: int, starts: list[int], ends: list[int]) -> int:
    assert view.is_contiguous()
    start = view.data_ptr() - base
    nbytes = view.numel() * ITEMSIZE[view.dtype]
    end = start + nbytes
    first = bisect.bisect_right(ends, start)  # first chunk ending after `start`
    last = bisect.bisect_left(starts, end)  # first chunk starting at or after `end`
    assert last - first == 1, f"copy unit [{start}, {end}) overlaps {last - first} chunks"
    assert starts[first] <= start and end <= ends[first]
    return nbytes


def check_layout_in_pool(build: Build, data: st.DataObject) -> None:
    layout, expect = build
    one = expect(1)
    page_bytes = sum(e.nbytes for e in one)
    assert layout.page_bytes == page_bytes
    live = [e for e in one if e.nbytes]
    unit = max(math.lcm(e.granularity, OS_PAGE) for e in live if e.granularity)
    k = data.draw(st.integers(1, 2), label="k")
    # Any byte count >= the largest aligned unit: the pool must round it down per buffer itself.
    chunk_bytes = k * unit + data.draw(st.integers(0, unit - 1), label="chunk_extra")
    chunks_target = data.draw(st.integers(1, 3), label="chunks")
    extra_pages = data.draw(st.integers(1, 3), label="extra_pages")  # >= 1: a boundary inside the biggest buffer
    biggest = max(e.nbytes for e in live)
    num_pages = -(-chunks_target * chunk_bytes // biggest) + extra_pages
    units_per_page = sum(e.units_per_page for e in live)
    if num_pages * units_per_page > MAX_UNITS:
        num_pages = -(-chunk_bytes // biggest) + extra_pages
    budget = num_pages * page_bytes + data.draw(st.integers(0, page_bytes - 1), label="budget_extra")

    fake = FakeRuntime()
    pool = pinpool.PinnedPool(layout=layout, size=budget, chunk_bytes=chunk_bytes, runtime=fake, register_workers=2)
    assert pool.num_pages == num_pages == budget // page_bytes
    assert pool.nbytes == num_pages * page_bytes
    expected = expect(num_pages)

    # (a) shapes and dtype, (b) granularity per buffer, as the pool planned them.
    specs = [b.spec for b in pool._plan.buffers]
    assert [s.name for s in specs] == [e.name for e in expected]
    assert [s.shape for s in specs] == [e.shape for e in expected]
    assert [s.dtype for s in specs] == [e.dtype for e in expected]
    for buf, e in zip(pool._plan.buffers, expected, strict=True):
        if e.nbytes:
            assert e.granularity is not None and buf.plan is not None
            assert buf.spec.granularity == e.granularity
            assert buf.plan.unit == math.lcm(e.granularity, OS_PAGE)
    assert sum(s.nbytes for s in specs) == pool.nbytes

    event(f"chunks: {min(len(pool.plan.chunks), 9)}{'+' if len(pool.plan.chunks) >= 9 else ''}")
    big = max(range(len(expected)), key=lambda i: expected[i].nbytes)
    assert len(pool._plan.buffers[big].chunks) >= 2  # the pool really is split
    with pool as p:
        base = p.data_ptr
        assert_chunk_invariants(p, base, expected)
        assert fake.registered == {base + c.offset: c.nbytes for c in p.plan.chunks}
        tensors = p.tensors
        assert list(tensors) == [e.name for e in expected]
        if len(expected) == 1:
            assert p.tensor is tensors[expected[0].name]
        else:
            with pytest.raises(pinpool.PoolStateError):
                _ = p.tensor
        starts = [c.offset for c in p.plan.chunks]
        ends = [c.end for c in p.plan.chunks]
        # (c) no copy unit straddles two chunks, checked on the tensors the pool hands out.
        for buf, exp in zip(p._plan.buffers, expected, strict=True):
            t = tensors[exp.name]
            assert tuple(t.shape) == exp.shape and t.dtype == exp.dtype and t.is_contiguous()
            if not exp.nbytes:
                assert t.numel() == 0
                continue
            assert t.data_ptr() == base + buf.offset
            covered = 0
            for view in exp.granules(t):
                n = assert_inside_one_chunk(view, base, starts, ends)
                assert n == exp.granularity
                covered += n
            assert covered == exp.nbytes  # the granules tile the buffer
            if exp.blocks is not None:
                for view in exp.blocks(t):
                    assert_inside_one_chunk(view, base, starts, ends)
    assert fake.registered == {}
    assert sorted(fake.unregister_calls) == sorted(ptr for ptr, _ in fake.register_calls)


@pytest.mark.parametrize("case", list(CASES))
@PROPERTY_SETTINGS
@given(data=st.data())
def test_layout_shapes_granularity_and_no_straddle(case: str, data: st.DataObject) -> None:
    check_layout_in_pool(data.draw(CASES[case](), label="layout"), data)


def test_every_family_and_layout_is_covered() -> None:
    assert len(CASES) == 4 + 3 + 2 + 3 + 2 + 3 + 3 + 3


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize(
    ("temporal", "convs", "empty"),
    [
        ((3, 5), ((0, 4), (6, 3)), {"conv0"}),
        ((3, 5), ((6, 3), (2, 0, 2)), {"conv1"}),
        ((0,), ((6, 3),), {"temporal"}),
        ((3, 5), ((0,), (7,), (4, 0)), {"conv0", "conv2"}),
    ],
)
def test_mamba_zero_element_buffer_is_not_registered(
    fake: FakeRuntime, layout: str, temporal: tuple[int, ...], convs: tuple[tuple[int, ...], ...], empty: set[str]
) -> None:
    Lm, it = 2, 4
    mamba = layouts.Mamba(Lm, temporal, convs, torch.float32, layout=layout)
    states = {"temporal": temporal, **{f"conv{i}": c for i, c in enumerate(convs)}}
    slots = {name: Lm * math.prod(shape) * it for name, shape in states.items()}
    assert {name for name, slot in slots.items() if slot == 0} == empty
    assert mamba.page_bytes == sum(slots.values())
    num_pages = 3000
    pool = pinpool.PinnedPool(layout=mamba, size=num_pages * mamba.page_bytes, chunk_bytes=64 * KiB, runtime=fake)
    buffers = {b.spec.name: b for b in pool._plan.buffers}
    assert list(buffers) == list(states)
    for name, b in buffers.items():
        assert b.spec.shape == (num_pages, Lm, 1, *states[name])
        if name in empty:
            assert b.spec.nbytes == 0 and b.plan is None and b.chunks == ()
        else:
            assert b.spec.granularity == slots[name]
            assert b.chunks and all((c.offset - b.offset) % slots[name] == 0 for c in b.chunks)
    # Every chunk lies inside a non-empty buffer; together they cover exactly the non-empty bytes.
    live = [(b.offset, b.offset + b.spec.nbytes) for name, b in buffers.items() if name not in empty]
    assert all(any(lo <= c.offset and c.end <= hi for lo, hi in live) for c in pool.plan.chunks)
    assert sum(c.nbytes for c in pool.plan.chunks) == num_pages * mamba.page_bytes
    with pool as p:
        base = p.data_ptr
        assert fake.registered == {base + c.offset: c.nbytes for c in p.plan.chunks}
        assert len(fake.register_calls) == len(p.plan.chunks) > len(live)
        starts, ends = [c.offset for c in p.plan.chunks], [c.end for c in p.plan.chunks]
        for name in states:
            t = p.tensors[name]
            assert tuple(t.shape) == (num_pages, Lm, 1, *states[name])
            if name in empty:
                assert t.numel() == 0
                continue
            for slot in range(num_pages):
                assert assert_inside_one_chunk(t[slot], base, starts, ends) == slots[name]
    assert fake.registered == {}


# -- SGLang's worked numbers, against pinpool's API --------------------------------------------------


def test_sglang_vector_mla_page_first_direct_granularity_60(fake: FakeRuntime) -> None:
    mla = layouts.MLA("page_first_direct", layer_num=3, page_size=2, kv_cache_dim=5, dtype=torch.float16)
    (spec,) = mla.buffers(7)
    assert spec.granularity == 2 * 3 * 5 * 2 == 60
    assert spec.shape == (7, 3, 2, 1, 5)
    assert mla.page_bytes == 60
    # 60 is not a multiple of the OS page: boundaries fall on lcm(60, 4096) = 61440.
    pool = pinpool.PinnedPool(layout=mla, size=5000 * 60 + 59, chunk_bytes=2 * 61440 + 100, runtime=fake)
    assert pool.num_pages == 5000
    assert pool._plan.buffers[0].plan.unit == 61440
    assert [c.nbytes for c in pool.plan.chunks] == [122880, 122880, 300000 - 2 * 122880]
    assert all(c.offset % 60 == 0 and c.offset % OS_PAGE == 0 for c in pool.plan.chunks)
    assert pool.plan.granularity == 60


@pytest.mark.parametrize("dtype", DTYPES)
def test_sglang_vector_mha_page_first_direct(dtype: torch.dtype) -> None:
    P, L, H, D = 64, 3, 8, 128
    it = ITEMSIZE[dtype]
    mha = layouts.MHA("page_first_direct", L, P, H, D, dtype)
    (spec,) = mha.buffers(4)
    assert spec.name == "kv" and spec.shape == (2, 4, L, P, H, D) and spec.dtype == dtype
    assert spec.granularity == P * L * H * D * it
    assert mha.page_bytes == 2 * P * L * H * D * it


def test_sglang_vector_k_only() -> None:
    P, L, H, D = 16, 2, 4, 64
    for layout, shape, granularity, runs in [
        ("layer_first", (L, 5 * P, H, D), P * H * D * 2, L),  # page i lives in every layer's run
        ("page_first", (5 * P, L, H, D), P * L * H * D * 2, 1),
        ("page_first_direct", (5, L, P, H, D), P * L * H * D * 2, 1),
    ]:
        mha = layouts.MHA(layout, L, P, H, D, torch.bfloat16, k_only=True)
        assert mha.buffers(5) == (layouts.BufferSpec("k", shape, torch.bfloat16, granularity, runs),)
        assert mha.page_bytes == P * L * H * D * 2


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_sglang_vector_asymmetric_k_v(fake: FakeRuntime, layout: str) -> None:
    P, L, H, D, Dv = 32, 2, 4, 192, 128
    mha = layouts.MHA(layout, L, P, H, D, torch.bfloat16, v_head_dim=Dv)
    k, v = mha.buffers(3)
    assert (k.name, v.name) == ("k", "v")
    assert k.granularity == P * L * H * D * 2 and v.granularity == P * L * H * Dv * 2
    if layout == "page_first":
        assert k.shape == (3 * P, L, H, D) and v.shape == (3 * P, L, H, Dv)
    else:
        assert k.shape == (3, L, P, H, D) and v.shape == (3, L, P, H, Dv)
    assert mha.page_bytes == P * L * H * (D + Dv) * 2
    pool = pinpool.PinnedPool(layout=mha, size=40 * mha.page_bytes, chunk_bytes=4 * MiB, runtime=fake)
    assert pool.plan.granularity is None  # two different granularities
    kb, vb = pool._plan.buffers
    assert all((c.offset - kb.offset) % k.granularity == 0 for c in kb.chunks)
    assert all((c.offset - vb.offset) % v.granularity == 0 for c in vb.chunks)


def test_symmetric_v_head_dim_is_one_kv_buffer() -> None:
    mha = layouts.MHA("page_head", 2, 4, 2, 16, torch.float16, v_head_dim=16)
    assert not mha.asymmetric
    (spec,) = mha.buffers(3)
    assert spec.name == "kv" and spec.shape == (2, 3, 2, 4, 2, 16)
    assert spec.page_runs == 2  # K's pages, then V's


def test_sglang_vector_mamba_per_buffer_slot() -> None:
    temporal, convs = (4, 8, 16), ((48, 3), (16, 3))
    mamba = layouts.Mamba(2, temporal, convs, torch.float32)
    assert mamba.layout == "page_first"
    specs = mamba.buffers(10)
    assert [s.name for s in specs] == ["temporal", "conv0", "conv1"]
    for s, state in zip(specs, (temporal, *convs), strict=True):
        assert s.shape == (10, 2, 1, *state)
        assert s.granularity == math.prod(s.shape[1:]) * 4 == 2 * math.prod(state) * 4
    assert mamba.page_bytes == 2 * 4 * (4 * 8 * 16 + 48 * 3 + 16 * 3)


def test_sglang_vector_indexer_stride() -> None:
    P, ihd, qbs, L = 64, 128, 128, 2
    stride = P * (ihd + ihd // qbs * 4)
    assert stride == 8448
    (lf,) = layouts.Indexer("layer_first", L, P, ihd, qbs).buffers(5)
    assert lf == layouts.BufferSpec("index", (L, 5, stride), torch.uint8, stride, L)
    for layout in ("page_first", "page_first_direct"):
        idx = layouts.Indexer(layout, L, P, ihd, qbs)
        assert idx.stride == stride and idx.page_bytes == stride * L
        assert idx.buffers(5) == (layouts.BufferSpec("index", (5, L, 1, stride), torch.uint8, stride * L, 1),)
    # Several scale blocks per head: 4 bytes of fp32 scale per block.
    assert layouts.Indexer("page_first", 1, 2, 64, 16).stride == 2 * (64 + 4 * 4)


def test_sglang_vector_paged_and_state() -> None:
    L, item = 3, 584
    lf = layouts.PagedBytes("layer_first", L, item).buffers(4)
    assert lf == tuple(layouts.BufferSpec(f"layer{i}", (4, item), torch.uint8, item, 1) for i in range(L))
    assert layouts.PagedBytes("page_first", L, item).buffers(4) == (
        layouts.BufferSpec("data", (4, L, item), torch.uint8, L * item, 1),
    )
    assert layouts.PagedBytes("page_first_direct", L, item).buffers(4) == (
        layouts.BufferSpec("data", (4, L, 1, item), torch.uint8, L * item, 1),
    )
    ring, slot = 4, 100
    for layout in ("layer_first", "page_first", "page_first_direct"):
        state = layouts.PagedBytes.state(layout, L, ring, slot)
        assert state.item_bytes == ring * slot
        assert state.page_bytes == L * ring * slot
        grans = {s.granularity for s in state.buffers(2)}
        assert grans == ({ring * slot} if layout == "layer_first" else {L * ring * slot})


@pytest.mark.parametrize("register_workers", [1, None])
def test_sglang_vector_raw_900_900_700(fake: FakeRuntime, register_workers: int | None) -> None:
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(300 * MiB), size=2500 * MiB, chunk_bytes=GiB, runtime=fake, register_workers=register_workers
    )
    assert [c.nbytes for c in pool.plan.chunks] == [900 * MiB, 900 * MiB, 700 * MiB]
    assert [c.offset for c in pool.plan.chunks] == [0, 900 * MiB, 1800 * MiB]
    with pool as p:  # FakeRuntime touches nothing: the 2.5 GiB stay virtual
        base = p.data_ptr
        assert fake.registered == {base: 900 * MiB, base + 900 * MiB: 900 * MiB, base + 1800 * MiB: 700 * MiB}
        assert p.tensor.shape == (2500 * MiB,)
    assert fake.registered == {}


@pytest.mark.anyio
@each_driver
async def test_sglang_vector_teardown_order_and_second_exit(fake: FakeRuntime, mode: str) -> None:
    pool = pinpool.PinnedPool(
        layout=layouts.Raw(), size=2 * GiB + 17, chunk_bytes=GiB, runtime=fake, register_workers=1
    )
    if mode == "async":
        async with pool as p:
            base = p.data_ptr
    else:
        with pool as p:
            base = p.data_ptr
    order = [base + 2 * GiB, base + GiB, base]
    assert fake.unregister_calls == order
    if mode == "async":
        await pool.__aexit__(None, None, None)
    else:
        pool.__exit__(None, None, None)
    assert fake.unregister_calls == order  # the second exit is a no-op: it unregistered nothing


def test_sglang_vector_second_registration_fails() -> None:
    fake = FakeRuntime(fail_register_on=2)
    # The reference does not retry; pinpool would retry a code-2 failure as halves (test_retry.py).
    pool = pinpool.PinnedPool(size=2 * GiB, chunk_bytes=GiB, runtime=fake, register_workers=1, max_retries=0)
    with pytest.raises(pinpool.PinError) as info, pool:
        pytest.fail("the body must not run")
    assert "offset=1073741824" in str(info.value)
    first = fake.register_calls[0]
    assert first[1] == GiB
    assert fake.register_calls[1] == (first[0] + GiB, GiB)
    assert fake.unregister_calls == [first[0]]  # exactly the first chunk
    assert fake.registered == {}


# -- size= is a byte budget of whole pages ------------------------------------------------------------


BUDGET_LAYOUTS = [
    layouts.MHA("page_first", 2, 16, 4, 96, torch.bfloat16),
    layouts.MHA("layer_first", 3, 5, 3, 7, torch.float8_e4m3fn, k_only=True),
    layouts.MHA("page_first_direct", 2, 4, 2, 64, torch.float16, v_head_dim=32),
    layouts.MLA("page_first_direct", 3, 2, 5, torch.float16),
    layouts.Mamba(2, (3, 5), ((0, 2), (7,)), torch.float32),
    layouts.Indexer("layer_first", 2, 3, 48, 16),
    layouts.PagedBytes("layer_first", 3, 1001),
    layouts.PagedBytes.state("page_first", 2, 3, 77),
]


@pytest.mark.parametrize("layout", BUDGET_LAYOUTS, ids=lambda lay: lay.name)
@settings(max_examples=25, deadline=None)
@given(pages=st.integers(1, 5000), extra=st.floats(0, 1, exclude_max=True))
def test_size_buys_the_largest_whole_number_of_pages(layout: layouts.Layout, pages: int, extra: float) -> None:
    budget = pages * layout.page_bytes + int(extra * layout.page_bytes)
    pool = pinpool.PinnedPool(layout=layout, size=budget, runtime=FakeRuntime(), chunk_bytes=64 * MiB)
    assert pool.num_pages == budget // layout.page_bytes == pages
    assert pool.plan.page_bytes == layout.page_bytes
    assert pool.nbytes == pages * layout.page_bytes <= budget < (pages + 1) * layout.page_bytes


@pytest.mark.parametrize(
    ("size", "budget"), [("64MiB", 64 * MiB), ("1.5MiB", 3 * MiB // 2), ("5MB", 5_000_000), (" 2 GiB ", 2 * GiB)]
)
@pytest.mark.parametrize("layout", BUDGET_LAYOUTS, ids=lambda lay: lay.name)
def test_size_strings(fake: FakeRuntime, layout: layouts.Layout, size: str, budget: int) -> None:
    pool = pinpool.PinnedPool(layout=layout, size=size, runtime=fake, chunk_bytes=GiB)
    assert pool.num_pages == budget // layout.page_bytes >= 1
    assert pool.nbytes == pool.num_pages * layout.page_bytes


def test_size_string_pool_shapes(fake: FakeRuntime) -> None:
    mha = BUDGET_LAYOUTS[0]  # page_bytes 2*16*2*4*96*2 = 49152: 64 MiB is 1365 and a third pages
    assert mha.page_bytes == 49152
    pool = pinpool.PinnedPool(layout=mha, size="64MiB", runtime=fake, chunk_bytes="1MiB")
    assert pool.num_pages == 1365
    with pool as p:
        assert p.tensor.shape == (2, 1365 * 16, 2, 4, 96)
        assert p.tensor.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", BUDGET_LAYOUTS, ids=lambda lay: lay.name)
def test_budget_below_one_page_is_a_config_error(layout: layouts.Layout) -> None:
    page = layout.page_bytes
    assert page > 1
    for size in (page - 1, 1, str(page - 1)):
        with pytest.raises(pinpool.ConfigError) as info:
            pinpool.PinnedPool(layout=layout, size=size, runtime=FakeRuntime())
        message = str(info.value)
        assert f"({page} B" in message and repr(layout.name) in message
    exact = pinpool.PinnedPool(layout=layout, size=page, runtime=FakeRuntime())
    assert exact.num_pages == 1


def test_budget_below_one_page_names_the_page_size(fake: FakeRuntime) -> None:
    mla = layouts.MLA("page_first", 61, 64, 576, torch.bfloat16)  # ~4.3 MiB per page
    page = 61 * 64 * 576 * 2
    with pytest.raises(pinpool.ConfigError, match=rf"smaller than one page.*\({page} B = 4\.29 MiB\)") as info:
        pinpool.PinnedPool(layout=mla, size="4MiB", runtime=fake)
    assert "mla/page_first" in str(info.value)


# -- validation ----------------------------------------------------------------------------------------


def choices_of(message: str) -> set[str]:
    """The layout names after 'choose one of'."""
    assert "choose one of" in message, message
    tail = message.split("choose one of", 1)[1].split("(", 1)[0]
    return {part.strip().strip("'") for part in tail.split(",") if part.strip()}


ALL4 = {"layer_first", "page_first", "page_first_direct", "page_head"}
LAYER_AND_PAGE = {"layer_first", "page_first", "page_first_direct"}
PAGE_ONLY = {"page_first", "page_first_direct"}
MHA_ALL = ALL4 | {"page_unified"}  # SGLang 0.5.23 (test_layouts_sglang_0523.py)
MLA_ALL = LAYER_AND_PAGE | {"page_unified", "page_first_kv_split"}

LAYOUT_CTORS: dict[str, tuple[Callable[[object], object], set[str]]] = {
    "MHA": (lambda lay: layouts.MHA(lay, 2, 4, 2, 8, torch.float16), MHA_ALL),
    "MHA-k": (lambda lay: layouts.MHA(lay, 2, 4, 2, 8, torch.float16, k_only=True), LAYER_AND_PAGE),
    "MHA-kv": (lambda lay: layouts.MHA(lay, 2, 4, 2, 8, torch.float16, v_head_dim=4), PAGE_ONLY),
    "MLA": (
        lambda lay: layouts.MLA(
            lay, 2, 4, 8, torch.float16, qk_rope_head_dim=4 if lay == "page_first_kv_split" else None
        ),
        MLA_ALL,
    ),
    "Mamba": (lambda lay: layouts.Mamba(2, (4,), ((3,),), torch.float16, layout=lay), PAGE_ONLY),
    "Indexer": (lambda lay: layouts.Indexer(lay, 2, 4, 16, 8), LAYER_AND_PAGE),
    "PagedBytes": (lambda lay: layouts.PagedBytes(lay, 2, 100), LAYER_AND_PAGE),
    "PagedBytes.state": (lambda lay: layouts.PagedBytes.state(lay, 2, 3, 10), LAYER_AND_PAGE),
}


@pytest.mark.parametrize("family", list(LAYOUT_CTORS))
@pytest.mark.parametrize("bad", ["page_last", "PAGE_FIRST", "", None, 1, "page_first "])
def test_unknown_layout_lists_valid_choices(family: str, bad: object) -> None:
    ctor, valid = LAYOUT_CTORS[family]
    message = config_error(lambda: ctor(bad))
    assert choices_of(message) == valid
    assert repr(bad) in message


@pytest.mark.parametrize("family", list(LAYOUT_CTORS))
def test_every_valid_layout_is_accepted(family: str) -> None:
    ctor, valid = LAYOUT_CTORS[family]
    for lay in valid:
        assert ctor(lay).name.endswith(f"/{lay}")  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("family", "layout", "valid"),
    [
        ("MHA-k", "page_head", LAYER_AND_PAGE),
        ("MHA-kv", "layer_first", PAGE_ONLY),
        ("MHA-kv", "page_head", PAGE_ONLY),
        ("MLA", "page_head", MLA_ALL),
        ("Indexer", "page_head", LAYER_AND_PAGE),
        ("Mamba", "layer_first", PAGE_ONLY),
        ("Mamba", "page_head", PAGE_ONLY),
        ("PagedBytes", "page_head", LAYER_AND_PAGE),
    ],
)
def test_rejected_combinations_list_valid_choices(family: str, layout: str, valid: set[str]) -> None:
    ctor, _ = LAYOUT_CTORS[family]
    message = config_error(lambda: ctor(layout))
    assert choices_of(message) == valid
    assert f"layout={layout!r}" in message


BAD_DIMS = [0, -1, True, False, 1.5, 2.0, "4", None]

DIM_CTORS: dict[str, Callable[[object], object]] = {
    "MHA.layer_num": lambda v: layouts.MHA("page_first", v, 4, 2, 8, torch.float16),
    "MHA.page_size": lambda v: layouts.MHA("page_first", 2, v, 2, 8, torch.float16),
    "MHA.head_num": lambda v: layouts.MHA("page_first", 2, 4, v, 8, torch.float16),
    "MHA.head_dim": lambda v: layouts.MHA("page_first", 2, 4, 2, v, torch.float16),
    "MHA.v_head_dim": lambda v: layouts.MHA("page_first", 2, 4, 2, 8, torch.float16, v_head_dim=v),
    "MLA.layer_num": lambda v: layouts.MLA("page_first", v, 4, 8, torch.float16),
    "MLA.page_size": lambda v: layouts.MLA("page_first", 2, v, 8, torch.float16),
    "MLA.kv_cache_dim": lambda v: layouts.MLA("page_first", 2, 4, v, torch.float16),
    "Mamba.num_mamba_layers": lambda v: layouts.Mamba(v, (4,), ((3,),), torch.float16),
    "Indexer.layer_num": lambda v: layouts.Indexer("page_first", v, 4, 16, 8),
    "Indexer.page_size": lambda v: layouts.Indexer("page_first", 2, v, 16, 8),
    "Indexer.index_head_dim": lambda v: layouts.Indexer("page_first", 2, 4, v, 8),
    "Indexer.quant_block_size": lambda v: layouts.Indexer("page_first", 2, 4, 16, v),
    "PagedBytes.layer_num": lambda v: layouts.PagedBytes("page_first", v, 100),
    "PagedBytes.item_bytes": lambda v: layouts.PagedBytes("page_first", 2, v),
    "PagedBytes.state.ring_size": lambda v: layouts.PagedBytes.state("page_first", 2, v, 10),
    "PagedBytes.state.slot_bytes": lambda v: layouts.PagedBytes.state("page_first", 2, 3, v),
}


@pytest.mark.parametrize(
    ("where", "bad"),
    [
        (where, bad)
        for where in DIM_CTORS
        for bad in BAD_DIMS
        if not (where == "MHA.v_head_dim" and bad is None)  # None is the default: symmetric
    ],
    ids=repr,
)
def test_dims_must_be_positive_ints(where: str, bad: object) -> None:
    message = config_error(lambda: DIM_CTORS[where](bad))
    field_name = where.rsplit(".", 1)[1]
    assert f"{field_name}={bad!r}" in message
    assert "positive int" in message


DTYPE_CTORS: dict[str, Callable[[object], object]] = {
    "MHA": lambda d: layouts.MHA("page_first", 2, 4, 2, 8, d),
    "MLA": lambda d: layouts.MLA("page_first", 2, 4, 8, d),
    "Mamba": lambda d: layouts.Mamba(2, (4,), ((3,),), d),
}


@pytest.mark.parametrize("family", list(DTYPE_CTORS))
@pytest.mark.parametrize("bad", ["float17", "torch.bfloat17", "<f2", "bf17", "Tensor", None, 2, torch.tensor(1.0)])
def test_dtype_must_be_a_torch_dtype_or_its_name(family: str, bad: object) -> None:
    message = config_error(lambda: DTYPE_CTORS[family](bad))
    assert "dtype=" in message and "torch.dtype" in message


def test_numpy_dtype_is_not_a_torch_dtype() -> None:
    numpy = pytest.importorskip("numpy")
    for bad in (numpy.float16, numpy.dtype("float16"), numpy.dtype("uint8")):
        assert "torch.dtype" in config_error(lambda bad=bad: layouts.MHA("page_first", 2, 4, 2, 8, bad))


def test_k_only_with_asymmetric_v_head_dim_is_rejected() -> None:
    message = config_error(lambda: layouts.MHA("page_first", 2, 4, 2, 8, torch.float16, k_only=True, v_head_dim=4))
    assert "k_only" in message and "v_head_dim" in message


def test_k_only_with_any_v_head_dim_is_rejected() -> None:
    # A K-only pool has no V, so v_head_dim makes no sense even when it equals head_dim.
    message = config_error(lambda: layouts.MHA("page_first", 2, 4, 2, 8, torch.float16, k_only=True, v_head_dim=8))
    assert "k_only" in message and "v_head_dim" in message


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_k_only_must_be_a_bool(bad: object) -> None:
    assert f"k_only={bad!r}" in config_error(lambda: layouts.MHA("page_first", 2, 4, 2, 8, torch.float16, k_only=bad))


@pytest.mark.parametrize(("ihd", "qbs"), [(100, 64), (16, 32), (129, 128)])
def test_indexer_head_dim_must_be_a_multiple_of_quant_block(ihd: int, qbs: int) -> None:
    message = config_error(lambda: layouts.Indexer("page_first", 2, 4, ihd, qbs))
    assert f"index_head_dim={ihd}" in message and f"quant_block_size={qbs}" in message
    assert "multiple" in message


@pytest.mark.parametrize(
    ("temporal", "convs", "what"),
    [
        ((4, -1), ((3,),), "temporal_shape"),
        ((4, True), ((3,),), "temporal_shape"),
        ((4, 1.5), ((3,),), "temporal_shape"),
        ("44", ((3,),), "temporal_shape"),
        (4, ((3,),), "temporal_shape"),
        ((4,), ((3, -2),), "conv_shapes[0]"),
        ((4,), ((3,), "ab"), "conv_shapes[1]"),
        ((4,), "abc", "conv_shapes"),
        ((4,), 3, "conv_shapes"),
    ],
)
def test_mamba_shapes_must_be_non_negative_int_tuples(temporal: object, convs: object, what: str) -> None:
    message = config_error(lambda: layouts.Mamba(2, temporal, convs, torch.float16))  # type: ignore[arg-type]
    assert f"{what}=" in message


def test_mamba_with_no_bytes_per_slot_is_rejected() -> None:
    assert "zero" in config_error(lambda: layouts.Mamba(2, (0, 4), ((3, 0),), torch.float16))


# -- tensors: names, multi-buffer access, zero-copy -------------------------------------------------------


MULTI = {
    "mha-kv": (layouts.MHA("page_first", 2, 4, 2, 16, torch.float16, v_head_dim=8), ["k", "v"]),
    "mamba": (
        layouts.Mamba(2, (3, 4), ((5,), (0, 2), (2, 2)), torch.bfloat16),
        ["temporal", "conv0", "conv1", "conv2"],
    ),
    "paged-lf": (layouts.PagedBytes("layer_first", 3, 1000), ["layer0", "layer1", "layer2"]),
    "state-lf": (layouts.PagedBytes.state("layer_first", 2, 2, 300), ["layer0", "layer1"]),
}
SINGLE = {
    "mha": (layouts.MHA("page_head", 2, 4, 2, 16, torch.float32), "kv"),
    "mha-k": (layouts.MHA("layer_first", 2, 4, 2, 16, torch.float8_e4m3fn, k_only=True), "k"),
    "mla": (layouts.MLA("layer_first", 2, 4, 24, torch.bfloat16), "kv"),
    "mamba-one": (layouts.Mamba(1, (8,), (), torch.float32, layout="page_first_direct"), "temporal"),
    "indexer": (layouts.Indexer("page_first_direct", 2, 4, 32, 16), "index"),
    "paged-pf": (layouts.PagedBytes("page_first", 3, 100), "data"),
}


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(MULTI))
async def test_multi_buffer_pool_tensor_is_a_state_error(fake: FakeRuntime, case: str) -> None:
    layout, names = MULTI[case]
    pool = pinpool.PinnedPool(layout=layout, size=300 * KiB, chunk_bytes=MiB, runtime=fake)
    async with pool as p:
        assert list(p.tensors) == names
        with pytest.raises(pinpool.PoolStateError) as info:
            _ = p.tensor
        assert all(name in str(info.value) for name in names)
        assert "pool.tensors[name]" in str(info.value)
        for b in p._plan.buffers:
            assert tuple(p.tensors[b.spec.name].shape) == b.spec.shape


@pytest.mark.anyio
@pytest.mark.parametrize("case", list(SINGLE))
async def test_single_buffer_pool_tensor(fake: FakeRuntime, case: str) -> None:
    layout, name = SINGLE[case]
    pool = pinpool.PinnedPool(layout=layout, size=300 * KiB, chunk_bytes=MiB, runtime=fake)
    async with pool as p:
        assert list(p.tensors) == [name]
        assert p.tensor is p.tensors[name]
        assert p.tensor.data_ptr() == p.data_ptr
    with pytest.raises(pinpool.PoolStateError):
        _ = pool.tensors


@pytest.mark.parametrize("case", [*MULTI, *SINGLE])
def test_tensors_are_zero_copy_views_into_the_pool(fake: FakeRuntime, case: str) -> None:
    layout = MULTI[case][0] if case in MULTI else SINGLE[case][0]
    pool = pinpool.PinnedPool(layout=layout, size=300 * KiB, chunk_bytes=MiB, runtime=fake)
    with pool as p:
        base = p.data_ptr
        for i, b in enumerate(p._plan.buffers):
            t = p.tensors[b.spec.name]
            if t.numel() == 0:
                continue
            addr = base + b.offset
            assert t.data_ptr() == addr
            raw = t.view(-1).view(torch.uint8)
            n = raw.numel()
            assert n == b.spec.nbytes
            # Tensor → memory: first and last bytes, seen through ctypes at pool base + buffer offset.
            raw[:4] = torch.tensor([i + 1, 0xAB, 0xCD, 0xEF], dtype=torch.uint8)
            raw[-3:] = torch.tensor([0x11, 0x22, i + 7], dtype=torch.uint8)
            assert ctypes.string_at(addr, 4) == bytes([i + 1, 0xAB, 0xCD, 0xEF])
            assert ctypes.string_at(addr + n - 3, 3) == bytes([0x11, 0x22, i + 7])
            # Memory → tensor.
            ctypes.memset(addr + 4, 0x5A, 2)
            assert raw[4:6].tolist() == [0x5A, 0x5A]
            if t.dtype in (torch.float16, torch.float32):
                t.view(-1)[0] = 1.5
                fmt = "<e" if t.dtype == torch.float16 else "<f"
                assert ctypes.string_at(addr, struct.calcsize(fmt)) == struct.pack(fmt, 1.5)


def test_buffers_sit_at_page_aligned_offsets_in_one_mapping(fake: FakeRuntime) -> None:
    layout, names = MULTI["mamba"]
    pool = pinpool.PinnedPool(layout=layout, size=300 * KiB, chunk_bytes=MiB, runtime=fake)
    offsets = [b.offset for b in pool._plan.buffers]
    assert offsets[0] == 0 and all(o % OS_PAGE == 0 for o in offsets)
    assert offsets == sorted(offsets)
    with pool as p:
        ptrs = {name: p.tensors[name].data_ptr() for name in names if p.tensors[name].numel()}
        for b in p._plan.buffers:
            if b.spec.nbytes:
                assert ptrs[b.spec.name] == p.data_ptr + b.offset
                assert b.offset + b.spec.nbytes <= lifecycle_of(p).memory.length  # type: ignore[attr-defined]


# -- dtype spellings: one parser for the layouts and --layout-file (issue 34, item 4) --------------------


@pytest.mark.parametrize("spelling", [torch.bfloat16, "bfloat16", "bf16", "torch.bfloat16"], ids=repr)
def test_a_dtype_is_a_torch_dtype_or_its_name(spelling: object) -> None:
    made = layouts.MHA("page_first", 2, 16, 4, 8, spelling)  # type: ignore[arg-type]
    assert made.dtype is torch.bfloat16 and made == layouts.MHA("page_first", 2, 16, 4, 8, torch.bfloat16)
    assert layouts.MLA("page_first", 2, 16, 64, spelling).dtype is torch.bfloat16  # type: ignore[arg-type]
    assert layouts.Dense((2, 4), spelling).dtype is torch.bfloat16  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["bfloat17", "Tensor", "fp4", 2], ids=repr)
def test_a_wrong_dtype_lists_the_spellings(bad: object) -> None:
    message = config_error(lambda: layouts.MHA("page_first", 2, 16, 4, 8, bad))  # type: ignore[arg-type]
    assert message == f"MHA(dtype={bad!r}): must be {layouts.DTYPE_SPELLINGS}"
    assert "bf16" in message and "bfloat16" in message
