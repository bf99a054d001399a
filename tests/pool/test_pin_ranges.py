"""pin() of disjoint ranges of one tensor in one pool: the contiguous rows of a strided view, and
``ranges=[(offset, nbytes), ...]``; vLLM 0.34.0's worker-slot registration expressed with both."""

from __future__ import annotations

import gc
import mmap
import threading
from collections.abc import Iterator

import anyio
import anyio.to_thread
import pytest
import torch

import pinpool
from pinpool._host import libc as _libc
from pinpool._ranges import PINNED_RANGES
from pinpool.runtimes import MlockRuntime
from pinpool.testing import FakeRuntime, locked_bytes

from ..conftest import each_driver, needs_mlock

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PAGE = _libc.PAGE_SIZE

pytestmark = pytest.mark.anyio


# -- the reference: vLLM 0.34.0's own range arithmetic, copied (not imported) --------------------------------

# From vllm/v1/kv_offload/cpu/gpu_worker.py (vllm 0.34.0, the released wheel).
VLLM_MAX_HOST_REGISTER_CHUNK_BYTES = 64 * 1024**3
VLLM_MIN_HOST_REGISTER_SAVED_BYTES = 3 * 1024**2


def vllm_round_up(x: int, multiple: int) -> int:  # vllm/utils/math_utils.py round_up
    return ((x + multiple - 1) // multiple) * multiple


def vllm_pin_mmap_region_ranges(
    num_chunks: int, row_stride: int, cpu_page_size: int, rank: int | None, page_size: int, worker_slot_only: bool
) -> list[tuple[int, int]]:
    """The (offset, length) ranges vLLM 0.34.0's ``pin_mmap_region`` (vllm/v1/kv_offload/cpu/gpu_worker.py)
    registers for a one-segment ``SharedOffloadRegion``, in its order: the worker-slot ranges of
    ``SharedOffloadRegion.iter_worker_slot_ranges`` (vllm/v1/kv_offload/cpu/shared_offload_region.py;
    ``first`` is 0 with one segment), each slot rounded *out* to OS pages, or else whole rows in
    chunks of at most 64 GiB. Copied as it is there, to check pinpool against."""
    total_size = num_chunks * row_stride
    rows_per_chunk = max(VLLM_MAX_HOST_REGISTER_CHUNK_BYTES // row_stride, 1)
    chunk_size = rows_per_chunk * row_stride
    ranges = [(offset, min(chunk_size, total_size - offset)) for offset in range(0, total_size, chunk_size)]
    stride, slot, page = row_stride, cpu_page_size, page_size
    min_savings = max(page, VLLM_MIN_HOST_REGISTER_SAVED_BYTES)
    if worker_slot_only and rank is not None and stride - slot >= min_savings:
        ranges = []
        worker_offset = rank * cpu_page_size
        for i in range(num_chunks):
            row = i  # (first + i) % num_chunks, first = 0 with one segment
            start = row * row_stride + worker_offset
            aligned = start - start % page_size
            end = vllm_round_up(start + cpu_page_size, page_size)
            ranges.append((aligned, end - aligned))
    return ranges


def rounded_out(ptr: int, nbytes: int) -> tuple[int, int]:
    lo, hi = ptr - ptr % PAGE, vllm_round_up(ptr + nbytes, PAGE)
    return lo, hi - lo


def vllm_region(rows: int, workers: int, slot: int) -> tuple[mmap.mmap, torch.Tensor, int]:
    """A region laid out as vLLM's SharedOffloadRegion: ``rows`` rows of ``workers`` slots each, the
    row stride rounded up to OS pages (vLLM's kv_bytes_per_chunk), in a shared anonymous mmap."""
    stride = vllm_round_up(workers * slot, PAGE)
    region = mmap.mmap(-1, rows * stride, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return region, torch.frombuffer(memoryview(region), dtype=torch.int8), stride


def worker_view(base: torch.Tensor, rows: int, stride: int, slot: int, rank: int) -> torch.Tensor:
    """Worker ``rank``'s slots, as vLLM's create_next_worker_view makes them: (rows, slot), strides (stride, 1)."""
    return torch.as_strided(base, size=(rows, slot), stride=(stride, 1), storage_offset=rank * slot)


ROWS, WORKERS = 32, 4
SLOTS = [MiB, MiB + 1000]  # a page multiple; and not one (vLLM rounds out, and neighbours share pages)


@pytest.mark.parametrize("slot", SLOTS, ids=["page-multiple", "mid-page"])
@pytest.mark.parametrize("rank", [0, 2, 3])
def test_a_worker_view_registers_what_vllm_registers(slot: int, rank: int) -> None:
    """vLLM's worker-slot mode (32 disjoint rows) as pin() of the worker's strided view: one
    registration per row, the slot's exact bytes; rounded out to pages, exactly vLLM's ranges.
    The same ranges given as ranges= register byte for byte what vLLM registers."""
    region, base, stride = vllm_region(ROWS, WORKERS, slot)
    expected = vllm_pin_mmap_region_ranges(ROWS, stride, slot, rank, PAGE, worker_slot_only=True)
    assert len(expected) == ROWS and all(size < stride for _, size in expected)  # vLLM chose its slot mode
    start = base.data_ptr()
    view = worker_view(base, ROWS, stride, slot, rank)
    fake = FakeRuntime()
    with pinpool.pin(view, runtime=fake, registry=None) as pinned:
        registered = sorted(fake.registered.items())
        assert pinned.tensor.shape == (ROWS, slot) and pinned.tensor.stride() == (stride, 1)
        assert pinned.tensor.data_ptr() == view.data_ptr() and pinned.nbytes == ROWS * slot
        assert pinned.num_pages == pinned.pinned_pages == ROWS
    assert registered == [(start + row * stride + rank * slot, slot) for row in range(ROWS)]
    assert [rounded_out(ptr, size) for ptr, size in registered] == [(start + o, n) for o, n in expected]
    assert fake.registered == {}

    fake = FakeRuntime()
    with pinpool.pin(base, ranges=expected, runtime=fake, registry=None) as pinned:
        assert sorted(fake.registered.items()) == [(start + o, n) for o, n in expected]
        assert pinned.tensor.data_ptr() == start and pinned.tensor.numel() == ROWS * stride
    assert fake.registered == {}
    del pinned, view, base
    gc.collect()
    region.close()  # pinpool let go of the mapping: vLLM's cleanup() can close it


def test_vllm_whole_region_mode_is_pin_of_the_region(fake: FakeRuntime) -> None:
    region, base, stride = vllm_region(ROWS, WORKERS, MiB)
    expected = vllm_pin_mmap_region_ranges(ROWS, stride, MiB, 0, PAGE, worker_slot_only=False)
    with pinpool.pin(base, chunk_bytes=VLLM_MAX_HOST_REGISTER_CHUNK_BYTES, runtime=fake, registry=None):
        assert sorted(fake.registered.items()) == [(base.data_ptr() + o, n) for o, n in expected]
    del base
    gc.collect()
    region.close()


def test_every_workers_view_pins_at_once_in_one_process(fake: FakeRuntime) -> None:
    """Each range is claimed on its own, so the gaps between one view's rows stay free for the others."""
    _region, base, stride = vllm_region(8, WORKERS, MiB)
    pools = [pinpool.pin(worker_view(base, 8, stride, MiB, w), runtime=fake, registry=None) for w in range(WORKERS)]
    for pool in pools:
        pool.__enter__()
    assert sum(fake.registered.values()) == 8 * WORKERS * MiB == base.numel()
    with pytest.raises(pinpool.AlreadyPinnedError, match="already pins"):
        with pinpool.pin(worker_view(base, 8, stride, MiB, 1), runtime=fake, registry=None):
            pass
    for pool in reversed(pools):
        pool.__exit__(None, None, None)
    assert fake.registered == {} and not any(
        base.data_ptr() <= ptr < base.data_ptr() + base.numel() for ptr in PINNED_RANGES.snapshot()
    )


# -- chunking within a row ----------------------------------------------------------------------------------


def test_rows_are_chunked_on_their_own_grid_and_never_merged_across_gaps(fake: FakeRuntime) -> None:
    rows, stride, row = 6, 3 * MiB, 2 * MiB + 512 * KiB  # 2.5 MiB rows: two 1 MiB chunks and a 512 KiB tail
    region = pinpool.empty(rows * stride, dtype=torch.uint8)
    view = region.view(rows, stride)[:, 256 * KiB : 256 * KiB + row]
    pool = pinpool.pin(view, granularity_bytes=256 * KiB, chunk_bytes=MiB, runtime=fake, registry=None)
    per_row = [(0, MiB), (MiB, MiB), (2 * MiB, 512 * KiB)]
    expected = [(r * stride + o, n) for r in range(rows) for o, n in per_row]  # from the view's start
    assert [(c.offset, c.nbytes) for c in pool.plan.chunks] == expected
    assert [b.spec.name for b in pool._plan.buffers] == [f"data[{r}]" for r in range(rows)]
    with pool:
        assert sorted(fake.registered.items()) == [(view.data_ptr() + o, n) for o, n in expected]


def test_an_n_d_view_pins_each_contiguous_row_and_counts_pages_along_its_first_dimension(fake: FakeRuntime) -> None:
    """(2, 3, 4 KiB) rows out of a (2, 4, 8 KiB) block: 6 rows, page i = the first dimension's slice i."""
    block = pinpool.empty(2 * 4 * 8 * KiB, dtype=torch.uint8).view(2, 4, 8 * KiB)
    view = block[:, 1:, 2 * KiB : 6 * KiB]
    with pinpool.pin(view, runtime=fake, registry=None) as pinned:
        rows = sorted(fake.registered.items())
        assert pinned.num_pages == pinned.pinned_pages == 2 and pinned.tensor.stride() == view.stride()
    start = view.data_ptr()
    assert rows == [(start + (a * 4 + b) * 8 * KiB, 4 * KiB) for a in range(2) for b in range(3)]


def test_ranges_may_come_in_any_order_and_share_pages_where_chunks_may() -> None:
    t = pinpool.empty(8 * PAGE, dtype=torch.uint8)
    fake = FakeRuntime()
    with pinpool.pin(t, ranges=[(5 * PAGE, 100), (PAGE + 10, 20), (PAGE + 40, PAGE)], runtime=fake, registry=None) as p:
        assert sorted(fake.registered.items()) == [
            (t.data_ptr() + PAGE + 10, 20), (t.data_ptr() + PAGE + 40, PAGE), (t.data_ptr() + 5 * PAGE, 100)
        ]  # fmt: skip
        assert p.nbytes == 120 + PAGE and p.tensor.data_ptr() == t.data_ptr()
    with pytest.raises(pinpool.ConfigError, match="share an OS page"):
        pinpool.pin(t, ranges=[(PAGE + 10, 20), (PAGE + 40, 8)], runtime=FakeRuntime(exact_ranges=False))
    fake = FakeRuntime(exact_ranges=False)  # ranges on pages of their own are fine there
    with pinpool.pin(t, ranges=[(0, PAGE), (2 * PAGE, 3 * PAGE)], runtime=fake, registry=None):
        assert sorted(fake.registered.values()) == [PAGE, 3 * PAGE]


# -- real mlock --------------------------------------------------------------------------------------------


@needs_mlock
@pytest.mark.parametrize("slot", SLOTS, ids=["page-multiple", "mid-page"])
def test_mlock_locks_exactly_the_rows_pages_and_unlocks_them(slot: int, vmlck_baseline: int) -> None:
    region, base, stride = vllm_region(ROWS, WORKERS, slot)
    expected = vllm_pin_mmap_region_ranges(ROWS, stride, slot, 1, PAGE, worker_slot_only=True)
    view = worker_view(base, ROWS, stride, slot, 1)
    with pinpool.pin(view, runtime=MlockRuntime(), registry=None) as pinned:
        assert locked_bytes() - vmlck_baseline == sum(n for _, n in expected)  # vLLM's pages, no more
        pinned.tensor.fill_(7)
        assert int(base.view(ROWS, stride)[:, slot : 2 * slot].sum()) == 7 * ROWS * slot
    assert locked_bytes() == vmlck_baseline
    with pinpool.pin(base, ranges=expected, runtime=MlockRuntime(), registry=None):
        assert locked_bytes() - vmlck_baseline == sum(n for _, n in expected)
    assert locked_bytes() == vmlck_baseline
    del pinned, view, base
    gc.collect()
    region.close()


# -- failures, rollback, background, cancellation -------------------------------------------------------------


def rows_view(rows: int = 8, stride: int = 4 * MiB, row: int = MiB) -> tuple[torch.Tensor, torch.Tensor]:
    region = pinpool.empty(rows * stride, dtype=torch.uint8)
    return region, region.view(rows, stride)[:, stride - row :]


@pytest.mark.parametrize("k", [0, 3, 7])
def test_a_failure_on_row_k_rolls_back_rows_before_it_in_reverse(k: int) -> None:
    region, view = rows_view()
    fake = FakeRuntime(fail_register_on=k + 1)
    with pytest.raises(pinpool.PinError, match="failed"):
        with pinpool.pin(view, runtime=fake, register_workers=1, populate=False, max_retries=0, registry=None):
            pytest.fail("must not enter")
    row_bases = [view[r].data_ptr() for r in range(view.shape[0])]
    assert [ptr for ptr, _ in fake.register_calls] == row_bases[: k + 1]
    assert fake.unregister_calls == row_bases[:k][::-1] and fake.registered == {}
    assert not any(region.data_ptr() <= ptr < region.data_ptr() + region.numel() for ptr in PINNED_RANGES.snapshot())


@each_driver
async def test_pinned_pages_counts_rows_in_the_background(mode: str) -> None:
    _region, view = rows_view(row=2 * MiB)
    rows = view.shape[0]
    seen: list[int] = []
    pool: pinpool.PinnedPool | None = None

    def before(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and pool is not None:
            seen.append(pool.pinned_pages)

    fake = FakeRuntime(before_call=before)
    pool = pinpool.pin(
        view, runtime=fake, background=True, chunk_bytes=MiB, register_workers=1, populate=False, registry=None
    )

    if mode == "async":
        async with pool as p:
            assert await p.wait_ready() == rows
    else:
        with pool as p:
            assert p.wait_ready_sync() == rows
    # Two chunks per row, registered in order: when chunk 2r starts, at most rows [0, r) are pinned;
    # the count grows past the gaps between rows before the end (they hold no page's bytes).
    assert len(seen) == 2 * rows and all(pages <= i // 2 for i, pages in enumerate(seen))
    assert seen == sorted(seen) and seen[-1] > 0
    assert fake.registered == {}


async def test_cancelled_while_pinning_rows_rolls_back_every_row() -> None:
    _region, view = rows_view()
    reached, release = threading.Event(), threading.Event()
    row_k = view[5].data_ptr()

    def before(op: str, ptr: int, nbytes: int) -> None:
        if op == "register" and ptr == row_k:
            reached.set()
            release.wait(30)

    fake = FakeRuntime(before_call=before)
    scope = anyio.CancelScope()

    async def enter() -> None:
        with scope:
            async with pinpool.pin(view, runtime=fake, register_workers=1, populate=False, registry=None):
                pytest.fail("must not enter")

    async with anyio.create_task_group() as tg:
        tg.start_soon(enter)
        assert await anyio.to_thread.run_sync(reached.wait, 30)
        scope.cancel()
        release.set()
    assert scope.cancelled_caught and fake.registered == {}
    # Rows 0..5 at least were registered (the worker may take a row or two more before it sees
    # the stop); every one is unregistered, last first.
    registered = [ptr for ptr, _ in fake.register_calls]
    assert registered[:6] == [view[r].data_ptr() for r in range(6)]
    assert fake.unregister_calls == registered[::-1]


# -- bad input ----------------------------------------------------------------------------------------------


def bad_views() -> Iterator[tuple[torch.Tensor, str]]:
    t = torch.empty(64, 64)
    yield t.t(), r"shape \(64, 64\), strides \(1, 64\).*rows are not contiguous"
    yield t[:, ::2], r"strides \(64, 2\).*rows are not contiguous"
    yield torch.empty(64, 1).expand(64, 8), r"rows are not contiguous"
    yield torch.empty(8).expand(4, 8), r"rows of 32 B overlap one another"
    yield t.as_strided((4, 64), (32, 1)), r"rows of 256 B overlap one another"


@pytest.mark.parametrize(("view", "message"), list(bad_views()))
def test_views_that_are_not_disjoint_contiguous_rows_are_refused(
    fake: FakeRuntime, view: torch.Tensor, message: str
) -> None:
    with pytest.raises(pinpool.ConfigError, match=message):
        pinpool.pin(view, runtime=fake)
    assert fake.register_calls == []
