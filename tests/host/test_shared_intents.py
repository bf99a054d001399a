"""Write intents (docs/shared-memory.md, "After a crash"): ``with shared.writing(first, count)`` marks
pages "being written" in the region; after a writer's SIGKILL, ``suspect_pages()`` names exactly the
runs it may have left half-written, a live writer's never, and a mark is never torn."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import pinpool
from pinpool import ConfigError, PoolStateError, layouts
from pinpool._cli import check_region
from pinpool._shared import SharedMemory, layout_record, read_region, suspects_in

from .. import preloaded
from ..conftest import needs_mlock

MiB = 1 << 20
PAGES = 64
LAYOUT = layouts.MHA("page_first", layer_num=1, page_size=16, head_num=8, head_dim=128, dtype=torch.bfloat16)
PAGE = LAYOUT.page_bytes  # 64 KiB; the tests take page p as the bytes [p * PAGE, +PAGE): any map would do
ROOT = Path(__file__).resolve().parents[2]


def record() -> dict[str, object]:
    return layout_record(LAYOUT, PAGES)


def kept_region(path: Path) -> None:
    mapping = SharedMemory(path, keep=True).open_mapping(PAGES * PAGE, record())
    del mapping


# A writer that finishes pages 0-4, then dies inside writing(10, 4) with pages 10-11 written, 12-13 not.
WRITER = """
import ctypes, sys, time
import torch
from pinpool._cli import check_region
from pinpool._shared import SharedMemory, layout_record, read_region
from pinpool import layouts
path, page, pages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
layout = layouts.MHA("page_first", layer_num=1, page_size=16, head_num=8, head_dim=128, dtype=torch.bfloat16)
shared = SharedMemory(path, create=False)
m = shared.open_mapping(pages * page, layout_record(layout, pages))
with shared.writing(0, 5):
    ctypes.memset(m.address, 1, 5 * page)
with shared.writing(int(sys.argv[4]), int(sys.argv[5])):
    ctypes.memset(m.address + 10 * page, 2, 2 * page)
    print("INSIDE", flush=True)
    time.sleep(3600)
