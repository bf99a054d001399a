"""vLLM's CPU KV offload region (``vllm/v1/kv_offload/cpu/``) shared by worker processes, pinned by pinpool.

    python examples/integrations/vllm_shared_offload_region.py                 # 2 workers, a 32 MiB region
    python examples/integrations/vllm_shared_offload_region.py --blocks 1024 --runtime mlock

vLLM keeps one offload region per instance: a file in ``/dev/shm`` created with ``O_EXCL`` by the
first worker and mapped ``MAP_SHARED`` by every worker. A row is ``page_bytes * num_workers``;
worker *w* owns bytes ``[w * page_bytes, +page_bytes)`` of every row. Each worker registers the
region in whole-row chunks on a pin thread (a ``flock`` around it, because concurrent long-term
pins of one shared region made the kernel return ENOMEM), and when pinning fails the region stays
usable unpinned (copies fall back to pageable DMA). Cleanup unregisters, unmaps, and the creator
unlinks the file.

``SharedOffloadRegion`` below does the same on pinpool: ``pinpool.SharedMemory(path,
create=True)`` is the exclusive creation (the worker that loses the race attaches with
``create=False``), a background ``PinnedPool`` over it pins the whole region in whole rows
(``Raw(granularity_bytes=row_bytes)``, ``max_chunk_bytes`` as vLLM's 64 GiB bound), and node
pacing (``node_slots=1``) stands in for the ``flock``: one worker registers at a time. Each
worker pins the whole region in its own mapping (its own VmLck shows all of it); the pages exist
once. A worker whose pinning fails closes its pool (everything it registered is unregistered) and
maps the file plainly: it keeps serving, nothing is raised.

Run as a script: two worker processes (``spawn``) each write their own slots and read the other's,
then the same with worker 1's pinning failing. tests/tools/test_integrations.py checks the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import itertools
import logging
import mmap
import multiprocessing
import os
import tempfile
import threading
import time
from typing import Any

import torch

import pinpool
from pinpool import layouts
from pinpool.runtimes import MlockRuntime, Runtime

logger = logging.getLogger("vllm_shared_offload_region")
KiB, MiB = 1 << 10, 1 << 20


class SharedOffloadRegion:
    """One worker's view of the instance's offload region: ``num_blocks`` rows of ``page_bytes * num_workers``."""

    def __init__(
        self,
        path: str,
        *,
        num_blocks: int,
        rank: int,
        page_bytes: int,
        num_workers: int,
        runtime: str | Runtime = "auto",
        max_chunk_bytes: int | str = "64GiB",
        node_dir: str | None = None,
    ) -> None:
        self.path, self.rank, self.page_bytes, self.num_blocks = path, rank, page_bytes, num_blocks
        self.row_stride = page_bytes * num_workers
        self.nbytes = num_blocks * self.row_stride
        self._plain: mmap.mmap | None = None
        # pinpool: create the file exclusively, or attach if another worker won; pin it in whole rows.
        for create in (True, False):
            self.shared = pinpool.SharedMemory(path, create=create, keep=False)
            self.pool = pinpool.PinnedPool(
                layout=layouts.Raw(granularity_bytes=self.row_stride), size=self.nbytes, memory=self.shared,
                runtime=runtime, background=True, max_chunk_bytes=max_chunk_bytes, max_retries=0,
                node_slots=1, node_dir=node_dir, name=f"offload-rank{rank}", registry=None,
            )  # fmt: skip
            try:
                self.pool.open()
                self.creator = create
                break
            except pinpool.ConfigError:
                if not create or not os.path.exists(path):
                    raise  # not the "exists already" of a lost race: a real configuration error
        self.base = self.pool.tensor  # uint8, the whole region; every worker sees every byte

    def wait_pinned(self, timeout: float = 120.0) -> bool:
        """Wait for the pin; on failure fall back to a plain mapping of the file. Never raises a PinError."""
        try:
            self.pool.wait_ready_sync(timeout=timeout)
            return True
        except pinpool.PinError as error:
            logger.warning("pinning the offload region failed, using it unpinned (pageable copies): %s", error)
        with open(self.path, "r+b") as file:  # the region's bytes start at file offset 0
            self._plain = mmap.mmap(file.fileno(), self.nbytes, flags=mmap.MAP_SHARED)
        self.base = torch.frombuffer(memoryview(self._plain), dtype=torch.uint8)
        # The pool unregisters what it registered. A creator's pool would remove the file as it lets
        # go: keep it (decided late), and remove it in cleanup() as vLLM's creator does.
        self.shared.keep = True
        self.pool.close(raise_errors=False)
        return False

    @property
    def pinned(self) -> bool:
        return self._plain is None and self.pool.state is pinpool.PoolState.READY

    def worker_view(self, rank: int | None = None) -> torch.Tensor:
        """``(num_blocks, page_bytes)`` of one worker's slots, stride ``(row_stride, 1)`` (vLLM's worker view)."""
        offset = (self.rank if rank is None else rank) * self.page_bytes
        return torch.as_strided(self.base, (self.num_blocks, self.page_bytes), (self.row_stride, 1), offset)

    def cleanup(self) -> None:
        """Unpin, unmap; the creator's pool removes the file once it has let go. Idempotent, never raises."""
        self.base = torch.empty(0, dtype=torch.uint8)
        if (error := self.pool.close(raise_errors=False)) is not None:
            logger.warning("offload region closed with an error: %s", error)
        if self._plain is not None:  # the unpinned fallback: unmap, and the creator removes the file
            try:
                self._plain.close()
            except BufferError:  # a caller still holds a view: the mapping goes with the last one
                logger.warning("offload region: a view of the plain mapping is still held")
            self._plain = None
            if self.creator and os.path.exists(self.path):
                os.unlink(self.path)


