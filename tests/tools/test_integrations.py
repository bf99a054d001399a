"""examples/integrations/: SGLang-, LMCache- and vLLM-shaped owners of host memory, built on pinpool.

Each example runs as a script with the mlock runtime (real locking; its VmLck lines must come
back to where they started) and its claims are checked on its output. The classes are also
imported and driven with ``pinpool.testing.FakeRuntime``, whose books show exactly what is
registered, to check the parts a script run cannot pin down: SGLang's own shape and stride
formulas, allocation gated by ``pinned_pages`` while pinning, a failed step's books.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import pinpool
from pinpool.testing import FakeRuntime

from .. import preloaded
from ..conftest import needs_mlock

ROOT = Path(__file__).resolve().parents[2]
INTEGRATIONS = ROOT / "examples" / "integrations"
KiB, MiB = 1 << 10, 1 << 20


def load(name: str) -> ModuleType:
    """Import ``examples/integrations/<name>.py`` as a module (examples/ is not a package)."""
    module_name = f"pinpool_integration_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, INTEGRATIONS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def run_script(name: str, *args: str, timeout: float = 240.0) -> str:
    done = preloaded.run(
        [sys.executable, str(INTEGRATIONS / f"{name}.py"), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, f"{name} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def vmlck_lines(output: str) -> list[tuple[str, int, int, int]]:
    """Every ``VmLck: [label] before=.. pinned=.. after=..`` line: (label, before, pinned, after)."""
    found = re.findall(r"^VmLck: ?(.*?) ?before=(\d+) pinned=(\d+) after=(\d+) \(bytes\)$", output, re.MULTILINE)
    return [(label, int(b), int(p), int(a)) for label, b, p, a in found]


# -- SGLang HiCache MHA host pool -------------------------------------------------------------

L, H, D, P, IT = 4, 4, 64, 16, 2  # layers, heads, head dim, page size (tokens), bf16 itemsize
TOKEN_STRIDE = H * D * IT  # SGLang's token_stride_size
LAYOUT_DIM = TOKEN_STRIDE * L  # SGLang's layout_dim
SIZE_PER_TOKEN = H * D * L * IT * 2  # SGLang's MHA get_size_per_token


def sglang_pool(layout: str, runtime: Any, budget: int = 4 * MiB, **options: Any) -> Any:
    host_pool = load("sglang_hicache_host_pool")
    return host_pool.MHATokenToKVPoolHost(
        host_size_bytes=budget, layer_num=L, head_num=H, head_dim=D, page_size=P, layout=layout,
        runtime=runtime, **options,
    )  # fmt: skip


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def page_ranges(layout: str, size: int, page: int) -> list[tuple[int, int]]:
    """The byte ranges (offset, nbytes) of one page in SGLang's buffer, from its dims."""
    if layout == "page_first":  # (2, size, L, H, D): a page is P tokens of all layers, in K and in V
        return [((kv * size + page * P) * LAYOUT_DIM, P * LAYOUT_DIM) for kv in range(2)]
    # layer_first (2, L, size, H, D): a page is P tokens in each layer of K and of V
    starts = [((kv * L + layer) * size + page * P) * TOKEN_STRIDE for kv in range(2) for layer in range(L)]
    return [(start, P * TOKEN_STRIDE) for start in starts]


