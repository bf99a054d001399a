"""The pool plan: `plan_pool` over hand-made HostFacts × Capabilities × PoolOptions, the lazy
chunk and span tables, absurd sizes, host checks, and PinnedPool reading its plan."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
import re
import time
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool import ConfigError, _probe, layouts
from pinpool._host import address_space_bytes, read_mem_available, read_memory_limits
from pinpool._plan import (
    CHUNK_ENV,
    LOOKAHEAD_CHUNKS,
    Chunk,
    ChunkTable,
    CpuQuota,
    HostFacts,
    Order,
    PoolOptions,
    PoolPlan,
    Schedule,
    Span,
    SpanTable,
    check_host,
    plan_pool,
)
from pinpool._types import Capabilities
from pinpool.runtimes import capabilities_of
from pinpool.testing import FakeRuntime, host_facts

from ..conftest import lifecycle_of
from ..depth import depth
from ..depth import runs as depth_runs

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
HUGE = 2 * MiB
MODEL_CHUNKS = 3000  # plans the materialising model may build; larger ones are checked by sampling
FULL_COMPARE = 5000  # tables compared item by item in full; longer ones by sampling

HOST = host_facts(huge_page_size=HUGE, numa_nodes=(0, 1))
CUDA_LIKE = Capabilities(serial_registration=True, exact_ranges=True, retryable_codes=frozenset({2}))
MLOCK_LIKE = Capabilities(locks_on_fault=True, finds_pinned=True)

LAYOUTS: list[layouts.Layout] = [
    layouts.MHA("page_first", 2, 4, 2, 16, torch.float16, v_head_dim=8),
    layouts.Mamba(2, (3, 4), ((5,), (0, 2), (2, 2)), torch.bfloat16),
    layouts.PagedBytes("layer_first", 3, 1000),
    layouts.MHA("page_head", 2, 4, 2, 16, torch.float32),
    layouts.MLA("layer_first", 2, 4, 24, torch.bfloat16),
    layouts.Indexer("page_first_direct", 2, 4, 32, 16),
]


# -- strategies ----------------------------------------------------------------------------------------


hosts = st.builds(
    HostFacts,
    cpus=st.integers(1, 256),
    page_size=st.sampled_from((4096, 16384, 65536)),
    huge_page_size=st.just(HUGE),
    thp_mode=st.sampled_from(("always", "madvise", "madvise", "madvise", "never", None)),
    populate_write=st.booleans(),
    memlock_soft=st.none() | st.integers(0, 2**40),
    memlock_hard=st.none() | st.integers(0, 2**40),
    cap_ipc_lock=st.booleans(),
    cgroup_memory_limit=st.none() | st.integers(0, 2**44),
    mem_available=st.none() | st.integers(0, 2**44),
    hugetlb_free=st.integers(0, 2**16) | st.just(2**32),
    hugetlb_total=st.integers(0, 2**16),
    hugetlb_1g_free=st.integers(0, 2**8) | st.just(2**20),
    hugetlb_1g_total=st.integers(0, 2**8),
    numa_nodes=st.sets(st.integers(0, 7), min_size=1).map(lambda s: tuple(sorted(s))),
    address_space_bytes=st.sampled_from((1 << 39, 1 << 47, 1 << 48)),
    torch_cuda=st.none() | st.just("12.4"),
    torch_hip=st.none() | st.just("6.2"),
    nvidia_driver=st.booleans(),
    amd_kfd=st.booleans(),
    cpu_quota=st.none()
    | st.builds(CpuQuota, quota_us=st.integers(1000, 10**7), period_us=st.integers(1000, 10**6))
    | st.just(CpuQuota()),
)
capabilities = st.builds(
    Capabilities,
    populates=st.booleans(),
    locks_on_fault=st.booleans(),
    finds_pinned=st.booleans(),
    serial_registration=st.booleans(),
    exact_ranges=st.booleans(),
)
workers = st.none() | st.integers(1, 40)


@st.composite
def options_st(draw: st.DrawFn) -> PoolOptions:
    layout = draw(
        st.builds(
            layouts.Raw,
            st.none() | st.integers(1, 4096) | st.integers(1, 2**12).map(lambda k: k * 4096) | st.integers(1, 2**30),
        )
        | st.sampled_from(LAYOUTS)
    )
    big = draw(st.integers(0, 3)) == 0
    # Big pools reach past the address space (2**39..2**48 on the hosts drawn); their chunk size is
    # explicit, so the default split into 1 GiB chunks cannot make the model list 2**18 chunks.
    size = draw(st.integers(2**38, 2**49) if big else st.integers(1, 2**42) | st.integers(1, 2**24))
    limit = draw(
        st.integers(1, 2**40) | st.integers(2**20, 2**38) | st.builds(lambda k: max(1, size // k), st.integers(1, 64))
    )
    # Keep the materialising model cheap: about MODEL_CHUNKS chunks at most (chunk_bytes > limit / 2).
    limit = max(limit, size // MODEL_CHUNKS)
    explicit = big or draw(st.booleans())
    kwargs = {
        "layout": layout, "size": size, "chunk_bytes": limit if explicit else None, "chunk_limit": limit,
        "populate": draw(st.none() | st.booleans()), "populate_workers": draw(workers),
        "register_workers": draw(workers), "unpin_workers": draw(workers),
        "huge_pages": draw(st.sampled_from((False, False, False, True, "hugetlb", "hugetlb:2MiB", "hugetlb:1GiB"))),
        "numa_node": draw(st.one_of(st.none(), st.none(), st.none(), st.integers(0, 8))),
        "background": draw(st.booleans()),
    }  # fmt: skip
    try:
        return PoolOptions(**kwargs)  # type: ignore[arg-type]
    except ConfigError as exc:
        assert "smaller than one page" in str(exc)
        assume(False)
        raise


# -- a materialising model: the constructor's rules as they were, step by step ---------------------------


def reference_chunks(
    nbytes: int, granularity: int | None, limit: int, page: int, start: int, shared: bool = False
) -> tuple[list[int], int]:
    """Chunk offsets and chunk_bytes, listed; raises ConfigError like plan_chunks. ``shared``: the
    runtime tracks exact byte ranges, so where no page-aligned boundary exists the buffer is cut
    from its start (neighbours share the boundary page)."""
    unit = math.lcm(granularity, page) if granularity is not None else page
    if granularity is None and nbytes <= limit:
        return [0], nbytes
    if unit > limit:
        raise ConfigError(f"raise chunk_bytes= or {CHUNK_ENV} to at least {unit} bytes")
    chunk_bytes = limit // unit * unit
    if nbytes <= limit:
        if start % page and not shared:  # cuts from an unaligned start would fall inside pages
            return [0], nbytes
        first = 0
    else:
        # The first multiple of the granularity that ends on a page boundary, searched one by one.
        step, misalignment = granularity or 1, start % page
        found = (b for b in range(0 if not misalignment else step, unit + 1, step) if (misalignment + b) % page == 0)
        first = next(found, None)
        if first is None:
            if not shared:
                raise ConfigError(f"no split of {misalignment} B into a page: give chunk_bytes >= the size")
            first = 0
    if first:
        if first > limit:
            raise ConfigError(f"raise chunk_bytes= or {CHUNK_ENV} to at least {first} bytes")
        head = first + (limit - first) // unit * unit
        return [0, *range(head, nbytes, chunk_bytes)], min(chunk_bytes, nbytes)
    return list(range(0, nbytes, chunk_bytes)), min(chunk_bytes, nbytes)


def reference_spans(chunks: Sequence[Chunk], span_bytes: int) -> Sequence[Span]:
    """Every chunk cut into spans, as the materialised split did; big splits are computed per index."""
    counts = [-(-c.nbytes // span_bytes) for c in chunks]
    if sum(counts) <= FULL_COMPARE:
        return tuple(
            Span(i, offset, min(span_bytes, c.end - offset))
            for i, c in enumerate(chunks)
            for offset in range(c.offset, c.end, span_bytes)
        )
    return _SpansByIndex(chunks, counts, span_bytes)


class _SpansByIndex(Sequence[Span]):
    """The reference split of a big plan, one span at a time (prefix sums of spans per chunk)."""

    def __init__(self, chunks: Sequence[Chunk], counts: list[int], span_bytes: int) -> None:
        self.chunks, self.span_bytes = chunks, span_bytes
        self.starts = [0, *itertools.accumulate(counts)]

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, j):  # type: ignore[no-untyped-def,override]
        if isinstance(j, slice):
            return tuple(self[k] for k in range(*j.indices(len(self))))
        j = j + len(self) if j < 0 else j
        if not 0 <= j < len(self):
            raise IndexError(j)
        i = bisect.bisect_right(self.starts, j) - 1
        c = self.chunks[i]
        offset = c.offset + (j - self.starts[i]) * self.span_bytes
        return Span(i, offset, min(self.span_bytes, c.end - offset))


HUGETLB = {"hugetlb": 2 * MiB, "hugetlb:2MiB": 2 * MiB, "hugetlb:1GiB": GiB}


def model_align(options: PoolOptions, host: HostFacts) -> int:
    """Buffers start on the hugetlb page (2 MiB or 1 GiB), on 2 MiB with THP, else on the OS page."""
    if isinstance(options.huge_pages, str):
        return HUGETLB[options.huge_pages]
    return host.huge_page_size if options.huge_pages else host.page_size


def model_refusal(options: PoolOptions, host: HostFacts, caps: Capabilities) -> str | None:
    """The first host check the options fail (a phrase of its message), else None."""
    if options.numa_node is not None and options.numa_node not in host.numa_nodes:
        return "is not a NUMA node with memory"
    if options.huge_pages is True and host.thp_mode not in ("always", "madvise"):
        return "needs transparent huge pages"
    layout = options.layout
    specs = layout.buffers(options.size // layout.page_bytes)
    align = model_align(options, host)
    mapping = max(sum(-(-s.nbytes // align) * align for s in specs), host.page_size)
    if mapping > host.address_space_bytes:
        return "of address space"
    hugetlb = HUGETLB.get(options.huge_pages, 0) if isinstance(options.huge_pages, str) else 0
    if hugetlb and host.hugetlb_pages(hugetlb)[0] < -(-mapping // hugetlb):
        return "hugetlb pages"
    if options.populate and not caps.populates and not host.populate_write:
        return "needs MADV_POPULATE_WRITE"
    return None


def model_plan(options: PoolOptions, host: HostFacts, caps: Capabilities, start: int) -> dict[str, object]:
    layout = options.layout
    # Chunks on whole hugetlb pages (mlock cannot split one), else on the OS page.
    page = HUGETLB[options.huge_pages] if isinstance(options.huge_pages, str) else host.page_size
    num_pages = options.size // layout.page_bytes
    specs = layout.buffers(num_pages)
    populate = options.populate if options.populate is not None else (caps.populates or host.populate_write)
    if not populate:
        order = Order.REGISTER_ONLY
    elif caps.locks_on_fault and not options.huge_pages:
        order = Order.REGISTER_FIRST
    else:
        order = Order.POPULATE_FIRST
    total = sum(s.nbytes for s in specs)
    by_size = max(1, total // (256 * MiB))
    # The CPU budget: the affinity bounded by whole CPUs of the quota; a background pool leaves one.
    quota = host.cpu_quota
    budget = host.cpus if quota is None or quota.quota_us is None else min(host.cpus, quota.quota_us // quota.period_us)
    budget = max(1, budget)
    cpus = max(1, budget - 1) if options.background else budget
    default_register = 1 if caps.serial_registration else max(1, min(8, cpus))
    wanted_register = options.register_workers or min(by_size, default_register)
    wanted_populate = (options.populate_workers or min(by_size, max(1, min(16, cpus)))) if populate else 0
    align = model_align(options, host)
    limit = options.chunk_limit
    n_workers = max(wanted_register, wanted_populate)
    split = limit
    if options.chunk_bytes is None and n_workers > 1:
        split = min(limit, max(GiB, -(-total // (n_workers * 4))))
    chunks: list[Chunk] = []
    sizes: list[int] = []
    offsets: list[int] = []
    offset = 0
    for spec in specs:
        offsets.append(offset)
        if spec.nbytes:
            unit = math.lcm(spec.granularity or 1, page)
            starts, chunk_bytes = reference_chunks(
                spec.nbytes, spec.granularity, split if split >= unit else limit, page, start, caps.exact_ranges
            )
            ends = [*starts[1:], spec.nbytes]
            chunks += [Chunk(offset + a, b - a) for a, b in zip(starts, ends, strict=True)]
            sizes.append(chunk_bytes)
        offset += -(-spec.nbytes // align) * align
    chunk_bytes = max(sizes, default=0)
    register = max(1, min(wanted_register, len(chunks)))
    span_bytes = 0
    if populate:
        share = -(-chunk_bytes // max(1, wanted_populate))
        span_bytes = -(-min(512 * MiB, max(16 * MiB, share)) // align) * align
    spans = reference_spans(chunks, span_bytes) if populate else ()
    populate_workers = min(wanted_populate, len(spans))
    unpin = max(1, min(options.unpin_workers or max(1, min(8, budget)), len(chunks)))
    threads = populate_workers + register if order is Order.POPULATE_FIRST else max(populate_workers, register)
    grans = {s.granularity for s in specs if s.nbytes}
    return {
        "nbytes": total, "num_pages": num_pages, "page_bytes": layout.page_bytes, "chunk_limit": limit,
        "chunk_bytes": chunk_bytes, "granularity": grans.pop() if len(grans) == 1 else None, "populate": populate,
        "order": order, "register_workers": register, "populate_workers": populate_workers, "unpin_workers": unpin,
        "threads": threads, "span_bytes": span_bytes,
        "lookahead_bytes": max(2 * chunk_bytes, populate_workers * min(span_bytes, chunk_bytes * LOOKAHEAD_CHUNKS)),
        "mapping_bytes": max(offset, host.page_size), "offsets": offsets, "chunks": tuple(chunks), "spans": spans,
    }  # fmt: skip


# -- invariants that hold for every plan, whatever computed it --------------------------------------------


def check_invariants(plan: Schedule, options: PoolOptions, host: HostFacts, caps: Capabilities, start: int) -> None:
    page = host.page_size
    assert plan.page_size == (HUGETLB[options.huge_pages] if isinstance(options.huge_pages, str) else page)
    assert plan.source_start == start
    assert plan.align == model_align(options, host)
    # buffers: in order, aligned, back to back (each padded to the alignment), inside the mapping
    offset = 0
    for b in plan.buffers:
        assert b.offset == offset and b.offset % plan.align == 0
        offset += -(-b.spec.nbytes // plan.align) * plan.align
    assert plan.mapping_bytes == max(offset, page) <= host.address_space_bytes
    assert plan.nbytes == sum(b.spec.nbytes for b in plan.buffers)
    assert plan.num_pages == options.size // options.layout.page_bytes
    # chunks: per buffer contiguous, covering it exactly, boundaries aligned, within the limit
    assert plan.chunks == ChunkTable.concat(b.chunks for b in plan.buffers)
    assert plan.chunks.nbytes == plan.nbytes
    for b in plan.buffers:
        if not b.spec.nbytes:
            assert b.plan is None and len(b.chunks) == 0
            continue
        assert b.plan is not None
        chunks = b.chunks
        assert chunks[0].offset == b.offset and chunks[-1].end == b.offset + b.spec.nbytes
        assert chunks.nbytes == b.spec.nbytes
        for run_offset, nbytes, count in chunks.runs:
            # A caller's unaligned tensor may get a head chunk a little larger than the others.
            assert 0 < nbytes <= plan.chunk_limit and plan.chunk_bytes <= plan.chunk_limit
            assert nbytes <= plan.chunk_bytes or (start and run_offset == b.offset and count == 1)
            if count > 1 or run_offset != b.offset:  # a boundary inside the buffer starts this run
                boundary = run_offset - b.offset
                if b.plan.shared_pages:  # no page-aligned boundary: cut from the start, pages shared
                    assert caps.exact_ranges and start % plan.page_size and boundary % b.plan.unit == 0
                else:  # on the OS page, or on the hugetlb page (mlock cannot split one)
                    assert (start + boundary) % plan.page_size == 0
                if b.spec.granularity is not None:
                    assert boundary % b.spec.granularity == 0
                if start == 0:
                    assert boundary % b.plan.unit == 0
            if count > 1:
                assert nbytes % b.plan.unit == 0  # so every later boundary in the run is aligned too
        for prev, nxt in pairwise(chunks.runs):
            assert prev[0] + prev[1] * prev[2] == nxt[0]  # contiguous
    # workers and threads
    n_chunks, n_spans = len(plan.chunks), len(plan.spans)
    assert 1 <= plan.register_workers <= max(1, n_chunks)
    assert 1 <= plan.unpin_workers <= max(1, n_chunks)
    if options.register_workers is not None:
        assert plan.register_workers == max(1, min(options.register_workers, n_chunks))
    elif caps.serial_registration:
        assert plan.register_workers == 1
    if options.unpin_workers is not None:
        assert plan.unpin_workers == max(1, min(options.unpin_workers, n_chunks))
    if plan.populate:
        assert 1 <= plan.populate_workers <= n_spans or n_spans == 0
        assert plan.span_bytes % plan.align == 0 and plan.span_bytes > 0
        assert 16 * MiB <= plan.span_bytes < 512 * MiB + plan.align
        assert isinstance(plan.spans, SpanTable) and plan.spans.nbytes == plan.nbytes
        if options.populate_workers is not None:
            assert plan.populate_workers == min(options.populate_workers, n_spans)
    else:
        assert plan.populate_workers == 0 and plan.span_bytes == 0 and plan.spans == ()
    if plan.order is Order.POPULATE_FIRST:
        assert plan.threads == plan.populate_workers + plan.register_workers
    else:
        assert plan.threads == max(plan.populate_workers, plan.register_workers)
    # Faulting runs ahead by two chunks, or by a span per worker (a span never crosses a chunk,
    # so with tiny chunks that is LOOKAHEAD_CHUNKS chunks per worker).
    per_worker = min(plan.span_bytes, plan.chunk_bytes * LOOKAHEAD_CHUNKS)
    assert plan.lookahead_bytes == max(2 * plan.chunk_bytes, plan.populate_workers * per_worker)
    # order rules
    expected_populate = options.populate if options.populate is not None else (caps.populates or host.populate_write)
    assert plan.populate is expected_populate
    if not plan.populate:
        assert plan.order is Order.REGISTER_ONLY
    elif caps.locks_on_fault and not options.huge_pages:
        assert plan.order is Order.REGISTER_FIRST
    else:
        assert plan.order is Order.POPULATE_FIRST


def check_sampled(table: Sequence[object], reference: Sequence[object], rng: random.Random) -> None:
    """A lazy table equals its materialised version: by index (negative too) and by slice, and
    whole (forwards and backwards) when it is small enough to list."""
    assert len(table) == len(reference)
    if len(reference) <= FULL_COMPARE:
        assert tuple(table) == tuple(reference) and table == tuple(reference)
        assert list(reversed(table)) == list(reversed(reference))
    for _ in range(20):
        if not reference:
            break
        i = rng.randrange(-len(reference), len(reference))
        assert table[i] == reference[i]
        lo = rng.randrange(-len(reference) - 2, len(reference) + 2)
        hi = lo + rng.randrange(0, 50)
        step = rng.choice((1, 1, 2, 3, -1))
        assert tuple(table[lo:hi:step]) == tuple(reference[lo:hi:step])


# -- the property ---------------------------------------------------------------------------------------


@depth
@settings(
    deadline=None,
    max_examples=depth_runs(80, 250),
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(options=options_st(), host=hosts, caps=capabilities, data=st.data())
@example(  # the reference plan: 900 + 900 + 700 MiB
    options=PoolOptions(size=2500 * MiB, layout=layouts.Raw(300 * MiB), chunk_bytes=GiB, populate=False),
    host=HOST,
    caps=CUDA_LIKE,
    data=None,
)
def test_plan_pool_matches_the_model_and_every_invariant(
    options: PoolOptions, host: HostFacts, caps: Capabilities, data: st.DataObject | None
) -> None:
    start = 0
    if data is not None and data.draw(st.booleans(), label="unaligned"):
        start = data.draw(st.integers(0, host.page_size - 1), label="source_start")
    refusal = model_refusal(options, host, caps)
    try:
        expected = model_plan(options, host, caps, start) if refusal is None else None
    except ConfigError as exc:  # a chunk plan the options cannot satisfy
        event("refused: chunk plan")
        with pytest.raises(ConfigError, match=r"chunk_bytes"):
            plan_pool(options, host, caps, source_start=start)
        assert "chunk_bytes" in str(exc)
        return
    if refusal is not None:
        event(f"refused: {refusal}")
        with pytest.raises(ConfigError, match=refusal):
            plan_pool(options, host, caps, source_start=start)
        return
    assert expected is not None
    plan = plan_pool(options, host, caps, source_start=start)
    event(f"planned: {plan.order.value}, {min(len(plan.chunks), 10)}{'+' if len(plan.chunks) >= 10 else ''} chunks")
    for name in (
        "nbytes", "num_pages", "page_bytes", "chunk_limit", "chunk_bytes", "granularity", "populate", "order",
        "register_workers", "populate_workers", "unpin_workers", "threads", "span_bytes", "lookahead_bytes",
        "mapping_bytes",
    ):  # fmt: skip
        assert getattr(plan, name) == expected[name], name
    assert [b.offset for b in plan.buffers] == expected["offsets"]
    rng = random.Random(0)
    check_sampled(plan.chunks, expected["chunks"], rng)  # type: ignore[arg-type]
    # The model cuts the chunks in offset order; the plan cuts them in the order they are pinned
    # (the pipeline faults them in that order): the same spans, indexed by pin order.
    assert len(plan.spans) == len(expected["spans"])  # type: ignore[arg-type]
    check_sampled(plan.spans, reference_spans(plan.pin_chunks, plan.span_bytes) if plan.populate else (), rng)
    check_invariants(plan, options, host, caps, start)
    assert plan_pool(options, host, caps, source_start=start) == plan  # pure: same inputs, same plan


@depth
@settings(deadline=None, max_examples=depth_runs(15, 50))
@given(
    size=st.integers(2**36, 2**47),
    chunk=st.sampled_from((4096, 65536, 2 * MiB)),
    granularity=st.none() | st.sampled_from((60, 4096, 3 * 4096)),
    caps=capabilities,
)
def test_huge_chunk_counts_are_planned_lazily(
    size: int, chunk: int, granularity: int | None, caps: Capabilities
) -> None:
    """Up to 2**35 chunks: planned in O(1), checked arithmetically and by sampling."""
    options = PoolOptions(
        size=size, layout=layouts.Raw(granularity), chunk_bytes=max(chunk, math.lcm(granularity or 1, 4096))
    )
    started = time.perf_counter()
    plan = plan_pool(options, HOST, caps)
    assert time.perf_counter() - started < 1.0
    check_invariants(plan, options, HOST, caps, 0)
    unit = math.lcm(granularity or 1, 4096)
    assert len(plan.chunks) == -(-size // (options.chunk_limit // unit * unit))
    rng = random.Random(size)
    for _ in range(50):
        i = rng.randrange(len(plan.chunks))
        c = plan.chunks[i]
        assert c.offset == i * plan.chunk_bytes and (i + 1 == len(plan.chunks) or c.nbytes == plan.chunk_bytes)
        assert plan.chunks.index(c) == i and c in plan.chunks
    if plan.populate:
        spans = plan.spans
        for _ in range(50):
            j = rng.randrange(len(spans))
            span = spans[j]
            owner = plan.pin_chunks[span.chunk]
            assert owner.offset <= span.offset and span.offset + span.nbytes <= owner.end
            assert (span.offset - owner.offset) % plan.span_bytes == 0 and 0 < span.nbytes <= plan.span_bytes


# -- the lazy tables ---------------------------------------------------------------------------------------


runs = st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 300), st.integers(0, 400)), max_size=6)


@depth
@settings(deadline=None, max_examples=depth_runs(60, 200))
@given(runs=runs, data=st.data())
def test_chunk_table_behaves_as_the_tuple_of_its_chunks(runs: list[tuple[int, int, int]], data: st.DataObject) -> None:
    reference = tuple(Chunk(o + k * n, n) for o, n, c in runs for k in range(c))
    table = ChunkTable(runs)
    check_sampled(table, reference, random.Random(len(reference)))
    assert ChunkTable.of(reference) == table and hash(table) == hash(reference)
    assert table.nbytes == sum(c.nbytes for c in reference)
    assert table.shifted(4096) == tuple(Chunk(c.offset + 4096, c.nbytes) for c in reference)
    assert ChunkTable.concat([table[:3], table[3:]]) == table
    probe = data.draw(st.sampled_from(reference) if reference else st.just(Chunk(1, 1)))
    assert (probe in table) == (probe in reference)
    assert table.count(probe) == reference.count(probe)
    if probe in reference:
        assert table.index(probe) == reference.index(probe)
    else:
        with pytest.raises(ValueError):
            table.index(probe)
    with pytest.raises(IndexError):
        table[len(reference)]
    with pytest.raises(IndexError):
        table[-len(reference) - 1]
    assert table != list(reference)  # as a tuple: never equal to a list


@depth
@settings(deadline=None, max_examples=depth_runs(60, 200))
@given(
    sizes=st.lists(st.integers(1, 200), max_size=30),
    gaps=st.lists(st.integers(0, 50), max_size=30),
    uniform=st.integers(0, 3000),
    span_bytes=st.integers(1, 64),
)
def test_span_table_equals_the_materialised_split(
    sizes: list[int], gaps: list[int], uniform: int, span_bytes: int
) -> None:
    chunks, offset = [], 0
    for i, size in enumerate(sizes):
        offset += gaps[i] if i < len(gaps) else 0
        chunks.append(Chunk(offset, size))
        offset += size
    chunks += [Chunk(offset + k * 100, 100) for k in range(uniform)]  # one long run
    reference = reference_spans(chunks, span_bytes)
    for source in (chunks, ChunkTable.of(chunks)):
        spans = SpanTable(source, span_bytes)
        check_sampled(spans, reference, random.Random(len(reference)))
        assert spans.nbytes == sum(s.nbytes for s in reference)
        assert spans == SpanTable(ChunkTable.of(chunks), span_bytes)


# -- absurd sizes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size",
    [2**63, "1e30", 2**200, 10**5000, "100PiB", 2**47 + 1],
    ids=["2**63", "1e30", "2**200", "10**5000", "100PiB", "2**47+1"],
)
@pytest.mark.parametrize("runtime", ["auto", "fake"])
def test_absurd_sizes_are_config_errors_at_once(fake: FakeRuntime, size: int | str, runtime: str) -> None:
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="of address space") as info:
        pinpool.PinnedPool(size=size, runtime=fake if runtime == "fake" else runtime)
    assert time.perf_counter() - started < 1.0  # microseconds in practice; bound loose against CI noise
    assert "give a size that fits" in str(info.value)


def test_size_beyond_a_small_address_space_names_it() -> None:
    host = dataclasses.replace(HOST, address_space_bytes=1 << 39)
    options = PoolOptions(size=(1 << 39) + 4096)
    with pytest.raises(ConfigError, match=r"\(512 GiB, its user address space\)"):
        check_host(options, host)
    plan_pool(PoolOptions(size=1 << 38), host, MLOCK_LIKE)  # fits


def test_address_space_bound_per_machine() -> None:
    assert address_space_bytes("x86_64") == 1 << 47
    assert address_space_bytes("aarch64") == 1 << 48
    assert address_space_bytes("riscv64") == 1 << 57


# -- host checks: pure, against HostFacts -------------------------------------------------------------------


def test_host_check_errors() -> None:
    with pytest.raises(ConfigError, match=r"numa_node=3 is not a NUMA node with memory on this host \(nodes: 0, 1\)"):
        plan_pool(PoolOptions(size=MiB, numa_node=3), HOST, MLOCK_LIKE)
    for mode in ("never", None):
        with pytest.raises(ConfigError, match=f"transparent huge pages.*is {mode or 'missing'}"):
            plan_pool(PoolOptions(size=MiB, huge_pages=True), dataclasses.replace(HOST, thp_mode=mode), MLOCK_LIKE)
    with pytest.raises(ConfigError, match=r"needs 5 free 2 MiB hugetlb pages .* has 4 free of 9 reserved"):
        host = dataclasses.replace(HOST, hugetlb_free=4, hugetlb_total=9)
        plan_pool(PoolOptions(size=9 * MiB, huge_pages="hugetlb"), host, MLOCK_LIKE)
    plan_pool(PoolOptions(size=8 * MiB, huge_pages="hugetlb"), dataclasses.replace(HOST, hugetlb_free=4), MLOCK_LIKE)
    old_kernel = dataclasses.replace(HOST, populate_write=False)
    with pytest.raises(ConfigError, match="populate=True needs MADV_POPULATE_WRITE"):
        plan_pool(PoolOptions(size=MiB, populate=True), old_kernel, CUDA_LIKE)
    assert plan_pool(PoolOptions(size=MiB), old_kernel, CUDA_LIKE).populate is False  # default: off there
    faults_itself = Capabilities(populates=True)
    assert plan_pool(PoolOptions(size=MiB, populate=True), old_kernel, faults_itself).populate is True


def test_defaults_follow_capabilities_and_cpus() -> None:
    big = PoolOptions(size=64 * GiB)
    assert plan_pool(big, HOST, CUDA_LIKE).register_workers == 1  # serial registration
    assert plan_pool(big, HOST, MLOCK_LIKE).register_workers == 8
    assert plan_pool(big, dataclasses.replace(HOST, cpus=3), MLOCK_LIKE).register_workers == 3
    assert plan_pool(big, HOST, CUDA_LIKE).order is Order.POPULATE_FIRST
    assert plan_pool(big, HOST, MLOCK_LIKE).order is Order.REGISTER_FIRST
    huge = dataclasses.replace(big, huge_pages=True)
    assert plan_pool(huge, HOST, MLOCK_LIKE).order is Order.POPULATE_FIRST


def test_worker_defaults_follow_the_cpu_quota_not_the_affinity() -> None:
    """A container limited to 1 CPU on an 8-CPU affinity: one worker, not eight (more only spend the
    quota sooner, and the kernel then stalls every thread of the container until the next period)."""
    big = PoolOptions(size=64 * GiB)
    one_cpu = dataclasses.replace(HOST, cpus=8, cpu_quota=CpuQuota(100_000, 100_000, "cgroup v2 cpu.max", "/pod"))
    plan = plan_pool(big, one_cpu, MLOCK_LIKE)
    assert (plan.register_workers, plan.populate_workers, plan.unpin_workers, plan.threads) == (1, 1, 1, 1)
    assert (plan.cpu_budget, plan.cpu_quota) == (1, 1.0)
    # 2.5 CPUs of quota keep two threads busy (rounded down); a background pool leaves the server one.
    two_and_a_half = dataclasses.replace(one_cpu, cpu_quota=CpuQuota(250_000, 100_000))
    assert plan_pool(big, two_and_a_half, MLOCK_LIKE).populate_workers == 2
    background = dataclasses.replace(big, background=True)
    assert plan_pool(background, two_and_a_half, MLOCK_LIKE).populate_workers == 1
    chunked = dataclasses.replace(background, chunk_bytes=GiB)
    assert plan_pool(chunked, two_and_a_half, MLOCK_LIKE).unpin_workers == 2  # a teardown takes the budget
    assert plan_pool(background, one_cpu, MLOCK_LIKE).threads == 1  # never below one
    # Without a quota the affinity is the budget, and a background pool still leaves a CPU.
    assert plan_pool(big, HOST, MLOCK_LIKE).populate_workers == 8
    assert plan_pool(background, HOST, MLOCK_LIKE).populate_workers == 7
    # Explicit worker counts are the caller's: the budget bounds only the defaults.
    assert plan_pool(dataclasses.replace(big, populate_workers=4), one_cpu, MLOCK_LIKE).populate_workers == 4


def test_a_background_pool_under_a_quota_below_two_cpus_pins_at_half_of_it() -> None:
    """No whole CPU to leave the server: the one pin worker rests, and uses half the quota."""
    background = PoolOptions(size=64 * GiB, background=True)
    one_cpu = dataclasses.replace(HOST, cpu_quota=CpuQuota(100_000, 100_000))
    assert plan_pool(background, one_cpu, MLOCK_LIKE).duty_cycle == 0.5
    assert plan_pool(dataclasses.replace(background, background=False), one_cpu, MLOCK_LIKE).duty_cycle == 1.0
    two_cpus = dataclasses.replace(HOST, cpu_quota=CpuQuota(200_000, 100_000))
    assert plan_pool(background, two_cpus, MLOCK_LIKE).duty_cycle == 1.0  # one worker, one CPU left
    assert plan_pool(background, HOST, MLOCK_LIKE).duty_cycle == 1.0  # no quota: nothing throttles
    explicit = dataclasses.replace(background, populate_workers=2)
    assert plan_pool(explicit, one_cpu, MLOCK_LIKE).duty_cycle == 1.0  # the caller sized it


# -- options -------------------------------------------------------------------------------------------------


def test_options_create_parses_and_the_constructor_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, "2")
    options = PoolOptions.create(size="1GiB")
    assert (options.size, options.chunk_bytes, options.chunk_limit) == (GiB, None, 2 * GiB)
    assert isinstance(options.layout, layouts.Raw)
    explicit = PoolOptions.create(size=GiB, chunk_bytes="64MiB")
    assert explicit.chunk_bytes == explicit.chunk_limit == 64 * MiB
    assert PoolOptions(size=GiB, chunk_bytes=MiB).chunk_limit == MiB
    bad: list[tuple[dict[str, object], str]] = [
        ({"name": ""}, "name=''"), ({"populate": 1}, "populate=1"), ({"huge_pages": "thp"}, "huge_pages='thp'"),
        ({"register_workers": 0}, "register_workers=0"), ({"unpin_workers": True}, "unpin_workers=True"),
        ({"numa_node": "0"}, "numa_node='0'"), ({"layout": object()}, "is not a layout"),
        ({"chunk_limit": 0}, "chunk_limit=0"), ({"size": "1GiB"}, "PoolOptions.create"),
    ]  # fmt: skip
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message):
            PoolOptions(**{"size": GiB, **kwargs})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"size='1KiB' \(1024 B\) is smaller than one page"):
        PoolOptions.create(size="1KiB", layout=layouts.Raw(granularity_bytes=MiB))
    with pytest.raises(ConfigError, match="size='lots'"):
        PoolOptions.create(size="lots")


# -- PinnedPool and pin() read the plan ---------------------------------------------------------------------


# What users act on (docs/quickstart.md, "What a pool tells you"); the schedule stays internal.
PLAN_ATTRIBUTES = (
    "nbytes", "num_pages", "page_bytes", "chunks", "chunk_bytes", "chunk_limit", "granularity", "order",
    "populate", "huge_pages", "numa_node", "register_workers", "populate_workers", "unpin_workers", "threads",
    "transfers", "reservation",
)  # fmt: skip


def test_pool_plan_is_the_user_sized_plan_and_read_only(fake: FakeRuntime) -> None:
    pool = pinpool.PinnedPool(size=64 * MiB, chunk_bytes=4 * MiB, runtime=fake, name="p", registry=None)
    plan = plan_pool(lifecycle_of(pool).options, _probe.probe_host(), capabilities_of(fake))
    assert type(pool.plan) is PoolPlan and pool.plan == plan.public and pool.plan is pool.plan
    assert tuple(f.name for f in dataclasses.fields(pool.plan)) == PLAN_ATTRIBUTES
    for name in PLAN_ATTRIBUTES:
        assert getattr(pool.plan, name) == getattr(plan, name), name
        with pytest.raises(AttributeError):
            setattr(pool.plan, name, 1)
    for internal in ("spans", "span_bytes", "lookahead_bytes", "pin_chunks", "page_runs", "buffers", "align"):
        assert not hasattr(pool.plan, internal), internal
    with pytest.raises(AttributeError):
        pool.plan = plan.public  # type: ignore[misc]
    assert (pool.name, pool.runtime, pool.layout) == ("p", fake, layouts.Raw())
    assert isinstance(pool.plan.chunks, ChunkTable) and len(pool.plan.chunks) == 16
    assert pool._plan == plan  # the pool pins by the schedule its public plan came from
    with pool:
        assert fake.registered == {pool.data_ptr + c.offset: c.nbytes for c in pool.plan.chunks}


def test_the_docs_name_the_fields_of_pool_plan_and_no_other() -> None:
    root = Path(__file__).parents[2]
    docs = [root / "README.md", *(p for p in (root / "docs").rglob("*.md") if p.name != "changelog.md")]
    named = {name for path in docs for name in re.findall(r"pool\.plan\.(\w+)", path.read_text())}
    assert named <= set(PLAN_ATTRIBUTES), "docs name fields pool.plan does not have"
    quickstart = set(re.findall(r"pool\.plan\.(\w+)", (root / "docs" / "quickstart.md").read_text()))
    assert set(PLAN_ATTRIBUTES) - {"nbytes", "num_pages"} <= quickstart  # those two: pool.nbytes, pool.num_pages


def test_pin_plans_from_the_tensor_start(fake: FakeRuntime) -> None:
    storage = torch.empty(3 * MiB, dtype=torch.uint8)
    page = _probe.probe_host().page_size
    skew = (-storage.data_ptr() + 100) % page  # start 100 B into a page
    tensor = storage[skew : skew + 2 * MiB]
    pinned = pinpool.pin(tensor, chunk_bytes=MiB, runtime=fake, registry=None)
    assert pinned._plan.source_start == tensor.data_ptr() % page == 100
    assert all((tensor.data_ptr() + c.offset) % page == 0 for c in pinned.plan.chunks[1:])
    assert pinned.plan.chunks.nbytes == 2 * MiB


def test_construction_is_constant_time_in_the_chunk_count(fake: FakeRuntime) -> None:
    started = time.perf_counter()
    pool = pinpool.PinnedPool(size=100 * TiB, chunk_bytes=4096, runtime=fake, registry=None)
    assert time.perf_counter() - started < 1.0
    assert len(pool.plan.chunks) == 100 * TiB // 4096
    assert pool.plan.chunks[-1] == Chunk(100 * TiB - 4096, 4096)


# -- host facts -------------------------------------------------------------------------------------------


def test_probe_reads_this_host() -> None:
    facts = _probe.probe_host()
    assert facts.cpus >= 1 and facts.page_size >= 4096 and facts.huge_page_size == HUGE
    assert facts.numa_nodes and facts.address_space_bytes >= 1 << 39
    assert facts.mem_available is None or facts.mem_available > 0
    assert dataclasses.replace(facts) == facts  # a plain value


def test_cgroup_limits_v1_v2_and_ancestors(tmp_path: Path) -> None:
    root = tmp_path / "sys" / "fs" / "cgroup"  # a tree laid out like /, read by read_memory_limits(tmp_path)
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "memory.max").write_text("1073741824\n")
    (root / "a" / "b" / "memory.max").write_text("max\n")
    proc = tmp_path / "proc" / "self" / "cgroup"
    proc.parent.mkdir(parents=True)
    proc.write_text("0::/a/b\n")

    def cgroup_memory_limit() -> int | None:
        return read_memory_limits(str(tmp_path)).cgroup_limit_bytes

    assert cgroup_memory_limit() == GiB  # the parent's limit binds
    (root / "memory" / "x").mkdir(parents=True)
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("536870912\n")
    proc.write_text("4:memory:/x\n0::/a/b\n")
    assert cgroup_memory_limit() == 512 * MiB
    (root / "memory" / "x" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1 "unlimited"
    proc.write_text("4:memory:/x\n")
    assert cgroup_memory_limit() is None
    proc.unlink()  # no /proc/self/cgroup
    assert cgroup_memory_limit() is None
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:   2048 kB\n")
    assert read_mem_available(str(meminfo)) == 2 * MiB