class TimedMlock(MlockRuntime):
    """mlock that records when this process's first and last registration calls ran (to show pacing)."""

    def __init__(self, fail_on: int | None = None) -> None:
        super().__init__()
        self.fail_on, self.calls = fail_on, 0
        self.first: float | None = None
        self.last = 0.0
        self._count = threading.Lock()

    def lock_on_fault(self, ptr: int, nbytes: int) -> None:
        with self._count:
            self.calls += 1
            failing = self.calls == self.fail_on
            self.first = time.time() if self.first is None else self.first
        try:
            if failing:
                raise pinpool.RuntimeCallError(op="mlock2(MLOCK_ONFAULT)", code=errno.ENOMEM, reason="ENOMEM",
                                               ptr=ptr, nbytes=nbytes, message="injected: out of memory")  # fmt: skip
            super().lock_on_fault(ptr, nbytes)
        finally:
            self.last = time.time()

    def register(self, ptr: int, nbytes: int) -> None:
        self.lock_on_fault(ptr, nbytes)


def vm_locked_bytes() -> int:
    """The kernel's count of this process's locked memory (VmLck): mlock shows here, CUDA pinning does not."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclasses.dataclass(frozen=True)
class Job:
    path: str
    node_dir: str
    num_blocks: int
    page_bytes: int
    num_workers: int
    runtime: str
    fail_rank: int | None


def pattern(rank: int, num_blocks: int) -> torch.Tensor:
    """What worker ``rank`` writes in its slot of block b: bytes (rank * 64 + b) % 256, one per block row."""
    return ((rank * 64 + torch.arange(num_blocks)) % 256).to(torch.uint8)[:, None]


def worker(rank: int, job: Job, barrier: Any, results: Any) -> None:
    """One vLLM worker process: attach, pin, write its own slots, read the others', clean up."""
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    report: dict[str, Any] = {"rank": rank, "vmlck_before": vm_locked_bytes()}
    region = None
    try:
        runtime: str | Runtime = job.runtime
        timed = None
        if job.runtime == "mlock":
            runtime = timed = TimedMlock(fail_on=2 if rank == job.fail_rank else None)
        barrier.wait(timeout=60)  # every worker starts at once: the creation race, then the pacing
        region = SharedOffloadRegion(
            job.path, num_blocks=job.num_blocks, rank=rank, page_bytes=job.page_bytes, num_workers=job.num_workers,
            runtime=runtime, max_chunk_bytes=4 * MiB, node_dir=job.node_dir,
        )  # fmt: skip
        report["creator"] = region.creator
        report["pinned"] = region.wait_pinned()
        report["chunks"] = len(region.pool.chunks)
        report["vmlck_pinned"] = vm_locked_bytes()
        if timed is not None and timed.first is not None:
            report["register_window"] = (timed.first, timed.last)
        region.worker_view()[:] = pattern(rank, job.num_blocks)  # a worker writes only its own slots
        barrier.wait(timeout=60)  # every worker has written
        crossed = 0
        for other in range(job.num_workers):
            if other != rank:
                assert torch.equal(region.worker_view(other), pattern(other, job.num_blocks).expand(-1, job.page_bytes))
                crossed += job.num_blocks * job.page_bytes
        report["bytes_read_from_others"] = crossed
        barrier.wait(timeout=60)  # every worker has read: now the creator may let go of the file
    except BaseException as exc:
        report["error"] = repr(exc)
        barrier.abort()
        raise
    finally:
        if region is not None:
            region.cleanup()
        report["vmlck_after"] = vm_locked_bytes()
        results.put(report)


