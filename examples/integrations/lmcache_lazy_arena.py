"""LMCache's lazy pinned L1 arena (``LazyMemoryAllocator``) with its pinning done by pinpool.

    python examples/integrations/lmcache_lazy_arena.py                         # 256 MiB, the best runtime here
    python examples/integrations/lmcache_lazy_arena.py --size 1GiB --runtime mlock

LMCache keeps one 1-D uint8 arena per engine and sub-allocates it. Its lazy allocator pins the
arena in 64 MiB steps on a daemon thread, opens the usable address space only behind the pinned
bytes, and keeps serving at the size it reached when a step fails (a warning, not an error).
``LazyPinnedArena`` below keeps that contract; the pin thread, the step loop, the pin record and
the unpinning are one background ``pinpool.PinnedPool`` with ``max_chunk_bytes="64MiB"``:

- the usable size is ``pool.pinned_pages`` (a ``Raw`` pool's page is one byte: the pinned prefix),
  read on every allocation, so it grows as the pool pins, never ahead of it;
- LMCache's pacer (waiting for in-flight transfers between steps, because a registration holds a
  driver lock that stalls other CUDA calls) becomes the stall budget ``max_call_seconds``: no
  registration call is sized to hold the lock longer than that;
- a failed step leaves the pool ``failed`` with ``[0, pinned_pages)`` still pinned; the arena warns
  once and keeps allocating below it; ``close()`` unpins everything.

Run as a script it shows a healthy arena, then one whose third registration fails (a failing
mlock runtime), with the kernel's VmLck for each. tests/tools/test_integrations.py checks the books
with ``pinpool.testing.FakeRuntime``.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import errno
import logging
import threading
import time

import torch
from prometheus_client import CollectorRegistry

import pinpool
from pinpool import layouts
from pinpool.runtimes import MlockRuntime, Runtime

logger = logging.getLogger("lmcache_lazy_arena")
MiB = 1 << 20
PIN_CHUNK_SIZE = 64 * MiB  # LMCache's step


@dataclasses.dataclass(frozen=True)
class MemoryObj:
    """One allocation: ``tensor`` is ``nbytes`` of the arena at ``offset``."""

    offset: int
    nbytes: int
    tensor: torch.Tensor


class LazyPinnedArena:
    """A 1-D uint8 arena of ``size`` bytes, pinned in the background in ``step`` chunks, sub-allocated first-fit.

    ``allocate`` returns None when nothing pinned is free (LMCache treats that as a cache miss);
    it never hands out a byte at or above ``usable_bytes``.
    """

    def __init__(
        self,
        size: int | str,
        *,
        runtime: str | Runtime = "auto",
        step: int | str = PIN_CHUNK_SIZE,
        max_call_seconds: float | None = 0.05,
        align_bytes: int = 4096,
        registry: CollectorRegistry | None = None,
    ) -> None:
        # pinpool: the arena, pinned in `step` registrations, lowest first, by one registration thread
        # (LMCache's daemon thread; pre-faulting runs ahead on several); a failed step is not
        # retried (max_retries=0), as LMCache does not retry it.
        self.pool = pinpool.PinnedPool(
            layout=layouts.Raw(), size=size, runtime=runtime, background=True, max_chunk_bytes=step,
            register_workers=1, max_call_seconds=max_call_seconds, max_retries=0, name="lmcache-l1",
            registry=registry,
        ).open()  # fmt: skip
        self.buffer = self.pool.tensor  # the whole arena at once; only [0, usable_bytes) is handed out
        self.align_bytes = align_bytes
        self._lock = threading.Lock()
        self._committed = 0  # bytes opened to the allocator so far (LMCache: sbrk'ed)
        self._free: list[tuple[int, int]] = []  # (offset, nbytes), sorted, coalesced
        self._warned = False

    @property
    def usable_bytes(self) -> int:
        """The pinned prefix, rounded down to the allocation alignment."""
        pinned = self.pool.pinned_pages
        return pinned if pinned == self.pool.nbytes else pinned - pinned % self.align_bytes

    @property
    def pin_state(self) -> str:
        return self.pool.state.value  # pinning, ready, failed (LMCache: PINNING, READY, FAILED)

    def _grow(self) -> None:
        """Under the lock: open the bytes pinned since the last call to the allocator."""
        usable = self.usable_bytes
        if usable > self._committed:
            self._insert(self._committed, usable - self._committed)
            self._committed = usable
        if not self._warned and self.pool.state is pinpool.PoolState.FAILED:
            self._warned = True  # reading pool.error marks it seen: close() will not report it again
            logger.warning(
                "background pinning failed; the arena stays usable at %d MiB of %d MiB: %s",
                self._committed >> 20, self.pool.nbytes >> 20, self.pool.error,
            )  # fmt: skip

    def _insert(self, offset: int, nbytes: int) -> None:
        i = bisect.bisect(self._free, (offset, nbytes))
        if i < len(self._free) and offset + nbytes == self._free[i][0]:  # merge with the block after
            nbytes += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the block before
            offset, nbytes = self._free[i - 1][0], self._free[i - 1][1] + nbytes
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (offset, nbytes))

    def allocate(self, nbytes: int) -> MemoryObj | None:
        size = -(-nbytes // self.align_bytes) * self.align_bytes
        with self._lock:
            self._grow()
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    self._free[i : i + 1] = [(offset + size, free - size)] if free > size else []
                    return MemoryObj(offset, nbytes, self.buffer[offset : offset + nbytes])
        return None

    def free(self, obj: MemoryObj) -> None:
        with self._lock:
            self._insert(obj.offset, -(-obj.nbytes // self.align_bytes) * self.align_bytes)

    def close(self) -> None:
        """Stop pinning, unpin every registration, let go of the arena. Idempotent, never raises."""
        with self._lock:
            self._free, self.buffer = [], torch.empty(0, dtype=torch.uint8)
        if (error := self.pool.close(raise_errors=False)) is not None:
            logger.warning("L1 arena closed with an error: %s", error)


class FailingMlock(MlockRuntime):
    """mlock whose ``fail_on``-th registration call fails with ENOMEM: a step that cannot be pinned.

    It pins as CUDA does (pre-fault, then register), not mlock's lock-on-fault, so each step is
    faulted before its registration call, and a failed call leaves the steps before it pinned.
    """

    capabilities = dataclasses.replace(MlockRuntime.capabilities, locks_on_fault=False)

    def __init__(self, fail_on: int) -> None:
        super().__init__()
        self.fail_on, self.calls = fail_on, 0

    def register(self, ptr: int, nbytes: int) -> None:
        self.calls += 1  # one registration thread (register_workers=1): the count needs no lock
        if self.calls == self.fail_on:
            raise pinpool.RuntimeCallError(op="mlock", code=errno.ENOMEM, reason="ENOMEM", ptr=ptr, nbytes=nbytes,
                                           message="injected: the host is out of memory")  # fmt: skip
        super().register(ptr, nbytes)


def vm_locked_bytes() -> int:
    """The kernel's count of this process's locked memory (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def serve(arena: LazyPinnedArena, label: str) -> list[MemoryObj]:
    """Allocate 1 MiB objects as the arena grows, until it is full or stops growing; write each one."""
    objs: list[MemoryObj] = []
    seen: list[int] = []
    while True:
        settled = arena.pool.state is not pinpool.PoolState.PINNING  # ready or failed: usable_bytes is final
        obj = arena.allocate(MiB)
        if obj is None:
            if settled:
                break  # full
            time.sleep(0.001)
            continue
        assert obj.offset + obj.nbytes <= arena.usable_bytes  # never beyond the pinned prefix
        obj.tensor.fill_(len(objs) % 251)
        objs.append(obj)
        if not seen or arena.usable_bytes // PIN_CHUNK_SIZE > seen[-1] // PIN_CHUNK_SIZE:
            seen.append(arena.usable_bytes)
    print(f"[{label}] usable size grew {' -> '.join(f'{n >> 20}' for n in [0, *seen])} MiB while allocating; "
          f"{len(objs)} objects of 1 MiB, all below usable_bytes")  # fmt: skip
    assert all(int(o.tensor[0]) == i % 251 and int(o.tensor[-1]) == i % 251 for i, o in enumerate(objs))
    return objs


def main(size: int, runtime: str) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    before = vm_locked_bytes()
    arena = LazyPinnedArena(size, runtime=runtime)
    try:
        objs = serve(arena, "healthy")
        arena.pool.wait_ready_sync(timeout=120)
        pinned = vm_locked_bytes()
        pool = arena.pool
        print(f"[healthy] {arena.pin_state}: {pool.pinned_bytes} bytes pinned in {len(pool.chunks)} steps of "
              f"{pool.chunk_bytes >> 20} MiB ({len(pool.registrations)} registration calls), longest call "
              f"{max(pool.longest_call_seconds.values()) * 1000:.0f} ms (budget 50 ms)")  # fmt: skip
        for obj in objs[:4]:
            arena.free(obj)
        again = arena.allocate(4 * MiB)  # the four freed neighbours coalesce into one block
        assert again is not None and again.offset == 0
        print(f"[healthy] freed the first 4 objects; a 4 MiB allocation fits at offset {again.offset}")
    finally:
        arena.close()
        arena.close()
    print(f"[healthy] closed: state {arena.pin_state}")
    print(f"VmLck: [healthy] before={before} pinned={pinned} after={vm_locked_bytes()} (bytes)")

    # The same arena whose third registration call fails: it keeps what it pinned and serves from it.
    failing = FailingMlock(fail_on=3) if runtime in ("mlock", "auto") else runtime
    if not isinstance(failing, FailingMlock):
        return  # the failure is injected into mlock only
    before = vm_locked_bytes()
    arena = LazyPinnedArena(size, runtime=failing, max_call_seconds=None)  # one call per 64 MiB step
    try:
        objs = serve(arena, "failing")
        pool = arena.pool
        failed_pinned = vm_locked_bytes()
        print(f"[failing] {arena.pin_state} at step 3: usable_bytes stays {arena.usable_bytes >> 20} MiB "
              f"(pinned_pages {pool.pinned_pages}), {len(pool.registrations)} registrations kept")  # fmt: skip
        arena.free(objs[0])
        reused = arena.allocate(MiB)
        assert reused is not None and reused.offset + reused.nbytes <= arena.usable_bytes
        reused.tensor.fill_(7)
        assert int(reused.tensor.sum()) == 7 * MiB
        print(f"[failing] after the failure: freed and allocated again at offset {reused.offset}, wrote and read it")
    finally:
        arena.close()
    print(f"[failing] closed: state {arena.pin_state}")
    print(f"VmLck: [failing] before={before} pinned={failed_pinned} after={vm_locked_bytes()} (bytes)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="LMCache's lazy pinned L1 arena on pinpool.")
    parser.add_argument("--size", default="256MiB", help="arena size, e.g. 256MiB (default) or 64GiB")
    parser.add_argument("--runtime", default="auto", help="auto, cuda, rocm or mlock (default: auto)")
    args = parser.parse_args()
    main(pinpool.parse_size(args.size), args.runtime)
