"""pinpool.pin() on ordinary torch tensors: boundaries shared inside OS pages where no page-aligned
multiple of the granularity exists (exact-range runtimes; mlock counts its shared pages), the
page-aligned allocator ``empty``, and a pinned tensor's storage kept and guarded while pinned."""

from __future__ import annotations

import gc
import itertools
import math
import threading

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pinpool
from pinpool import layouts
from pinpool._host import TensorMemory, alias_of
from pinpool._host import libc as _libc
from pinpool._plan import Chunk, ChunkPlan, plan_chunks, retry_splitter
from pinpool._pool import empty
from pinpool._ranges import PINNED_RANGES
from pinpool.runtimes import SHARED_PAGES, MlockRuntime
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, needs_mlock

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = _libc.PAGE_SIZE

pytestmark = pytest.mark.anyio


def tensor_at(nbytes: int, misalignment: int) -> torch.Tensor:
    """``nbytes`` of an ordinary torch allocation, starting ``misalignment`` B into an OS page."""
    backing = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = (-backing.data_ptr()) % PAGE + misalignment
    return backing[start : start + nbytes]


def pages_of(ranges: dict[int, int]) -> int:
    """Bytes of the OS pages the ranges touch, each page once (what VmLck counts)."""
    pages = set()
    for ptr, nbytes in ranges.items():
        pages.update(range(ptr // PAGE, -(-(ptr + nbytes) // PAGE)))
    return len(pages) * PAGE


def sizes(chunks: object) -> list[int]:
    return [c.nbytes for c in chunks]  # type: ignore[attr-defined]


# -- item 2: the reference vector on an ordinary torch.empty buffer -----------------------------------------


@each_driver
async def test_reference_vector_on_a_torch_empty_buffer(fake: FakeRuntime, mode: str) -> None:
    """2.5 GiB, 300 MiB copy pages, 1 GiB calls: 900 + 900 + 700 MiB, as on page-aligned memory."""
    t = torch.empty(2500 << 20, dtype=torch.uint8)  # torch's allocator: 64 B into an OS page (glibc mmap)
    pinned = pinpool.pin(t, granularity_bytes=300 << 20, chunk_bytes="1GiB", runtime=fake, registry=None)
    assert sizes(pinned.plan.chunks) == [900 * MiB, 900 * MiB, 700 * MiB]
    plan = pinned._plan.buffers[0].plan
    assert plan is not None and plan.shared_pages == (t.data_ptr() % PAGE != 0)
    if mode == "async":
        async with pinned as p:
            registered = dict(fake.registered)
    else:
        with pinned as p:
            registered = dict(fake.registered)
    assert p.plan.granularity == 300 << 20
    assert registered == {t.data_ptr() + c.offset: c.nbytes for c in pinned.plan.chunks}
    assert fake.registered == {} and t.data_ptr() not in PINNED_RANGES.snapshot()


def test_the_same_vector_refuses_on_a_runtime_that_pins_whole_pages() -> None:
    t = tensor_at(2500 << 20, 64)
    with pytest.raises(pinpool.ConfigError, match="does not track registrations by exact byte range"):
        pinpool.pin(t, granularity_bytes=300 << 20, chunk_bytes="1GiB", runtime=FakeRuntime(exact_ranges=False))


class _Recording(MlockRuntime):
    """mlock, checking after every call that VmLck is exactly the pages of what is registered."""

    def __init__(self, baseline: int) -> None:
        super().__init__()
        self.baseline = baseline
        self.checked = 0
        self.shared_page_outlived_neighbour = False

    def _check(self) -> None:
        registered = self.registered
        assert locked_bytes() - self.baseline == pages_of(registered)
        self.checked += 1

    def register(self, ptr: int, nbytes: int) -> None:
        super().register(ptr, nbytes)
        self._check()

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        super().lock_on_fault(ptr, nbytes)
        self._check()

    def unregister(self, ptr: int) -> None:
        nbytes = self.registered[ptr]
        super().unregister(ptr)
        self._check()
        # a page this chunk shared with a neighbour still registered stays locked (checked above)
        edges = {ptr - ptr % PAGE, (ptr + nbytes) - (ptr + nbytes) % PAGE}
        if any(SHARED_PAGES.holders(page) for page in edges):
            self.shared_page_outlived_neighbour = True


@needs_mlock
@pytest.mark.parametrize("populate", [True, False])
@pytest.mark.parametrize("misalignment", [64, 1, PAGE - 1])
def test_shared_pages_under_mlock_keep_vmlck_exact(populate: bool, misalignment: int, vmlck_baseline: int) -> None:
    """The 900/900/700 shape at 1/100 scale, locked for real: at every step VmLck is the pages of
    the chunks registered (a shared page counted once, kept while either neighbour holds it)."""
    t = tensor_at(25 * MiB, misalignment)
    t.fill_(7)
    runtime = _Recording(vmlck_baseline)
    pinned = pinpool.pin(
        t, granularity_bytes=3 * MiB, chunk_bytes=10 * MiB, runtime=runtime, populate=populate,
        register_workers=1, populate_workers=1, unpin_workers=1, registry=None,
    )  # fmt: skip
    assert sizes(pinned.plan.chunks) == [9 * MiB, 9 * MiB, 7 * MiB]
    with pinned as p:
        # every page the tensor touches is locked: its size in pages plus one (it starts mid-page)
        assert locked_bytes() - vmlck_baseline == (25 * MiB // PAGE + 1) * PAGE
        boundaries = [t.data_ptr() + c.offset for c in p.plan.chunks[1:]]
        assert [SHARED_PAGES.holders(b - b % PAGE) for b in boundaries] == [2, 2]  # each page held by both
        assert int(p.tensor.sum()) == 7 * 25 * MiB
    assert runtime.checked == 6 and runtime.shared_page_outlived_neighbour
    assert locked_bytes() == vmlck_baseline
    assert runtime.registered == {} and t.data_ptr() not in PINNED_RANGES.snapshot()
    assert all(SHARED_PAGES.holders(page) == 0 for page in range(t.data_ptr() - PAGE, t.data_ptr() + 26 * MiB, PAGE))
    assert int(t.sum()) == 7 * 25 * MiB  # the caller's bytes, intact


@needs_mlock
def test_mlock_counts_a_page_two_registrations_share(vmlck_baseline: int) -> None:
    t = tensor_at(4 * PAGE, 0)
    base = t.data_ptr()
    runtime, other = MlockRuntime(), MlockRuntime()  # one table for the process: runtimes share it
    runtime.register(base, PAGE + 100)  # pages 0 (whole) and 1 (in part)
    other.register(base + PAGE + 100, 2 * PAGE)  # pages 1 (in part), 2 (whole) and 3 (in part)
    assert locked_bytes() - vmlck_baseline == 4 * PAGE
    assert SHARED_PAGES.holders(base + PAGE) == 2
    runtime.unregister(base)
    assert locked_bytes() - vmlck_baseline == 3 * PAGE  # page 1 stays: `other` holds it
    assert SHARED_PAGES.holders(base + PAGE) == 1
    with pytest.raises(pinpool.RuntimeCallError, match="already locked"):
        other.register(base + PAGE + 100, 1)  # a byte of its own range: refused, nothing changes
    assert SHARED_PAGES.holders(base + PAGE) == 1
    other.unregister(base + PAGE + 100)
    assert locked_bytes() == vmlck_baseline
    assert SHARED_PAGES.holders(base + PAGE) == SHARED_PAGES.holders(base + 3 * PAGE) == 0


@needs_mlock
def test_a_failed_mlock_of_a_shared_page_undoes_the_whole_registration(
    monkeypatch: pytest.MonkeyPatch, vmlck_baseline: int
) -> None:
    t = tensor_at(4 * PAGE, 64)
    real = _libc.mlock

    def mlock(address: int, length: int) -> int:
        return 11 if length == PAGE else real(address, length)  # EAGAIN on the page-sized calls

    monkeypatch.setattr(_libc, "mlock", mlock)
    runtime = MlockRuntime()
    with pytest.raises(pinpool.RuntimeCallError) as info:
        runtime.register(t.data_ptr(), 3 * PAGE)
    assert info.value.reason == "EAGAIN" and runtime.registered == {}
    assert locked_bytes() == vmlck_baseline
    assert SHARED_PAGES.holders(t.data_ptr() - 64) == 0


# -- item 2: the planning property ------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    nbytes=st.integers(1, 1 << 28),
    granularity=st.one_of(st.none(), st.sampled_from([1, 60, 64, 1000, PAGE, 2 * PAGE, 3 * PAGE, 300 * PAGE, 2 * MiB])),
    start=st.one_of(st.integers(0, PAGE - 1), st.just(64)),
    limit_units=st.integers(1, 40),
    slack=st.integers(0, PAGE),
)
@example(nbytes=2500 * MiB, granularity=300 * MiB, start=64, limit_units=3, slack=124 * MiB)  # 900/900/700
def test_shared_boundary_plans_stay_on_copy_pages_and_never_register_a_byte_twice(
    nbytes: int, granularity: int | None, start: int, limit_units: int, slack: int
) -> None:
    unit = math.lcm(granularity or 1, PAGE)
    limit = limit_units * unit + slack
    limit = max(limit, unit * -(-nbytes // (2000 * unit)))  # at most ~2000 chunks: each is registered below
    plan = plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=PAGE, start=start,
                       shared_boundary_pages=True)  # fmt: skip
    chunks = list(plan.chunks)
    # cover the tensor exactly, contiguous, each within the limit
    assert chunks[0].offset == 0 and chunks[-1].end == nbytes
    assert all(a.end == b.offset for a, b in itertools.pairwise(chunks))
    assert all(0 < c.nbytes <= limit for c in chunks)
    # every boundary a copy-page multiple from the tensor's start (and a page multiple from it)
    for c in chunks[1:]:
        assert c.offset % (granularity or 1) == 0
        if plan.shared_pages:
            assert c.offset % unit == 0
        else:
            assert (start + c.offset) % PAGE == 0
    # plans that were possible before are unchanged: sharing only where no aligned boundary exists
    try:
        strict: ChunkPlan | None = plan_chunks(
            nbytes, granularity=granularity, limit=limit, page_size=PAGE, start=start
        )
    except pinpool.ConfigError:
        strict = None
        assert plan.shared_pages and start % PAGE
    if strict is not None and (not start % PAGE or nbytes > limit):
        assert strict.chunks == plan.chunks and not plan.shared_pages
    # no byte registered twice: a fake with CUDA's books takes every chunk at its real address
    base = (1 << 40) + start
    fake = FakeRuntime()
    for c in chunks:
        fake.register(base + c.offset, c.nbytes)
    assert sum(fake.registered.values()) == nbytes
    for c in chunks:
        fake.unregister(base + c.offset)
    assert fake.registered == {}
    # without exact ranges, whatever is planned shares no page (the strict fake pins whole pages)
    if strict is not None:
        whole_pages = FakeRuntime(exact_ranges=False)
        for c in strict.chunks:
            whole_pages.register(base + c.offset, c.nbytes)


def test_page_aligned_memory_plans_exactly_as_before() -> None:
    """Own pool memory (start 0) gets the same plan whatever the runtime declares."""
    for nbytes, granularity, limit in [(2500 * MiB, 300 * MiB, GiB), (10 * GiB, 60, GiB), (1000 * KiB, 300 * KiB, MiB)]:
        shared = plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=PAGE, shared_boundary_pages=True)
        plain = plan_chunks(nbytes, granularity=granularity, limit=limit, page_size=PAGE)
        assert shared == plain and not shared.shared_pages and shared.origin == 0


def test_an_unaligned_buffer_within_one_call_is_not_cut_inside_a_page_without_exact_ranges() -> None:
    """Fits one call, but chunk_bytes (whole units) is smaller: page-aligned memory is cut from its start,
    as the reference does; unaligned memory is cut there only where neighbours may share a page."""
    kwargs = {"granularity": 300 * KiB, "limit": MiB, "page_size": PAGE}
    assert sizes(plan_chunks(1000 * KiB, **kwargs).chunks) == [900 * KiB, 100 * KiB]  # type: ignore[arg-type]
    assert sizes(plan_chunks(1000 * KiB, start=64, **kwargs).chunks) == [1000 * KiB]  # type: ignore[arg-type]
    shared = plan_chunks(1000 * KiB, start=64, shared_boundary_pages=True, **kwargs)  # type: ignore[arg-type]
    assert sizes(shared.chunks) == [900 * KiB, 100 * KiB] and shared.shared_pages


def test_retries_cut_a_shared_page_plan_on_its_own_grid() -> None:
    t = tensor_at(64 * MiB, 64)
    fake = FakeRuntime(fail_register_larger_than=10 * MiB)
    pinned = pinpool.pin(t, granularity_bytes=PAGE, chunk_bytes=32 * MiB, runtime=fake, populate=False,
                         min_chunk_bytes=MiB, registry=None)  # fmt: skip
    splitter = retry_splitter(pinned._plan, MiB)
    halves = splitter.split(Chunk(0, 32 * MiB))
    assert halves == (Chunk(0, 16 * MiB), Chunk(16 * MiB, 16 * MiB))
    with pinned as p:
        got = sorted(fake.registered.items())
        assert p.stats.retries > 0
    assert all((ptr - t.data_ptr()) % PAGE == 0 for ptr, _ in got)  # multiples of the copy page from the start
    assert sum(n for _, n in got) == 64 * MiB and fake.registered == {}


def test_fake_runtime_without_exact_ranges_refuses_a_shared_page() -> None:
    fake = FakeRuntime(exact_ranges=False)
    assert not fake.capabilities.exact_ranges
    fake.register(1 << 30, PAGE + 64)
    with pytest.raises(pinpool.RuntimeCallError, match="shares an OS page") as info:
        fake.register((1 << 30) + PAGE + 64, PAGE)
    assert info.value.code == 712 and fake.registered == {1 << 30: PAGE + 64}
    fake.register((1 << 30) + 2 * PAGE, PAGE)  # the next whole page is fine
    fake.unregister(1 << 30)
    fake.register((1 << 30) + PAGE + 64, 100)  # and the page is free again once its holder is gone
    exact = FakeRuntime()
    exact.register(1 << 30, PAGE + 64)
    exact.register((1 << 30) + PAGE + 64, PAGE)  # CUDA's books: adjacent bytes may share a page
    with pytest.raises(pinpool.ConfigError, match="exact_ranges"):
        FakeRuntime(exact_ranges=1)  # type: ignore[arg-type]


# -- item 2: the page-aligned allocator -------------------------------------------------------------------------


def test_empty_is_page_aligned_like_torch_empty() -> None:
    t = empty(3, 1024, 1000, dtype=torch.float16)
    assert t.data_ptr() % PAGE == 0 and t.data_ptr() % 4096 == 0
    assert t.shape == (3, 1024, 1000) and t.dtype == torch.float16 and t.device.type == "cpu"
    assert t.is_contiguous() and int(t.count_nonzero()) == 0  # fresh anonymous memory reads as zeros
    t[2, 1023, 999] = 5.0
    assert float(t[2, 1023, 999]) == 5.0
    assert empty((2, 3)).shape == (2, 3) and empty(torch.Size([4])).dtype == torch.get_default_dtype()
    assert empty(0, 5).shape == (0, 5) and empty().shape == ()
    for bad in [("2",), (-1,), (2.5,), (True,), ([1, "x"],)]:
        with pytest.raises(pinpool.ConfigError):
            empty(*bad)  # type: ignore[arg-type]
    with pytest.raises(pinpool.ConfigError, match=r"torch\.dtype"):
        empty(4, dtype="float32")  # type: ignore[arg-type]
    with pytest.raises(pinpool.ConfigError, match="huge_pages"):
        empty(4, huge_pages="thp")
    with pytest.raises(pinpool.ConfigError, match="numa_node"):
        empty(4, numa_node=-1)


def test_empty_memory_is_unmapped_with_its_last_view() -> None:
    t = empty(8 * MiB, dtype=torch.uint8)
    view = t[MiB:]
    owner = t.untyped_storage()
    del t
    gc.collect()
    view.fill_(1)  # still mapped: the view holds it
    assert int(view[-1]) == 1
    del view, owner
    gc.collect()


def test_pin_of_empty_keeps_the_page_aligned_plan(fake: FakeRuntime) -> None:
    """The reference vector on pinpool.empty memory: exactly PinnedPool's own plan, nothing shared."""
    t = empty(2500 << 20, dtype=torch.uint8)
    pinned = pinpool.pin(t, granularity_bytes=300 << 20, chunk_bytes="1GiB", runtime=fake, registry=None)
    pool = pinpool.PinnedPool(layout=layouts.Raw(300 << 20), size=2500 << 20, chunk_bytes="1GiB",
                              runtime=FakeRuntime(), registry=None)  # fmt: skip
    assert pinned.plan.chunks == pool.plan.chunks and sizes(pinned.plan.chunks) == [900 * MiB, 900 * MiB, 700 * MiB]
    plan = pinned._plan.buffers[0].plan
    assert plan is not None and not plan.shared_pages and pinned._plan.source_start == 0
    # and on a runtime that pins whole pages, where a torch.empty buffer is refused
    strict = pinpool.pin(t, granularity_bytes=300 << 20, chunk_bytes="1GiB", runtime=FakeRuntime(exact_ranges=False))
    with strict:
        assert all((t.data_ptr() + c.offset) % PAGE == 0 for c in strict.plan.chunks)


@needs_mlock
def test_pin_of_empty_under_mlock(vmlck_baseline: int) -> None:
    t = empty(4, 4 * MiB, dtype=torch.uint8)
    with pinpool.pin(t, runtime="mlock", granularity_bytes=4 * MiB, chunk_bytes=8 * MiB) as p:
        assert locked_bytes() - vmlck_baseline == 16 * MiB  # not one page more: it starts on a page
        assert sizes(p.plan.chunks) == [8 * MiB, 8 * MiB]
    assert locked_bytes() == vmlck_baseline


# -- item 3: the pinned tensor's storage is held, and guarded, while pinned ------------------------------------------


def _cdata(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _change(t: torch.Tensor, how: str) -> None:
    if how == "resize_(0)":
        t.resize_(0)
    elif how == "set_()":
        t.set_()
    elif how == "resize_(larger)":
        with pytest.raises(RuntimeError, match="not resizable"):
            t.resize_(t.numel() * 4)  # would reallocate and free the pinned bytes: refused
    elif how == "storage.resize_(0)":
        with pytest.raises(RuntimeError, match="not resizable"):
            t.untyped_storage().resize_(0)
    else:
        raise AssertionError(how)


CHANGES = ["resize_(0)", "set_()", "resize_(larger)", "storage.resize_(0)"]


@pytest.mark.parametrize("how", CHANGES)
@each_driver
async def test_changing_the_tensor_inside_the_block_never_frees_pinned_memory(
    fake: FakeRuntime, how: str, mode: str
) -> None:
    t = torch.empty(8 * MiB, dtype=torch.uint8)
    t.fill_(3)
    own, address = _cdata(t), t.data_ptr()
    pinned = pinpool.pin(t, runtime=fake, chunk_bytes=2 * MiB, registry=None)
    if mode == "async":
        async with pinned as p:
            _change(t, how)
            gc.collect()
            assert int(p.tensor[:4096].sum()) == 3 * 4096  # the pinned bytes are still there
    else:
        with pinned as p:
            _change(t, how)
            gc.collect()
            assert int(p.tensor[:4096].sum()) == 3 * 4096
    assert fake.registered == {} and address not in PINNED_RANGES.snapshot()
    assert sorted(fake.unregister_calls) == sorted(address + c.offset for c in pinned.plan.chunks)  # the original bytes
    if how != "set_()":  # the tensor has its own storage back, resizable again
        assert _cdata(t) == own and t.untyped_storage().resizable()
        t.resize_(16 * MiB)


@needs_mlock
@pytest.mark.parametrize("how", [*CHANGES, "del"])
def test_changing_the_tensor_under_mlock_unlocks_everything(how: str, vmlck_baseline: int) -> None:
    t = torch.empty(16 * MiB, dtype=torch.uint8)
    address = t.data_ptr()
    with pinpool.pin(t, runtime="mlock", granularity_bytes=PAGE, chunk_bytes=4 * MiB, registry=None) as p:
        locked = locked_bytes() - vmlck_baseline
        if how == "del":
            del t
        else:
            _change(t, how)
        gc.collect()
        assert locked_bytes() - vmlck_baseline == locked  # nothing freed or unlocked under the pool
        p.tensor.fill_(1)
    assert locked == pages_of({address: 16 * MiB})
    assert locked_bytes() == vmlck_baseline and address not in PINNED_RANGES.snapshot()


def test_a_tensor_reallocated_between_pin_and_entry_is_refused_with_nothing_pinned(fake: FakeRuntime) -> None:
    t = torch.empty(8 * MiB, dtype=torch.uint8)
    pinned = pinpool.pin(t, runtime=fake, chunk_bytes=2 * MiB, registry=None)
    t.resize_(64 * MiB)  # reallocates: the bytes pin() planned for are gone
    with pytest.raises(pinpool.ConfigError, match="reallocated after pin"), pinned:
        pytest.fail("must not enter")
    assert fake.register_calls == [] and PINNED_RANGES.snapshot().get(t.data_ptr()) is None
    with pinpool.pin(t, runtime=fake, chunk_bytes=2 * MiB, registry=None) as p:  # pinning it as it is now works
        assert p.nbytes == 64 * MiB


def test_set_before_entry_still_pins_the_memory_pin_was_given(fake: FakeRuntime) -> None:
    t = torch.empty(8 * MiB, dtype=torch.uint8)
    t.fill_(9)
    address = t.data_ptr()
    pinned = pinpool.pin(t, runtime=fake, chunk_bytes=2 * MiB, registry=None)
    t.set_()  # the caller lets go of the storage: pin() holds it
    gc.collect()
    with pinned as p:
        assert p.data_ptr == address and int(p.tensor[-1]) == 9
        assert min(fake.registered) == address
    assert fake.registered == {}


@pytest.mark.parametrize("kind", ["view", "requires_grad", "inference", "float_rows"])
def test_tensors_of_every_kind_are_guarded_and_given_back(fake: FakeRuntime, kind: str) -> None:
    base: torch.Tensor | None = None
    if kind == "view":
        base = torch.empty(9 * MiB, dtype=torch.uint8)
        t = base[MiB + 64 :]
    elif kind == "requires_grad":
        t = torch.zeros(2 * MiB, requires_grad=True)
    elif kind == "inference":
        with torch.inference_mode():
            t = torch.zeros(2 * MiB)
    else:
        base = torch.zeros(8, MiB)
        t = base[2:6]
    own, shape, stride, offset = _cdata(t), t.shape, t.stride(), t.storage_offset()
    with pinpool.pin(t, runtime=fake, chunk_bytes=MiB, registry=None) as p:
        assert p.tensor.data_ptr() == t.data_ptr() and p.tensor.shape == t.shape
        assert not t.untyped_storage().resizable()  # pointed at the alias while pinned
    assert _cdata(t) == own and (t.shape, t.stride(), t.storage_offset()) == (shape, stride, offset)
    assert t.untyped_storage().resizable()


def test_the_tensor_is_given_back_only_in_the_thread_that_entered() -> None:
    """A pool closed from another thread (a failed background pinning) must not change a tensor
    the serving thread may be using: the tensor keeps the alias, the same bytes."""
    t = torch.empty(MiB, dtype=torch.uint8)
    own = _cdata(t)
    memory = TensorMemory(alias_of(t))
    assert _cdata(t) != own and t.data_ptr() == memory.address
    holder = [memory]
    del memory
    worker = threading.Thread(target=holder.clear)  # the last reference dies in another thread
    worker.start()
    worker.join()
    gc.collect()
    assert _cdata(t) != own and not t.untyped_storage().resizable()
    u = torch.empty(MiB, dtype=torch.uint8)
    own = _cdata(u)
    memory = TensorMemory(u)  # and in this thread: given back as soon as it is let go
    assert _cdata(u) != own
    del memory
    assert _cdata(u) == own and u.untyped_storage().resizable()


def test_a_leaked_chunk_keeps_the_tensor_guarded() -> None:
    t = torch.empty(4 * MiB, dtype=torch.uint8)
    fake = FakeRuntime(fail_unregister_on=1)
    with pytest.raises(pinpool.UnpinError), pinpool.pin(t, runtime=fake, chunk_bytes=MiB, registry=None):
        pass
    gc.collect()
    assert not t.untyped_storage().resizable()  # part of it may still be pinned: it must not move
    with pytest.raises(RuntimeError, match="not resizable"):
        t.resize_(64 * MiB)


# -- item 2: the driver behaviour, on the first GPU host ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_accepts_adjacent_registrations_sharing_a_page_and_copies_through_both() -> None:
    """cudaHostRegister tracks exact byte ranges: two registrations meeting inside one OS page are
    both accepted, each copies (non_blocking) as pinned memory, and one byte of overlap is 712."""
    from pinpool.runtimes import CudaRuntime

    runtime = CudaRuntime()
    buffer = empty(8 * MiB, dtype=torch.uint8)
    base = buffer.data_ptr()
    first = (base + 64, 2 * MiB)  # ends 64 B into a page...
    second = (base + 64 + 2 * MiB, 2 * MiB)  # ...where this one starts
    runtime.register(*first)
    try:
        runtime.register(*second)
        try:
            with pytest.raises(pinpool.RuntimeCallError) as info:
                runtime.register(second[0] - 1, 2)  # one byte of each: overlapping bytes are refused
            assert info.value.code == 712
            a = buffer[64 : 64 + 2 * MiB]
            b = buffer[64 + 2 * MiB : 64 + 4 * MiB]
            a.fill_(1)
            b.fill_(2)
            assert a.is_pinned() and b.is_pinned()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                da = a.to("cuda", non_blocking=True)
                db = b.to("cuda", non_blocking=True)
                db.add_(1)
                b.copy_(db, non_blocking=True)  # device to host, into the second registration
            stream.synchronize()
            assert int(da.sum()) == 2 * MiB and int(b.sum()) == 3 * 2 * MiB
        finally:
            runtime.unregister(second[0])
        # the first registration is intact after its neighbour left: the shared page still copies
        edge = buffer[2 * MiB - 4032 : 2 * MiB + 64]  # the last bytes of `first`, inside the shared page
        assert edge.is_pinned()
        assert int(edge.to("cuda", non_blocking=True).sum()) == edge.numel()
        torch.cuda.synchronize()
    finally:
        runtime.unregister(first[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_cuda_pins_a_torch_empty_tensor_in_shared_page_chunks() -> None:
    from pinpool.runtimes import CudaRuntime

    t = tensor_at(250 * MiB, 64)
    t.fill_(1)
    with pinpool.pin(t, granularity_bytes=30 * MiB, chunk_bytes=100 * MiB, runtime=CudaRuntime()) as p:
        assert sizes(p.plan.chunks) == [90 * MiB, 90 * MiB, 70 * MiB]
        for c in p.plan.chunks:
            piece = p.tensor[c.offset : c.end]
            assert piece.is_pinned()
            assert int(piece.to("cuda", non_blocking=True).sum()) == c.nbytes
        torch.cuda.synchronize()