def covered(ranges: list[tuple[int, int]], registrations: tuple[pinpool.Chunk, ...]) -> bool:
    return all(any(c.offset <= lo and lo + n <= c.offset + c.nbytes for c in registrations) for lo, n in ranges)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sglang_pool_has_sglangs_sizing_shapes_strides_and_views(layout: str) -> None:
    budget = 4 * MiB + 12345
    fake = FakeRuntime()
    host = sglang_pool(layout, fake, budget=budget, chunk_bytes="256KiB")
    try:
        pool = host.pool
        pool.wait_ready_sync(timeout=30)
        # Sizing, as HostKVCache.__init__: tokens in the budget, then one page more.
        size = budget // SIZE_PER_TOKEN
        page_num = size // P + 1
        size = page_num * P
        assert (host.size_per_token, host.page_num, host.size) == (SIZE_PER_TOKEN, page_num, size)
        assert pool.num_pages == page_num and pool.nbytes == size * SIZE_PER_TOKEN
        # Buffer dims, as MHATokenToKVPoolHost.init_kv_buffer, contiguous.
        dims = (2, L, size, H, D) if layout == "layer_first" else (2, size, L, H, D)
        kv = host.kv_buffer
        assert tuple(kv.shape) == dims and kv.stride() == contiguous_strides(dims) and kv.dtype == torch.bfloat16
        assert kv.data_ptr() == pool.data_ptr
        half = size * L * H * D * IT  # K then V
        assert host.k_buffer.data_ptr() == pool.data_ptr and host.v_buffer.data_ptr() == pool.data_ptr + half
        # Per-layer views, as k_data_refs: (size, H, D); page_first strided by a token of all layers.
        for i in range(L):
            k, v = host.get_key_buffer(i), host.get_value_buffer(i)
            assert tuple(k.shape) == tuple(v.shape) == (size, H, D)
            if layout == "layer_first":
                assert k.stride() == (H * D, D, 1)
                assert k.data_ptr() == pool.data_ptr + i * size * TOKEN_STRIDE
            else:
                assert k.stride() == (L * H * D, D, 1)
                assert k.data_ptr() == pool.data_ptr + i * TOKEN_STRIDE
            assert v.data_ptr() == k.data_ptr() + half
        # Registration granularity: SGLang's P * layout_dim for page_first; for layer_first SGLang
        # registers once, pinpool cuts at one page of one layer (P * token_stride).
        granularity = P * LAYOUT_DIM if layout == "page_first" else P * TOKEN_STRIDE
        assert pool.granularity == granularity
        registrations = sorted(pool.registrations)
        assert [c.offset % granularity for c in registrations] == [0] * len(registrations)
        assert sum(c.nbytes for c in registrations) == pool.nbytes
        assert fake.registered == {pool.data_ptr + c.offset: c.nbytes for c in registrations}
        # get_data_page views the same bytes as the per-layer views.
        host.get_key_buffer(3)[5 * P : 6 * P] = 2.5
        page = host.get_data_page(5 * P)
        k_layer3 = page[0][:, 3] if layout == "page_first" else page[0][3]
        assert float(k_layer3.float().mean()) == 2.5
    finally:
        host.destroy()
    assert fake.registered == {}


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_sglang_alloc_hands_out_only_pinned_pages_lowest_first(layout: str) -> None:
    fake = FakeRuntime(register_delay=0.01)  # slow registrations: the pool is caught while pinning
    host = sglang_pool(layout, fake, budget=2 * MiB, chunk_bytes="64KiB", max_call_seconds=None)
    pool = host.pool
    try:
        pages: list[int] = []
        refused_while_pinning = served_while_pinning = 0
        while len(pages) < host.page_num:
            pinning = pool.state is pinpool.PoolState.PINNING
            got = host.alloc(P)
            if got is None:
                assert pinning or host.available_size() == 0  # once pinned, None means no free page
                refused_while_pinning += pinning
                time.sleep(0.002)
                continue
            assert torch.equal(got, torch.arange(got[0], got[0] + P))  # one whole page of token slots
            page = int(got[0]) // P
            assert page < pool.pinned_pages  # it only grows: it was below it when handed out
            assert covered(page_ranges(layout, host.size, page), pool.registrations)
            served_while_pinning += pinning and pool.pinned_pages < pool.num_pages
            pages.append(page)
        assert pages == list(range(host.page_num))  # lowest first, each page once
        assert served_while_pinning > 0 and refused_while_pinning > 0
        assert host.alloc(P) is None  # all taken
        host.free(torch.cat([torch.arange(p * P, (p + 1) * P) for p in (7, 3)]))
        assert host.available_size() == 2 * P
        assert int(host.alloc(P)[0]) == 3 * P  # freed slots are handed out lowest first too
    finally:
        host.destroy()
    assert fake.registered == {}


def test_sglang_destroy_twice_and_a_failed_unregister_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeRuntime(fail_unregister_on=1)
    host = sglang_pool("page_first", fake, chunk_bytes="1MiB")
    host.pool.wait_ready_sync(timeout=30)
    with caplog.at_level(logging.WARNING, logger="sglang_hicache_host_pool"):
        host.destroy()  # never raises: a destructor's path
        host.destroy()
    warnings = [r for r in caplog.records if r.name == "sglang_hicache_host_pool"]
    assert len(warnings) == 1 and "closed with an error" in warnings[0].getMessage()
    assert host.pool.state is pinpool.PoolState.CLOSED
    assert len(fake.registered) == 1  # the chunk whose unregister failed stays registered, as CUDA would keep it


