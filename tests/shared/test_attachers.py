"""A shrink never punches pages another process maps (docs/shared-memory.md, "Giving pages back when several
processes map a region"): every mapping of a region holds an OFD read lock on one byte past its file's end, and a
give-back punches only once it converted that lock to a write lock, which the kernel grants only when no other
open file holds one. Real processes, real mlock, real /dev/shm; the kernel's OFD facts the design relies on are
checked here with two processes."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

import pinpool
from pinpool._errors import RegionInUseError
from pinpool._host import libc as _libc
from pinpool._pin import TEARDOWN_TRIES
from pinpool._shared import ATTACHERS_AT, SharedMemory, ofd_lock
from pinpool.testing import FakePressure, FakeRuntime, locked_bytes

from .. import preloaded
from ..conftest import needs_mlock
from ..host.cgroup_squeeze import ROOT
from ..pool.test_elastic_loop import CALM, PRESSED, Events, elastic_pool, wait_until
from ..pool.test_elastic_recovery import Raises
from ..pool.test_open_close import in_forked_child

MiB = 1 << 20
PAGE = _libc.PAGE_SIZE
DEADLINE_S = 30.0  # for what takes milliseconds: only a hang reaches it
SEGMENT = range(4 * MiB, 6 * MiB)  # the first segment above the floor (Raw: a page is a byte)

# Another process's read lock on the attachers' byte of a file: "asking", then "locked" once granted; it holds
# it until a line on stdin. Plain Python, no pinpool: the kernel's behaviour, not pinpool's, is under test.
LOCKER = """
import fcntl, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR)
print("asking", flush=True)
fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, int(sys.argv[2]), 1, 0))
print("locked", flush=True)
sys.stdin.readline()
"""


@contextlib.contextmanager
def locker(path: Path) -> Iterator[subprocess.Popen[str]]:
    argv = [sys.executable, "-c", LOCKER, str(path), str(ATTACHERS_AT)]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "asking\n"
            yield child
        finally:
            if child.poll() is None:
                child.kill()


def locked(child: subprocess.Popen[str]) -> bool:
    assert child.stdout is not None
    return child.stdout.readline() == "locked\n"


def let_go(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.wait(timeout=DEADLINE_S) == 0


def waits_for_the_lock(path: Path) -> bool:
    """Whether /proc/locks lists a blocked OFD read lock request on the attachers' byte of ``path``."""
    inode = os.stat(path).st_ino
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 1 :][:3] == ["OFDLCK", "ADVISORY", "READ"]:
            if fields[-3].endswith(f":{inode}") and fields[-2] == str(ATTACHERS_AT):
                return True
    return False


def test_the_kernels_ofd_lock_facts_the_give_back_relies_on(shm_dir: Path) -> None:
    path = shm_dir / "region"
    path.write_bytes(bytes(PAGE))
    mine = os.open(path, os.O_RDWR)
    third = os.open(path, os.O_RDWR)  # another open file of this process: the kernel tells open files apart
    try:
        assert ofd_lock(mine, ATTACHERS_AT, 1, fcntl.F_RDLCK, wait=True)
        assert ofd_lock(mine, ATTACHERS_AT, 1, fcntl.F_WRLCK)  # alone: the read lock converts
        assert ofd_lock(mine, ATTACHERS_AT, 1, fcntl.F_RDLCK)  # and back
        with locker(path) as other:
            assert locked(other)  # readers share the byte
            assert not ofd_lock(mine, ATTACHERS_AT, 1, fcntl.F_WRLCK)  # another process's reader: refused
            let_go(other)  # its lock goes with it
        assert not ofd_lock(third, ATTACHERS_AT, 1, fcntl.F_WRLCK)  # the refused conversion kept our read lock
        assert ofd_lock(mine, ATTACHERS_AT, 1, fcntl.F_WRLCK)  # alone again: converts
        with locker(path) as other:  # an attach while the hole is punched waits at its read lock ...
            deadline = time.monotonic() + DEADLINE_S
            while not waits_for_the_lock(path):
                assert time.monotonic() < deadline, Path("/proc/locks").read_text()
                time.sleep(0.002)
            assert ofd_lock(mine, ATTACHERS_AT, 1, fcntl.F_RDLCK)  # ... until the write lock is downgraded
            assert locked(other)
            let_go(other)
    finally:
        os.close(mine)
        os.close(third)