def run(job: Job, title: str) -> list[dict[str, Any]]:
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(job.num_workers), context.Queue()
    processes = [context.Process(target=worker, args=(rank, job, barrier, results)) for rank in range(job.num_workers)]
    for process in processes:
        process.start()
    reports = sorted((results.get(timeout=180) for _ in processes), key=lambda r: int(r["rank"]))
    for process in processes:
        process.join(timeout=60)
    print(f"== {title}: region {job.path}, {job.num_blocks} rows of {job.num_workers} x {job.page_bytes // KiB} KiB "
          f"= {job.num_blocks * job.page_bytes * job.num_workers} bytes")  # fmt: skip
    for r in reports:
        if "error" in r:
            print(f"rank {r['rank']}: error {r['error']}")
            continue
        print(f"rank {r['rank']}: {'created' if r['creator'] else 'attached'} the region; "
              f"{'pinned it' if r['pinned'] else 'pinning FAILED, serving from a plain mapping'} "
              f"({r['chunks']} chunks of whole rows); read {r['bytes_read_from_others']} bytes written by the other "
              "worker")  # fmt: skip
        print(f"VmLck: rank {r['rank']} before={r['vmlck_before']} pinned={r['vmlck_pinned']} "
              f"after={r['vmlck_after']} (bytes)")  # fmt: skip
    windows = sorted(r["register_window"] for r in reports if "register_window" in r)
    if len(windows) > 1:
        overlap = any(later[0] < earlier[1] for earlier, later in itertools.pairwise(windows))
        print(f"registration windows {'overlap' if overlap else 'do not overlap'} (node_slots=1: one worker at a time)")
    print(f"exit codes {[p.exitcode for p in processes]}; {job.path} "
          f"{'still exists' if os.path.exists(job.path) else 'is gone (the creator unlinked it)'}")  # fmt: skip
    return reports


def main(num_blocks: int, page_bytes: int, runtime: str) -> None:
    with tempfile.TemporaryDirectory(prefix="pinpool-node-") as node_dir:
        os.chmod(node_dir, 0o700)
        for title, fail_rank in (("two workers", None), ("worker 1's pinning fails", 1)):
            path = f"/dev/shm/vllm_offload_{os.getpid()}_{'ok' if fail_rank is None else 'fail'}.mmap"
            run(Job(path, node_dir, num_blocks, page_bytes, 2, runtime, fail_rank), title)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="vLLM's shared CPU offload region on pinpool, two worker processes.")
    parser.add_argument("--blocks", type=int, default=64, help="rows (KV blocks) in the region (default: 64)")
    parser.add_argument("--page-bytes", default="256KiB", help="one worker's slot in a row (default: 256KiB)")
    parser.add_argument("--runtime", default="mlock", help="mlock (default; shows VmLck and pacing), or auto/cuda")
    args = parser.parse_args()
    main(args.blocks, pinpool.parse_size(args.page_bytes), args.runtime)