@needs_mlock
def test_sglang_example_runs_with_mlock() -> None:
    out = run_script("sglang_hicache_host_pool", "--size", "16MiB", "--runtime", "mlock")
    size = (16 * MiB // SIZE_PER_TOKEN // P + 1) * P
    for layout, dims in (("page_first", (2, size, L, H, D)), ("layer_first", (2, L, size, H, D))):
        assert f"[{layout}] sized: size_per_token={SIZE_PER_TOKEN} B, page_num={size // P}" in out
        view = (L * H * D, D, 1) if layout == "page_first" else (H * D, D, 1)
        shapes = f"kv_buffer {dims} strides {contiguous_strides(dims)}; layer 1 K view {(size, H, D)} strides {view}"
        assert f"[{layout}] {shapes}" in out
        allocated = rf"allocated pages 0\.\.{size // P - 1} lowest first, \d+ of them while pinning; none at or above"
        assert re.search(rf"^\[{layout}\] {allocated} pool.pinned_pages$", out, re.MULTILINE)
        assert f"[{layout}] destroyed twice: state closed, pinned_bytes 0" in out
    locks = vmlck_lines(out)
    assert len(locks) == 2
    for _label, before, pinned, after in locks:
        assert pinned - before >= size * SIZE_PER_TOKEN and after == before


# -- LMCache lazy arena -----------------------------------------------------------------------


def test_lmcache_usable_size_grows_with_pinned_pages() -> None:
    lazy = load("lmcache_lazy_arena")
    fake = FakeRuntime(register_delay=0.03)
    arena = lazy.LazyPinnedArena(256 * MiB, runtime=fake, max_call_seconds=None)
    try:
        assert len(arena.pool.chunks) == 4 and arena.pool.chunk_bytes == 64 * MiB  # LMCache's 64 MiB steps
        seen: list[int] = []
        objs = []
        deadline = time.monotonic() + 60
        while not seen or seen[-1] < 256 * MiB:
            assert arena.pin_state in ("pinning", "ready") and time.monotonic() < deadline
            usable = arena.usable_bytes
            obj = arena.allocate(MiB)
            if obj is not None:
                assert obj.offset + obj.nbytes <= arena.usable_bytes
                objs.append(obj)
            else:
                time.sleep(0.001)
            if not seen or usable != seen[-1]:
                seen.append(usable)
        while (obj := arena.allocate(MiB)) is not None:
            objs.append(obj)
        assert seen == sorted(seen) and seen[-1] == 256 * MiB
        assert {n % (64 * MiB) for n in seen} == {0}  # registered per step: it grows a step at a time
        assert len(seen) >= 3  # seen growing, not only at the end
        assert arena.allocate(MiB) is None  # 256 objects of 1 MiB fill it
        assert sorted(o.offset for o in objs) == [i * MiB for i in range(256)]
    finally:
        arena.close()
    assert fake.registered == {}


def test_lmcache_failed_step_keeps_what_is_pinned(caplog: pytest.LogCaptureFixture) -> None:
    lazy = load("lmcache_lazy_arena")
    fake = FakeRuntime(fail_register_on=3)  # the third 64 MiB step fails
    arena = lazy.LazyPinnedArena(256 * MiB, runtime=fake, max_call_seconds=None)
    pool = arena.pool
    base = pool.data_ptr
    with pytest.raises(pinpool.PinError):
        pool.wait_ready_sync(timeout=30)
    try:
        assert arena.pin_state == "failed"
        # The books: the two steps before the failure are registered, nothing else, nothing unpinned.
        assert fake.registered == {base: 64 * MiB, base + 64 * MiB: 64 * MiB}
        assert sorted(pool.registrations) == [pinpool.Chunk(0, 64 * MiB), pinpool.Chunk(64 * MiB, 64 * MiB)]
        assert pool.pinned_pages == arena.usable_bytes == 128 * MiB
        with caplog.at_level(logging.WARNING, logger="lmcache_lazy_arena"):
            objs = []
            while (obj := arena.allocate(MiB)) is not None:
                objs.append(obj)
        assert len(objs) == 128 and max(o.offset + o.nbytes for o in objs) == 128 * MiB  # all below the pinned prefix
        assert [r.getMessage()[:60] for r in caplog.records if r.name == "lmcache_lazy_arena"] == [
            "background pinning failed; the arena stays usable at 128 MiB"
        ]
        objs[5].tensor.fill_(9)
        arena.free(objs[5])
        again = arena.allocate(MiB)
        assert again is not None and again.offset == 5 * MiB and int(again.tensor[0]) == 9
        assert fake.registered == {base: 64 * MiB, base + 64 * MiB: 64 * MiB}  # serving changed nothing
    finally:
        arena.close()
    arena.close()
    assert pool.state is pinpool.PoolState.CLOSED and fake.registered == {}
    assert sorted(fake.unregister_calls) == [base, base + 64 * MiB]


@needs_mlock
def test_lmcache_example_runs_with_mlock() -> None:
    out = run_script("lmcache_lazy_arena", "--size", "256MiB", "--runtime", "mlock")
    assert re.search(r"^\[healthy\] usable size grew 0 -> .* -> 256 MiB while allocating; 256 objects", out, re.M)
    assert "[healthy] ready: 268435456 bytes pinned in 4 steps of 64 MiB" in out
    assert "[healthy] freed the first 4 objects; a 4 MiB allocation fits at offset 0" in out
    assert re.search(r"^\[failing\] usable size grew 0 -> .*128 MiB while allocating; 128 objects", out, re.M)
    assert "[failing] failed at step 3: usable_bytes stays 128 MiB (pinned_pages 134217728), 2 registrations" in out
    assert "[failing] closed: state closed" in out
    (healthy, h_before, h_pinned, h_after), (failing, f_before, f_pinned, f_after) = vmlck_lines(out)
    assert (healthy, failing) == ("[healthy]", "[failing]")
    assert h_pinned - h_before == 256 * MiB and h_after == h_before
    assert f_pinned - f_before == 128 * MiB and f_after == f_before  # the failed step's memory is not locked


# -- vLLM shared offload region ---------------------------------------------------------------


@needs_mlock
def test_vllm_two_workers_share_pin_and_clean_up_one_region() -> None:
    out = run_script("vllm_shared_offload_region", "--blocks", "32", "--page-bytes", "256KiB", "--runtime", "mlock")
    region = 32 * 2 * 256 * KiB
    phases = out.split("== ")[1:]
    assert len(phases) == 2
    for phase, failing in zip(phases, (False, True), strict=True):
        assert f"32 rows of 2 x 256 KiB = {region} bytes" in phase
        assert len(re.findall(r"^rank \d: created the region", phase, re.MULTILINE)) == 1  # one exclusive creator
        assert len(re.findall(r"^rank \d: attached the region", phase, re.MULTILINE)) == 1
        assert len(re.findall(rf"read {region // 2} bytes written by the other worker$", phase, re.MULTILINE)) == 2
        assert "registration windows do not overlap" in phase  # node_slots=1: one worker registers at a time
        assert "exit codes [0, 0]" in phase and "is gone (the creator unlinked it)" in phase
        locks = {label: rest for label, *rest in vmlck_lines(phase)}
        assert set(locks) == {"rank 0", "rank 1"}
        for rank, (before, pinned, after) in locks.items():
            assert after == before
            if failing and rank == "rank 1":
                assert pinned == before  # nothing stays locked: it serves from a plain mapping
                assert re.search(r"^rank 1: (created|attached) the region; pinning FAILED", phase, re.MULTILINE)
            else:
                assert pinned - before == region  # each worker pins the whole region in its own mapping
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("vllm_offload_")]


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_vllm_region_failure_falls_back_to_a_plain_mapping(tmp_path: Path, failing_rank: int) -> None:
    """Two workers in one process, on the fake: the failing one (creator or attacher) keeps serving
    unpinned, bytes cross both ways, and the file is removed by the creator at the end."""
    vllm = load("vllm_shared_offload_region")
    node_dir = tmp_path / "node"
    node_dir.mkdir(mode=0o700)
    path = f"/dev/shm/pinpool-test-vllm-{os.getpid()}-{failing_rank}.mmap"
    fakes = [FakeRuntime(fail_register_on=2 if rank == failing_rank else None) for rank in range(2)]
    regions: list[Any] = []
    options = {"num_blocks": 16, "page_bytes": 64 * KiB, "num_workers": 2, "max_chunk_bytes": 256 * KiB}
    try:
        regions.extend(  # one by one: a region made before a failure is still cleaned up below
            vllm.SharedOffloadRegion(path, rank=rank, runtime=fakes[rank], node_dir=str(node_dir), **options)
            for rank in range(2)
        )
        assert [r.creator for r in regions] == [True, False]
        assert [r.wait_pinned(timeout=30) for r in regions] == [rank != failing_rank for rank in range(2)]
        assert [r.pinned for r in regions] == [rank != failing_rank for rank in range(2)]
        assert fakes[failing_rank].registered == {}  # its pool closed: everything it registered is unregistered
        assert os.path.exists(path)  # even when the creator failed: the region stays for the others
        for rank, region in enumerate(regions):
            region.worker_view()[:] = vllm.pattern(rank, 16)
        for rank, region in enumerate(regions):
            other = 1 - rank
            assert torch.equal(region.worker_view(other), vllm.pattern(other, 16).expand(-1, 64 * KiB))
    finally:
        for region in reversed(regions):
            region.cleanup()
            region.cleanup()
    assert not os.path.exists(path)
    assert [f.registered for f in fakes] == [{}, {}]