def test_a_forked_child_shares_its_parents_open_file_so_is_no_attacher(shm_dir: Path) -> None:
    """Documented, not detected: a forked child's pool lets go of the region and never shrinks; its inherited
    mapping does not hold a lock of its own, so the parent's give-back goes through while the child lives."""
    mapping = SharedMemory(shm_dir / "kv").open_mapping(2 * MiB, {"test": "attachers"})
    mapping.view(0, 2 * MiB).fill_(1)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: holds the inherited mapping until the parent is done
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        mapping.give_back(0, 2 * MiB)
        assert os.stat(shm_dir / "kv").st_blocks * 512 == PAGE  # punched: only the trailer's page is left
    finally:
        os.close(write)
        os.waitpid(child, 0)
    # The child let go of its copy of the lock at the fork, and gives back nothing: the pages are its parent's.
    assert in_forked_child(lambda: mapping.give_back(0, PAGE)).startswith("RegionInUseError")


def test_a_forked_child_outliving_its_parents_mapping_keeps_no_lock(shm_dir: Path) -> None:
    """The child's copy of the lock's descriptor is closed at the fork: once the parent unmaps and maps the region
    again (a new pool on it), its give-back goes through while the child still lives (it was refused for as long
    as the child held the inherited open file)."""
    first = SharedMemory(shm_dir / "kv", keep=True).open_mapping(2 * MiB, {"test": "attachers"})
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child: lives on until the parent is done
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        del first
        gc.collect()  # the parent's first mapping is gone, with its open file of the lock
        again = SharedMemory(shm_dir / "kv", create=False).open_mapping(2 * MiB, {"test": "attachers"})
        again.view(0, 2 * MiB).fill_(1)
        again.give_back(0, 2 * MiB)
        assert blocks(shm_dir / "kv") == PAGE  # punched: only the trailer's page is left
    finally:
        os.close(write)
        os.waitpid(child, 0)


# The other process: attaches to the region with the same pool, grows the segment the test's pool grew, writes a
# pattern into it, prints its SHA-256; on a line on stdin prints it again; exits on the next line.
ATTACHER = """
import hashlib, sys
import torch
import pinpool
MiB = 1 << 20
pool = pinpool.PinnedPool(
    size=4 * MiB, reserve=12 * MiB, grow_step=2 * MiB, chunk_bytes=MiB, runtime="mlock", registry=None,
    memory=pinpool.SharedMemory(sys.argv[1], create=False),
)
with pool:
    pool.grow_sync(pages=2 * MiB)
    segment = pool.tensor[4 * MiB : 6 * MiB]
    segment.copy_(torch.arange(2 * MiB).remainder(251).to(torch.uint8))
    for _ in range(2):
        print(hashlib.sha256(segment.numpy().tobytes()).hexdigest(), flush=True)
        sys.stdin.readline()
"""


def elastic(path: Path, **options: object) -> pinpool.PinnedPool:
    """4 MiB floor, 12 MiB reserved in segments of 2 MiB, on the region at ``path`` (created)."""
    given = {"size": 4 * MiB, "reserve": 12 * MiB, "grow_step": 2 * MiB, "chunk_bytes": MiB, "runtime": "mlock"}
    return pinpool.PinnedPool(memory=SharedMemory(path), **{"registry": None, **given, **options})  # type: ignore[arg-type]