"""


def writer(path: Path, first: int = 10, count: int = 4) -> subprocess.Popen[str]:
    child = preloaded.spawn(
        [sys.executable, "-c", WRITER, str(path), str(PAGE), str(PAGES), str(first), str(count)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == "INSIDE\n", (line, child.communicate(timeout=60))
    return child  # type: ignore[return-value]


@needs_mlock
def test_a_writer_killed_inside_writing_leaves_exactly_its_pages_suspect(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept_region(path)
    shared = SharedMemory(path, create=False)
    with writer(path) as child:
        assert shared.suspect_pages() == ()  # a live writer's pages are being written, not suspect
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL
    assert shared.suspect_pages() == (range(10, 14),)  # read from the file, no pool mapping it
    listed = read_region(str(path), suspects=suspects_in)
    assert listed is not None and listed.suspect_pages == (range(10, 14),)
    assert "pages [10, 14) suspect (a writer died writing them" in check_region(listed).detail
    with pinpool.PinnedPool(layout=LAYOUT, num_pages=PAGES, memory=shared, runtime="mlock", registry=None):
        assert shared.suspect_pages() == (range(10, 14),)  # the same through the successor's mapping
        with open(path, "rb") as f:
            page = [f.read(PAGE) for _ in range(13)]
        assert set(page[4]) == {1} and set(page[11]) == {2} and set(page[12]) == {0}
        with shared.writing(40, 2):  # the successor's own writes: never suspect while it lives
            assert shared.suspect_pages() == (range(10, 14),)
        assert shared.clear_suspect_pages() == (range(10, 14),)  # the server dropped them from its index
        assert shared.suspect_pages() == ()
    assert SharedMemory(path, create=False).suspect_pages() == ()


@needs_mlock
def test_a_dead_writers_mark_is_never_taken_for_a_free_slot(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept_region(path)
    with writer(path, 3, 1) as child:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
    shared = SharedMemory(path, create=False)
    with pinpool.PinnedPool(layout=LAYOUT, num_pages=PAGES, memory=shared, runtime="mlock", registry=None):
        with contextlib.ExitStack() as stack:
            for page in range(63):  # 64 slots, one holding the dead writer's mark
                stack.enter_context(shared.writing(page, 1))
            with pytest.raises(PoolStateError, match="all 64 write-intent slots are held"):
                stack.enter_context(shared.writing(63, 1))
        assert shared.suspect_pages() == (range(3, 4),)  # still there, after 63 writers came and went


def test_writing_checks_its_run_and_needs_a_mapping(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept_region(path)
    shared = SharedMemory(path, create=False)
    with pytest.raises(PoolStateError, match="no pool maps the region"):
        shared.writing(0, 1)
    mapping = shared.open_mapping(PAGES * PAGE, record())
    for first, count, problem in [(60, 5, "not all in the region's 64 pages"), (0, 0, "count must be in"),
                                  (-1, 1, "must be an int >= 0"), (True, 1, "must be an int >= 0")]:  # fmt: skip
        with pytest.raises(ConfigError, match=problem):
            shared.writing(first, count).__enter__()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="holds no pinpool region yet"):
        SharedMemory(shm_dir / "missing", create=False).suspect_pages()
    del mapping


def test_a_slot_something_else_wrote_makes_every_page_suspect(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept_region(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size - 4096 + 3072 + 5 * 16)
        f.write(b"\x07" * 16)  # not a mark pinpool writes (its checksum does not match)
    assert SharedMemory(path, create=False).suspect_pages() == (range(0, PAGES),)


def test_a_region_made_without_room_for_intents_says_so(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept_region(path)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # as a pinpool before write intents made it: flag bit 1 clear
        f.seek(size - 4096 + 20)
        f.write((1).to_bytes(4, "little"))
    with pytest.raises(ConfigError, match="no room for write intents: made by a pinpool before them"):
        SharedMemory(path, create=False).suspect_pages()


def test_threads_write_at_once_and_leave_nothing_suspect(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept_region(path)
    shared = SharedMemory(path, create=False)
    mapping = shared.open_mapping(PAGES * PAGE, record())
    base = mapping.address
    start = threading.Barrier(8)

    def write(first: int) -> None:
        start.wait()
        for page in range(first, PAGES, 8):
            with shared.writing(page, 1):
                ctypes.memset(base + page * PAGE, page, PAGE)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert shared.suspect_pages() == ()
    assert bytes(mapping.view(5 * PAGE, 1).numpy()) == b"\x05"
    del mapping


def test_a_writer_killed_at_any_moment_leaves_every_torn_page_suspect(shm_dir: Path) -> None:
    """A forked writer loops over pages, each written in two halves inside writing(); SIGKILLed at a
    random moment, every page whose halves differ (torn) is in suspect_pages(), and at most one run is."""
    path = shm_dir / "kv"
    kept_region(path)
    shared = SharedMemory(path, create=False)
    mapping = shared.open_mapping(PAGES * PAGE, record())
    rng = random.Random(36)
    caught_inside = 0
    for round_number in range(25):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the writer: a new SharedMemory, its own open file and locks
            try:
                os.close(ready_r)
                own = SharedMemory(path, create=False)
                m = own.open_mapping(PAGES * PAGE, record())
                os.write(ready_w, b"x")
                value = round_number % 200 + 1
                while True:
                    for page in range(PAGES):
                        with own.writing(page, 1):
                            ctypes.memset(m.address + page * PAGE, value, PAGE // 2)
                            ctypes.memset(m.address + page * PAGE + PAGE // 2, value, PAGE // 2)
                    value = value % 200 + 1
            finally:
                os._exit(1)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"x"
        os.close(ready_r)
        threading.Event().wait(rng.uniform(0, 0.02))  # a random moment of its loop
        os.kill(pid, signal.SIGKILL)
        assert os.waitpid(pid, 0)[1] == signal.SIGKILL
        suspects = shared.suspect_pages()
        assert len(suspects) <= 1
        data = mapping.view(0, PAGES * PAGE).view(PAGES, 2, PAGE // 2)
        torn = {p for p in range(PAGES) if int(data[p, 0, 0]) != int(data[p, 1, -1])}
        caught_inside += bool(suspects)
        assert torn <= {p for run in suspects for p in run}, (round_number, torn, suspects)
        assert shared.clear_suspect_pages() == suspects and shared.suspect_pages() == ()
        for page in (p for run in suspects for p in run):  # the server dropped them: free, zeroed
            ctypes.memset(mapping.address + page * PAGE, 0, PAGE)
    assert caught_inside > 0  # most kills land inside writing(): it spans the page's two stores
    del mapping


def test_writers_sharing_one_open_file_by_descriptor_are_told_apart() -> None:
    """Two SharedMemory objects on one memfd (fd= handed on: one open file, as in two processes given the
    same descriptor): one's live writer is never the other's suspect, and they never share a slot."""
    first = SharedMemory()
    mapping = first.open_mapping(PAGES * PAGE, record())
    second = SharedMemory(fd=mapping.fd, create=False)
    other = second.open_mapping(PAGES * PAGE, record())
    with first.writing(0, 1):
        assert second.suspect_pages() == ()
        with second.writing(1, 1):
            assert first.suspect_pages() == ()
            slots = os.pread(mapping.fd, 1024, mapping.file_bytes - 1024)
            assert sum(slots[i : i + 16] != bytes(16) for i in range(0, 1024, 16)) == 2
    assert first.suspect_pages() == () == second.suspect_pages()
    del other, mapping


def test_a_dead_writers_forked_child_does_not_hide_its_marks(shm_dir: Path) -> None:
    """A writer forks a worker inside writing() and is SIGKILLed: the worker let go of its copy of the writer's
    open file at the fork, so the slot's lock died with the writer and its pages are suspect at once (they read
    as a live writer's for as long as the worker lived)."""
    path = shm_dir / "kv"
    kept_region(path)
    shared = SharedMemory(path, create=False)
    hold_read, hold_write = os.pipe()
    ready_read, ready_write = os.pipe()
    writer = os.fork()
    if writer == 0:  # pragma: no cover - the writer
        try:
            mine = SharedMemory(path, create=False)
            mapping = mine.open_mapping(PAGES * PAGE, record())
            with mine.writing(10, 4):
                ctypes.memset(mapping.address + 10 * PAGE, 2, PAGE)
                if os.fork() == 0:  # a worker forked mid-write: it outlives the writer
                    os.close(hold_write)
                    os.read(hold_read, 1)
                    os._exit(0)
                os.write(ready_write, b"+")
                threading.Event().wait()
        finally:
            os._exit(1)
    os.close(hold_read)
    try:
        assert os.read(ready_read, 1) == b"+"
        os.kill(writer, signal.SIGKILL)
        assert os.waitpid(writer, 0)[1] == signal.SIGKILL
        assert shared.suspect_pages() == (range(10, 14),)  # while the writer's worker still lives
    finally:
        os.close(hold_write)  # the worker exits
        os.close(ready_read)
        os.close(ready_write)