def blocks(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def digest(pool: pinpool.PinnedPool) -> str:
    return hashlib.sha256(pool.tensor[SEGMENT.start : SEGMENT.stop].numpy().tobytes()).hexdigest()


def released_bytes(registry: CollectorRegistry, runtime: str = "mlock") -> float:
    return registry.get_sample_value("pinpool_released_bytes_total", {"pool": "attached", "runtime": runtime}) or 0.0


@needs_mlock
def test_a_shrink_leaves_pages_another_process_maps_and_punches_them_once_it_is_alone(shm_dir: Path) -> None:
    path, registry, events = shm_dir / "kv", CollectorRegistry(), Events()
    with elastic(path, name="attached", registry=registry, logger=events.logger) as pool:
        pool.grow_sync(pages=2 * MiB)
        held = blocks(path)
        argv = [sys.executable, "-c", ATTACHER, str(path)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with preloaded.Child(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env) as other:
            assert other.stdin is not None and other.stdout is not None
            written = other.stdout.readline().strip()
            assert digest(pool) == written  # one region: its pages are ours too
            before = locked_bytes()
            shrunk = pool.shrink_sync(to_pages=4 * MiB)
            assert (shrunk.released, shrunk.kept, shrunk.unreturned) == ((SEGMENT,), (), (SEGMENT,))
            assert before - locked_bytes() == 2 * MiB  # unpinned here ...
            assert blocks(path) == held  # ... but nothing punched
            [kept] = events.named("pool.shrink.kept_in_region")
            assert (kept["level"], kept["pages"], kept["bytes"]) == ("warning", "[4194304, 6291456)", 2 * MiB)
            assert "another process maps the region" in kept["reason"]
            assert not events.named("pool.failed")  # no failure: the rule at work
            assert events.named("pool.shrink", outcome="shrunk", bytes=0)
            assert released_bytes(registry) == 0  # nothing went back to the host
            other.stdin.write("\n")
            other.stdin.flush()
            assert other.stdout.readline().strip() == written  # its bytes are intact
            other.stdin.write("\n")
            other.stdin.flush()
            assert other.wait(timeout=DEADLINE_S) == 0
        pool.grow_sync(pages=2 * MiB)  # alone now: the next shrink of the segment gives it back
        shrunk = pool.shrink_sync(to_pages=4 * MiB)
        assert (shrunk.released, shrunk.unreturned) == ((SEGMENT,), ())
        assert held - blocks(path) == 2 * MiB
        assert released_bytes(registry) == 2 * MiB
        assert not pool.tensor[SEGMENT.start : SEGMENT.stop].any()  # a hole reads zero


@pytest.mark.anyio
async def test_an_async_shrink_keeps_what_another_mapping_holds_then_gives_it_back(shm_dir: Path) -> None:
    """The async drivers give back on a thread of their own: the same rule, with a second mapping of the region
    in this process (another open file: another attacher)."""
    path = shm_dir / "kv"
    async with elastic(path, runtime=FakeRuntime()) as pool:
        await pool.grow(pages=2 * MiB)
        other = pinpool.PinnedPool(
            size=4 * MiB, reserve=12 * MiB, grow_step=2 * MiB, chunk_bytes=MiB, runtime=FakeRuntime(), registry=None,
            memory=SharedMemory(path, create=False),
        )  # fmt: skip
        async with other:
            pool.tensor[SEGMENT.start : SEGMENT.stop].fill_(9)
            shrunk = await pool.shrink(to_pages=4 * MiB)
            assert shrunk.unreturned == (SEGMENT,)
            assert int(other.tensor[SEGMENT.start : SEGMENT.stop].sum()) == 9 * len(SEGMENT)
        del other
        gc.collect()  # its mapping goes with the pool
        await pool.grow(pages=2 * MiB)
        held = blocks(path)
        shrunk = await pool.shrink(to_pages=4 * MiB)
        assert (shrunk.released, shrunk.unreturned) == ((SEGMENT,), ())
        assert held - blocks(path) == 2 * MiB


def attachable(path: Path) -> bool:
    """Whether a new mapping of the region would be made now (no give-back holds the write lock)."""
    probe = os.open(path, os.O_RDWR)
    try:
        return ofd_lock(probe, ATTACHERS_AT, 1, fcntl.F_RDLCK)
    finally:
        os.close(probe)


def test_an_unmapped_region_is_no_attacher_and_a_mapping_refuses_while_another_lives(shm_dir: Path) -> None:
    record, path = {"test": "attachers"}, shm_dir / "kv"
    first = SharedMemory(path).open_mapping(2 * MiB, record)
    second = SharedMemory(path, create=False).open_mapping(2 * MiB, record)
    with pytest.raises(RegionInUseError, match=r"\[0, \+2097152\) \(2 MiB\) was not given back: another process"):
        first.give_back(0, 2 * MiB)
    with pytest.raises(RegionInUseError):
        second.give_back(0, 2 * MiB)
    assert blocks(path) == 2 * MiB + PAGE and attachable(path)
    second._finalizer()  # unmapped: its lock goes with it
    first.give_back(0, 2 * MiB)
    assert blocks(path) == PAGE
    assert attachable(path)  # back to the read lock: the next attach is not kept waiting


@needs_mlock
def test_the_policy_stops_shrinking_for_nothing_while_another_process_maps_the_region(shm_dir: Path) -> None:
    """Under pressure with another process mapping the region, a shrink unpins the pages but frees nothing: the
    loop says so once and takes no more of the server's pages within cooldown_seconds while the pressure lasts;
    the next episode, the region alone, gives memory back again."""
    path, events, pressure = shm_dir / "kv", Events(), FakePressure()
    pool, _box = elastic_pool(events, pressure, options={"memory": SharedMemory(path)}, cooldown_seconds=3600.0)
    with pool:
        pool.grow_sync(nbytes=8 * MiB)
        with locker(path) as other:
            assert locked(other)  # another open file maps the region now (as another pool's mapping does)
            pressure.set(PRESSED)
            [futile] = events.wait("elastic.shrink_futile")
            assert futile["bytes"] == 2 * MiB and pool.pinned_runs == (range(0, 10 * MiB),)
            for _ in range(3):  # pressed on: read, decided, and nothing more taken
                read = pressure.reads
                pressure.set(PRESSED)
                wait_until(lambda r=read: pressure.reads > r)
            assert pool.pinned_runs == (range(0, 10 * MiB),) and len(events.named("pool.shrink")) == 1
            let_go(other)
        read = pressure.reads
        pressure.set(CALM)  # the episode ends ...
        wait_until(lambda: pressure.reads > read)
        held = blocks(path)
        pressure.set(PRESSED)  # ... and the next one, the region alone, gives memory back
        events.wait("pool.shrink", outcome="shrunk", bytes=2 * MiB)
        assert blocks(path) < held


def test_a_finished_segment_kept_in_the_region_counts_nothing_given_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shrink whose teardown raised leaves its segment releasing; the next shrink finishes it, but another
    process maps the region, so its pages stay in the file: the shrink reports 0 bytes given back (it said -2 MiB
    and the metric update failed), and the segment is counted once, when its pages do go back."""
    path, registry, events = shm_dir / "kv", CollectorRegistry(), Events()
    raises = Raises(monkeypatch, "begin_teardown")
    with elastic(path, name="attached", registry=registry, logger=events.logger, runtime=FakeRuntime()) as pool:
        pool.grow_sync(pages=2 * MiB)
        raises.arm(TEARDOWN_TRIES)
        with pytest.raises(pinpool.UnpinError):
            pool.shrink_sync(to_pages=4 * MiB)
        other = os.open(path, os.O_RDWR)  # another process's mapping, as far as the region can tell
        try:
            assert ofd_lock(other, ATTACHERS_AT, 1, fcntl.F_RDLCK)
            shrunk = pool.shrink_sync(to_pages=pool.num_pages)
        finally:
            os.close(other)
        assert (shrunk.released, shrunk.recovered, shrunk.unreturned) == ((), (SEGMENT,), (SEGMENT,))
        assert events.named("pool.shrink", outcome="kept", bytes=0)
        assert pool._observer.metric_errors == 0 and released_bytes(registry, "fake") == 0
        pool.grow_sync(pages=2 * MiB)  # the region alone now: the segment's pages go back, counted once
        pool.shrink_sync(to_pages=4 * MiB)
        assert released_bytes(registry, "fake") == 2 * MiB


@needs_mlock
def test_after_cooldown_the_policy_tries_again_and_frees_memory_once_the_region_is_alone(shm_dir: Path) -> None:
    """A futile shrink holds the loop back for cooldown_seconds only (0 here): pressed on, once the other process
    let go of the region, the next shrink gives memory back within the same episode."""
    path, events, pressure = shm_dir / "kv", Events(), FakePressure()
    pool, _box = elastic_pool(events, pressure, options={"memory": SharedMemory(path)}, cooldown_seconds=0.0)
    with pool:
        pool.grow_sync(nbytes=8 * MiB)
        with locker(path) as other:
            assert locked(other)
            pressure.set(PRESSED)
            events.wait("elastic.shrink_futile")
            let_go(other)
        held = blocks(path)
        pressure.set(PRESSED)  # the same episode
        events.wait("pool.shrink", outcome="shrunk", bytes=2 * MiB)
        assert blocks(path) < held
