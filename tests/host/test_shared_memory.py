"""pinpool.SharedMemory: MAP_SHARED regions on tmpfs, hugetlbfs and memfds (pinpool/_shared/).

Create / attach / keep / unlink, the trust checks on directories and files, the trailer that
refuses a re-attach with another size or layout, memfds and descriptors handed on, two processes
on one region (mlock in each), the generation number, and that a mapping is never unmapped at
interpreter exit. Regions live in a private directory under /dev/shm, removed after each test.
hugetlbfs cases run only where a hugetlbfs mount (or the hugetlb pool, for memfds) has free pages.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import os
import re
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

import pytest
import torch

import pinpool
from pinpool import layouts
from pinpool._cli import OK, WARN, check_region, read_facts, run_checks
from pinpool._host import libc as _libc
from pinpool._shared import MAGIC, TRAILER_BYTES, SharedMapping, SharedMemory, find_regions, layout_record, read_region
from pinpool.runtimes import MlockRuntime
from pinpool.testing import locked_bytes

from .. import preloaded
from ..conftest import hugetlb_pages, needs_mlock

MiB = 1 << 20
PAGE = _libc.PAGE_SIZE
ROOT = Path(__file__).resolve().parents[2]


def record(nbytes: int, layout: layouts.Layout | None = None) -> dict[str, object]:
    layout = layout or layouts.Raw()
    return layout_record(layout, nbytes // layout.page_bytes)


def collect() -> None:
    gc.collect()
    gc.collect()


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# -- create, attach, keep, unlink ---------------------------------------------------------------------


def test_create_makes_the_file_with_its_trailer_and_maps_it(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    shared = SharedMemory(path)
    assert shared.path == str(path) and shared.fd is None and shared.page_size == PAGE
    assert not path.exists()  # nothing is created before the pool maps it
    mapping = shared.open_mapping(3 * MiB + 5, record(3 * MiB + 5))
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_nlink == 1
    assert st.st_size == 3 * MiB + PAGE + PAGE  # the data rounded to pages, then the trailer's page
    assert mapping.address % PAGE == 0 and mapping.length == 3 * MiB + PAGE and mapping.nbytes == 3 * MiB + 5
    assert mapping.huge_pages is False and mapping.created and mapping.path == str(path)
    assert shared.fd == mapping.fd and shared._mapping is mapping
    raw = path.read_bytes()[-TRAILER_BYTES:]
    assert raw.startswith(MAGIC)
    info = shared._region()
    assert info is not None and info.nbytes == 3 * MiB + 5 and info.generation == 0 and not info.keep
    assert info.record == record(3 * MiB + 5) and info.created_pid == os.getpid() and info.creator_alive is True
    view = mapping.view(0, 3 * MiB + 5)
    view[-1] = 9
    assert path.read_bytes()[3 * MiB + 4] == 9  # the pool's bytes are the file's, from offset 0
    del view, mapping
    collect()
    assert not path.exists()


def test_the_creator_removes_the_file_when_the_last_view_is_gone(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    shared = SharedMemory(path)
    mapping = shared.open_mapping(MiB, record(MiB))
    fd = mapping.fd
    view = mapping.view(0, MiB)
    del mapping
    collect()
    assert path.exists() and fd_open(fd) and shared._mapping is not None  # the view holds the mapping
    view.fill_(1)
    del view
    collect()
    assert not path.exists() and not fd_open(fd) and shared._mapping is None and shared.fd is None


def test_keep_leaves_the_region_and_an_attach_sees_its_bytes_and_generation(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    shared = SharedMemory(path, keep=True)
    mapping = shared.open_mapping(2 * MiB, record(2 * MiB))
    mapping.view(0, 2 * MiB).copy_(pinpool_pattern(2 * MiB))
    shared.set_generation(41)
    del mapping
    collect()
    assert path.exists() and shared._mapping is None
    info = read_region(str(path))
    assert info is not None and info.keep and info.generation == 41 and info.held_bytes == 2 * MiB + PAGE
    again = SharedMemory(path, create=False)
    assert again.generation == 41  # read from the file, before mapping
    attached = again.open_mapping(2 * MiB, record(2 * MiB))
    assert not attached.created and attached.generation == 41
    assert bytes(attached.view(0, 2 * MiB).numpy()) == bytes(pinpool_pattern(2 * MiB).numpy())
    attached.set_generation(42)
    del attached
    collect()
    assert path.exists()  # an attacher never removes the file
    assert read_region(str(path)).generation == 42  # type: ignore[union-attr]


def pinpool_pattern(nbytes: int) -> torch.Tensor:
    return (torch.arange(nbytes, dtype=torch.int64) * 7 % 251).to(torch.uint8)


def test_keep_can_be_decided_at_shutdown(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    shared = SharedMemory(path)
    mapping = shared.open_mapping(MiB, record(MiB))
    shared.keep = True
    assert read_region(str(path)).keep  # type: ignore[union-attr]  # the trailer's flag follows
    del mapping
    collect()
    assert path.exists()
    # The same object opened again re-attaches to what it made; dropping keep removes it then.
    shared.keep = False
    mapping = shared.open_mapping(MiB, record(MiB))
    assert mapping.created
    del mapping
    collect()
    assert not path.exists()


def test_the_creator_removes_only_the_file_it_made(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    shared = SharedMemory(path)
    mapping = shared.open_mapping(MiB, record(MiB))
    path.unlink()
    path.write_bytes(b"someone else's")  # an operator removed it, and the name was reused
    del mapping
    collect()
    assert path.read_bytes() == b"someone else's"


def test_exclusive_create_refuses_an_existing_file(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    path.write_bytes(b"x" * 10)
    with pytest.raises(pinpool.ConfigError, match=r"exists already; attach to it with create=False, or remove it"):
        SharedMemory(path).open_mapping(MiB, record(MiB))
    assert path.read_bytes() == b"x" * 10
    path.unlink()
    kept = SharedMemory(path, keep=True).open_mapping(MiB, record(MiB))
    del kept
    collect()
    with pytest.raises(pinpool.ConfigError, match=r"holds a pinpool region already \(1 MiB \(raw layout"):
        SharedMemory(path).open_mapping(MiB, record(MiB))
    assert path.exists()


def test_attaching_to_a_missing_file_is_a_config_error(shm_dir: Path) -> None:
    with pytest.raises(pinpool.ConfigError, match=r"does not exist; create it with create=True"):
        SharedMemory(shm_dir / "nope", create=False).open_mapping(MiB, record(MiB))


def test_one_pool_maps_a_shared_memory_at_a_time(shm_dir: Path) -> None:
    shared = SharedMemory(shm_dir / "kv")
    mapping = shared.open_mapping(MiB, record(MiB))
    with pytest.raises(pinpool.PoolStateError, match="mapped by another pool"):
        shared.open_mapping(MiB, record(MiB))
    mapping.keep_forever()  # a leaked chunk: never unmapped, so still "mapped"
    del mapping
    collect()
    assert shared._mapping is not None


# -- trust: directories and files ---------------------------------------------------------------------


def test_a_symbolic_link_to_a_region_is_refused(shm_dir: Path) -> None:
    real = shm_dir / "real"
    kept = SharedMemory(real, keep=True).open_mapping(MiB, record(MiB))
    del kept
    collect()
    link = shm_dir / "link"
    link.symlink_to(real)
    with pytest.raises(pinpool.ConfigError, match=r"'.*/link' is a symbolic link"):
        SharedMemory(link, create=False).open_mapping(MiB, record(MiB))
    with pytest.raises(pinpool.ConfigError, match=r"exists already as a symbolic link"):
        SharedMemory(link).open_mapping(MiB, record(MiB))
    dangling = shm_dir / "dangling"
    dangling.symlink_to(shm_dir / "target-that-does-not-exist")
    with pytest.raises(pinpool.ConfigError, match="symbolic link"):
        SharedMemory(dangling).open_mapping(MiB, record(MiB))
    assert not (shm_dir / "target-that-does-not-exist").exists()  # never created through the link


def test_untrusted_directories_are_refused(shm_dir: Path) -> None:
    linked = shm_dir / "linked-dir"
    linked.symlink_to(shm_dir)
    with pytest.raises(pinpool.ConfigError, match=r"directory '.*linked-dir' is a symbolic link"):
        SharedMemory(linked / "kv")
    open_to_all = shm_dir / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(pinpool.ConfigError, match=r"group- or world-writable without the sticky bit \(mode 0o777\)"):
        SharedMemory(open_to_all / "kv")
    sticky = shm_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /dev/shm and /tmp: others may add names, not replace ours
    SharedMemory(sticky / "kv")
    SharedMemory("/dev/shm/pinpool-test-never-created")
    with pytest.raises(pinpool.ConfigError, match=r"its parent|cannot be used: No such file"):
        SharedMemory(shm_dir / "missing" / "kv")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory and a file to another user")
def test_a_directory_or_file_of_another_user_is_refused(shm_dir: Path) -> None:
    theirs = shm_dir / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(pinpool.ConfigError, match=r"owned by uid 4242, neither this process's uid 0 nor root"):
        SharedMemory(theirs / "kv")
    path = shm_dir / "kv"
    kept = SharedMemory(path, keep=True).open_mapping(MiB, record(MiB))
    del kept
    collect()
    os.chown(path, 4242, 4242)
    with pytest.raises(pinpool.ConfigError, match=r"is owned by uid 4242, not by this process's uid 0"):
        SharedMemory(path, create=False).open_mapping(MiB, record(MiB))


def test_a_file_others_could_write_a_hard_link_and_a_fifo_are_refused(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    kept = SharedMemory(path, keep=True).open_mapping(MiB, record(MiB))
    del kept
    collect()
    path.chmod(0o660)
    with pytest.raises(pinpool.ConfigError, match=r"group- or world-writable \(mode 0o660\)"):
        SharedMemory(path, create=False).open_mapping(MiB, record(MiB))
    path.chmod(0o600)
    os.link(path, shm_dir / "other-name")
    for name in ("kv", "other-name"):
        with pytest.raises(pinpool.ConfigError, match=r"has 2 hard links"):
            SharedMemory(shm_dir / name, create=False).open_mapping(MiB, record(MiB))
    fifo = shm_dir / "fifo"
    os.mkfifo(fifo, 0o600)
    started = time.monotonic()
    with pytest.raises(pinpool.ConfigError, match=r"is not a regular file \(a FIFO\)"):
        SharedMemory(fifo, create=False).open_mapping(MiB, record(MiB))
    assert time.monotonic() - started < 30  # never waits for a writer (that would be for ever)


def test_a_directory_not_in_memory_is_refused(tmp_path: Path) -> None:
    f_type, _ = _libc.statfs(str(tmp_path))
    if f_type in (_libc.TMPFS_MAGIC, _libc.HUGETLBFS_MAGIC):
        pytest.skip(f"{tmp_path} is on tmpfs here")
    with pytest.raises(pinpool.ConfigError, match=r"not tmpfs or hugetlbfs: a pool's pages must be memory"):
        SharedMemory(tmp_path / "kv")


# -- the trailer: foreign files, other sizes and layouts ------------------------------------------------


def make_region(path: Path, nbytes: int = MiB, rec: dict[str, object] | None = None) -> None:
    mapping = SharedMemory(path, keep=True).open_mapping(nbytes, rec or record(nbytes))
    del mapping
    collect()


def test_attaching_with_another_size_layout_or_page_count_names_both(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    mha = layouts.MHA("page_first", layer_num=3, page_size=4, head_num=2, head_dim=8, dtype=torch.bfloat16)
    held = layout_record(mha, 100)
    nbytes = 100 * mha.page_bytes
    make_region(path, nbytes, held)
    with pytest.raises(pinpool.ConfigError) as info:
        SharedMemory(path, create=False).open_mapping(2 * nbytes, layout_record(mha, 200))
    text = str(info.value)
    assert re.search(r"holds .*\(mha/page_first layout, 100 pages of \d+ bytes\), but the pool asks for", text)
    assert "(mha/page_first layout, 200 pages" in text and "num_pages: 100 in the file, 200 asked" in text
    assert f"size: {_fmt(nbytes)} ({nbytes} bytes) in the file, {_fmt(2 * nbytes)} ({2 * nbytes} bytes) asked" in text
    layer_first = layouts.MHA("layer_first", layer_num=3, page_size=4, head_num=2, head_dim=8, dtype=torch.bfloat16)
    with pytest.raises(pinpool.ConfigError, match=r'layout: "mha/page_first" in the file, "mha/layer_first" asked'):
        SharedMemory(path, create=False).open_mapping(nbytes, layout_record(layer_first, 100))
    with pytest.raises(pinpool.ConfigError, match=r"size: .* in the file, .* asked\. A region is attached only"):
        SharedMemory(path, create=False).open_mapping(nbytes + PAGE, held)
    mapping = SharedMemory(path, create=False).open_mapping(nbytes, held)  # the same: attaches
    assert mapping.nbytes == nbytes


def _fmt(n: int) -> str:
    from pinpool._units import format_bytes

    return format_bytes(n)


def write_trailer(path: Path, raw: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(-TRAILER_BYTES, os.SEEK_END)
        f.write(raw)


def test_foreign_and_corrupt_files_are_not_regions(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    path.write_bytes(os.urandom(3 * PAGE))
    with pytest.raises(pinpool.ConfigError, match=r"is not a pinpool region, or a newer format"):
        SharedMemory(path, create=False).open_mapping(PAGE, record(PAGE))
    path.write_bytes(b"\0" * 100)
    with pytest.raises(pinpool.ConfigError, match=r"too small \(100 bytes\) for a pinpool region"):
        SharedMemory(path, create=False).open_mapping(PAGE, record(PAGE))
    make_region(path2 := shm_dir / "newer", PAGE)
    raw = bytearray(path2.read_bytes()[-TRAILER_BYTES:])
    struct.pack_into("<I", raw, 8, 2)
    write_trailer(path2, bytes(raw))
    with pytest.raises(pinpool.ConfigError, match=r"format version 2; this pinpool reads version 1: not a pinpool"):
        SharedMemory(path2, create=False).open_mapping(PAGE, record(PAGE))
    struct.pack_into("<I", raw, 8, 1)
    raw[60] ^= 0xFF  # a byte of the JSON body
    write_trailer(path2, bytes(raw))
    with pytest.raises(pinpool.ConfigError, match=r"corrupt pinpool trailer \(its checksum"):
        SharedMemory(path2, create=False).open_mapping(PAGE, record(PAGE))
    assert read_region(str(path2)) is None and read_region(str(path)) is None


def test_a_region_truncated_or_grown_behind_pinpools_back_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    make_region(path, MiB)
    with open(path, "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(b"\0" * PAGE + data)  # grown by a page: the trailer is still last
    with pytest.raises(pinpool.ConfigError, match=r"truncated or grown by something else than pinpool"):
        SharedMemory(path, create=False).open_mapping(MiB, record(MiB))


def test_an_empty_file_no_creator_finishes_is_refused_after_a_short_wait(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    path.touch(mode=0o600)
    started = time.monotonic()
    with pytest.raises(pinpool.ConfigError, match=r"is empty: not initialised yet; its creator died while creating"):
        SharedMemory(path, create=False).open_mapping(MiB, record(MiB))
    assert 0.4 < time.monotonic() - started < 30  # the 0.5 s grace, then refused: not for ever


def test_attach_waits_for_a_creation_in_progress(shm_dir: Path) -> None:
    source = shm_dir / "finished"
    make_region(source, MiB)
    path = shm_dir / "kv"
    path.touch(mode=0o600)
    creator = os.open(path, os.O_RDWR)  # plays the creator: LOCK_EX from the exclusive open on
    fcntl.flock(creator, fcntl.LOCK_EX)
    results: list[object] = []

    def attach() -> None:
        try:
            results.append(SharedMemory(path, create=False).open_mapping(MiB, record(MiB)))
        except Exception as exc:
            results.append(exc)

    thread = threading.Thread(target=attach)
    thread.start()
    time.sleep(0.8)  # longer than the grace for an unlocked empty file: the lock says "in progress"
    assert not results
    os.write(creator, source.read_bytes())
    fcntl.flock(creator, fcntl.LOCK_UN)
    thread.join(10)
    os.close(creator)
    assert isinstance(results[0], SharedMapping), results


# -- memfd and descriptors handed on --------------------------------------------------------------------


CHILD_ATTACH = """
import sys, gc
from pinpool._shared import SharedMemory, layout_record
from pinpool import layouts
fd, nbytes = int(sys.argv[1]), int(sys.argv[2])
m = SharedMemory(fd=fd, create=False).open_mapping(nbytes, layout_record(layouts.Raw(), nbytes))
v = m.view(0, nbytes)
print("CHILD_READ", int(v[12345]), m.generation, flush=True)
v[54321] = 77
m.set_generation(m.generation + 1)
"""


def test_a_memfd_is_shared_by_descriptor_with_an_execd_child() -> None:
    shared = SharedMemory()
    assert shared.path is None and shared.fd is None and shared.page_size == PAGE
    mapping = shared.open_mapping(MiB, record(MiB))
    fd = shared.fd
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:pinpool-region")
    assert _libc.fstatfs(fd)[0] == _libc.TMPFS_MAGIC
    mapping.view(12345, 1).fill_(99)
    result = preloaded.run(
        [sys.executable, "-c", CHILD_ATTACH, str(fd), str(MiB)], pass_fds=[fd], capture_output=True, text=True,
        timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "CHILD_READ 99 0" in result.stdout
    assert int(mapping.view(54321, 1)[0]) == 77 and mapping.generation == 1
    with pytest.raises(OSError):  # sealed: nobody shrinks it under the mappings
        os.ftruncate(fd, PAGE)
    del mapping
    collect()
    assert not fd_open(fd) and shared.fd is None


def test_fd_handed_on_stays_the_callers_and_create_needs_an_empty_file(shm_dir: Path) -> None:
    path = shm_dir / "handed"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # e.g. SGLang's shm allocator's
    try:
        shared = SharedMemory(fd=fd)
        assert shared.fd == fd and shared.path is None
        mapping = shared.open_mapping(MiB, record(MiB))
        assert mapping.fd != fd and mapping.created
        mapping.view(0, 1).fill_(5)
        del mapping
        collect()
        assert fd_open(fd) and path.exists()  # the caller's descriptor and name are the caller's
        with pytest.raises(
            pinpool.ConfigError, match=r"holds 1 MiB already: create=True makes a region only in an empty"
        ):
            SharedMemory(fd=fd).open_mapping(MiB, record(MiB))
        attached = SharedMemory(fd=fd, create=False).open_mapping(MiB, record(MiB))
        assert int(attached.view(0, 1)[0]) == 5
    finally:
        os.close(fd)


def test_invalid_arguments_are_config_errors(shm_dir: Path) -> None:
    bad: list[tuple[dict[str, object], str]] = [
        ({"path": shm_dir / "kv", "fd": 0}, "give one"),
        ({"keep": True}, "a memfd has no name to keep"),
        ({"create": False}, "needs something to attach to"),
        ({"path": shm_dir / "kv", "mode": 0o666}, "nobody else to write it"),
        ({"path": shm_dir / "kv", "mode": 0o400}, "owner must be able to read and write"),
        ({"path": shm_dir / "kv", "create": "yes"}, "must be True or False"),
        ({"path": b"/dev/shm/kv"}, "must be a str or os.PathLike"),
        ({"path": str(shm_dir) + "/"}, "name a file, not a directory"),
        ({"fd": 987654}, "not an open descriptor"),
        ({"fd": -1}, "must be an open file descriptor"),
        ({"huge_page_size": "4MiB"}, "a memfd's huge pages are 2 MiB or 1 GiB"),
        ({"path": shm_dir / "kv", "huge_page_size": "2MiB"}, "has 4 KiB pages, not 2 MiB .it is not on hugetlbfs"),
    ]
    for kwargs, message in bad:
        with pytest.raises(pinpool.ConfigError, match=message):
            SharedMemory(**kwargs)  # type: ignore[arg-type]
    with open("/dev/null", "rb") as devnull, pytest.raises(pinpool.ConfigError, match="not a regular file"):
        SharedMemory(fd=devnull.fileno(), create=False)
    shared = SharedMemory(shm_dir / "kv")
    with pytest.raises(pinpool.ConfigError, match="positive int"):
        shared.open_mapping(0, {})
    with pytest.raises(pinpool.ConfigError, match="JSON values"):
        shared.open_mapping(MiB, {"x": object()})
    with pytest.raises(pinpool.ConfigError, match=r"generation=-1 must be an integer in \[0, 2\*\*64\)"):
        shared.set_generation(-1)
    with pytest.raises(pinpool.ConfigError, match="holds no pinpool region yet"):
        _ = shared.generation


# -- memory: resident bytes, generation without a mapping --------------------------------------------------


def test_resident_bytes_counts_what_the_file_holds(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    shared = SharedMemory(path, keep=True)
    assert shared.resident_bytes(4 * MiB) == 0 and shared.new_bytes(4 * MiB) == 4 * MiB + PAGE
    mapping = shared.open_mapping(4 * MiB, record(4 * MiB))
    assert mapping.file_bytes == 4 * MiB + PAGE
    # /dev/shm has a size limit: creating reserved every page (posix_fallocate), so all of it is memory
    assert shared.resident_bytes(4 * MiB) == 4 * MiB and shared.new_bytes(4 * MiB) == 0
    del mapping
    collect()
    trailer = path.read_bytes()[-TRAILER_BYTES:]
    os.truncate(path, 0)  # the region again, holding part of its pages (sparse): as after a swap-out
    with open(path, "r+b") as f:
        f.truncate(4 * MiB + PAGE)
        f.write(b"\1" * (3 * MiB // 2))
        f.seek(4 * MiB)
        f.write(trailer)
    attacher = SharedMemory(path, create=False)
    assert attacher.resident_bytes(4 * MiB) == 3 * MiB // 2 and attacher.new_bytes(4 * MiB) == 5 * MiB // 2
    attacher.set_generation(7)  # no mapping: the trailer's page is mapped for the moment
    assert attacher.generation == 7 and shared.generation == 7


# -- two processes, mlock, interpreter exit ---------------------------------------------------------


def vmlck_kb() -> int:
    return locked_bytes() // 1024


SECOND_PROCESS = """
import sys
from pinpool._host import libc as _libc
from pinpool._shared import SharedMemory, layout_record
from pinpool import layouts
from pinpool.runtimes import MlockRuntime
path, nbytes = sys.argv[1], int(sys.argv[2])
m = SharedMemory(path, create=False).open_mapping(nbytes, layout_record(layouts.Raw(), nbytes))
runtime = MlockRuntime()
runtime.register(m.address, m.length)
v = m.view(0, nbytes)
print("CHILD_VMLCK", _libc.vm_locked_bytes(), "CHILD_SAW", int(v[nbytes - 1]), flush=True)
v[0] = 123
runtime.unregister(m.address)
print("CHILD_VMLCK_AFTER", _libc.vm_locked_bytes(), flush=True)
"""


@needs_mlock
def test_two_processes_map_one_region_each_locks_it_and_bytes_cross(shm_dir: Path, vmlck_baseline: int) -> None:
    path = shm_dir / "kv"
    nbytes = 64 * MiB
    shared = SharedMemory(path)
    mapping = shared.open_mapping(nbytes, record(nbytes))
    runtime = MlockRuntime()
    runtime.register(mapping.address, mapping.length)
    assert locked_bytes() - vmlck_baseline == nbytes
    mapping.view(nbytes - 1, 1).fill_(211)
    result = preloaded.run(
        [sys.executable, "-c", SECOND_PROCESS, str(path), str(nbytes)], capture_output=True, text=True, timeout=120,
        cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"CHILD_VMLCK {nbytes} CHILD_SAW 211" in result.stdout  # locked in its own mapping, too
    assert "CHILD_VMLCK_AFTER 0" in result.stdout
    assert int(mapping.view(0, 1)[0]) == 123
    assert locked_bytes() - vmlck_baseline == nbytes  # the child's munlock left ours locked
    runtime.unregister(mapping.address)
    assert locked_bytes() == vmlck_baseline
    del mapping
    collect()
    assert not path.exists()


@needs_mlock
def test_mlock_of_a_shared_mapping_locks_its_pages_in_smaps(shm_dir: Path, vmlck_baseline: int) -> None:
    shared = SharedMemory(shm_dir / "kv")
    mapping = shared.open_mapping(16 * MiB, record(16 * MiB))
    assert _libc.mlock(mapping.address, mapping.length) == 0
    locked = smaps_field(mapping.address, "Locked")
    assert locked == 16 * MiB // 1024 and locked_bytes() - vmlck_baseline == 16 * MiB
    assert smaps_field(mapping.address, "Rss") == 16 * MiB // 1024
    assert _libc.munlock(mapping.address, mapping.length) == 0
    assert locked_bytes() == vmlck_baseline


def smaps_field(address: int, field: str) -> int:
    """``field`` (kB) of the mapping that starts at ``address`` in /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == f"{field}:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


EXIT_SCRIPT = """
import atexit, os, re
state = {}
def _at_the_very_end():
    with open("/proc/self/maps") as f:
        mapped = any(int(line.split("-")[0], 16) == state["address"] for line in f)
    with open("/proc/self/status") as f:
        kb = int(re.search(r"VmLck:\\s+(\\d+)", f.read()).group(1))
    print("AT_EXIT mapped", mapped, "vmlck_kb", kb, "file", os.path.exists(state["path"]), flush=True)
atexit.register(_at_the_very_end)  # first registered: runs after every finalizer
import sys
from pinpool._host import libc as _libc
from pinpool._shared import SharedMemory, layout_record
from pinpool import layouts
path = sys.argv[1]
m = SharedMemory(path).open_mapping(8 << 20, layout_record(layouts.Raw(), 8 << 20))
assert _libc.mlock(m.address, m.length) == 0
state.update(address=m.address, path=path)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child exits normally: it must not remove its parent's file
os.waitpid(pid, 0)
print("AFTER_CHILD file", os.path.exists(path), flush=True)
"""


@needs_mlock
def test_at_interpreter_exit_the_mapping_stays_and_the_creators_file_goes(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    result = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert "AFTER_CHILD file True" in result.stdout
    assert "AT_EXIT mapped True vmlck_kb 8192 file False" in result.stdout, result.stdout
    assert not path.exists()


# -- hugetlbfs and hugetlb memfds (where this host has free huge pages) ------------------------------------


def free_huge_pages(size: int) -> int:
    try:
        with open(f"/sys/kernel/mm/hugepages/hugepages-{size // 1024}kB/free_hugepages") as f:
            return int(f.read())
    except OSError:
        return 0


def hugetlbfs_mount() -> tuple[str, int] | None:
    """A hugetlbfs mount this process may create files in, with 3 free pages of its size."""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "hugetlbfs" and os.access(parts[1], os.W_OK | os.X_OK):
                _f_type, page = _libc.statfs(parts[1])
                if free_huge_pages(page) >= 3:
                    return parts[1], page
    return None


@hugetlb_pages
def test_a_region_on_hugetlbfs_uses_huge_pages() -> None:
    found = hugetlbfs_mount()
    if found is None:
        pytest.skip("no writable hugetlbfs mount with 3 free huge pages (grep hugetlbfs /proc/mounts; HugePages_Free)")
    mount, page = found
    path = Path(mount) / f"pinpool-test-{uuid.uuid4().hex[:12]}"
    try:
        shared = SharedMemory(path, keep=True, huge_page_size=page)
        assert shared.page_size == page
        free_before = free_huge_pages(page)
        mapping = shared.open_mapping(page, record(page))
        assert mapping.address % page == 0 and mapping.huge_pages == "hugetlb"
        assert path.stat().st_size == 2 * page  # the data's page and the trailer's page
        mapping.view(0, page).fill_(3)
        assert free_before - free_huge_pages(page) == 2
        assert _libc.mlock(mapping.address, mapping.length) == 0
        assert _libc.munlock(mapping.address, mapping.length) == 0
        del mapping
        collect()
        info = read_region(str(path))  # read() works on hugetlbfs (write() does not)
        assert info is not None and info.page_size == page and info.held_bytes == 2 * page
        assert SharedMemory(path, create=False).resident_bytes(page) == page
        attached = SharedMemory(path, create=False).open_mapping(page, record(page))
        assert int(attached.view(page - 1, 1)[0]) == 3
        del attached
        collect()
    finally:
        gc.collect()
        if path.exists():
            path.unlink()


@hugetlb_pages
def test_a_hugetlb_memfd_uses_reserved_huge_pages() -> None:
    page = 2 * MiB
    if free_huge_pages(page) < 2:
        pytest.skip("fewer than 2 free 2 MiB hugetlb pages (HugePages_Free in /proc/meminfo)")
    shared = SharedMemory(huge_page_size="2MiB")
    assert shared.page_size == page
    mapping = shared.open_mapping(page, record(page))
    assert mapping.huge_pages == "hugetlb"
    assert mapping.address % page == 0 and _libc.fstatfs(mapping.fd)[0] == _libc.HUGETLBFS_MAGIC
    mapping.view(0, page).fill_(1)
    del mapping
    collect()


# -- pinpool doctor lists regions ----------------------------------------------------------------------


def test_find_regions_lists_regions_and_doctor_reports_them(shm_dir: Path) -> None:
    make_region(shm_dir / "kept", MiB)
    (shm_dir / "not-a-region").write_bytes(b"\1" * 3 * PAGE)
    (shm_dir / "sub").mkdir()
    make_region(shm_dir / "sub" / "nested", 2 * MiB)
    os.mkfifo(shm_dir / "fifo")
    (shm_dir / "link").symlink_to(shm_dir / "kept")
    regions = find_regions([str(shm_dir)])
    assert [r.path for r in regions] == [str(shm_dir / "kept"), str(shm_dir / "sub" / "nested")]
    kept = regions[0]
    assert kept.keep and kept.nbytes == MiB and kept.owner_uid == os.geteuid() and kept.creator_alive is True
    assert kept.held_bytes == MiB + PAGE  # creating reserved every page (posix_fallocate on /dev/shm)
    check = check_region(kept)
    assert check.status == OK and check.name == "region"
    assert re.match(
        rf"{re.escape(str(shm_dir / 'kept'))}: 1 MiB region, layout raw, {MiB} pages, 1 MiB held", check.detail
    )
    assert "created by pid" in check.detail and "(running)" in check.detail and ", generation 0, kept" in check.detail
    assert f"region id {kept.region_id}," in check.detail
    assert f"rm {shm_dir / 'kept'}" in check.fix
    orphan = dataclasses.replace(kept, keep=False, creator_alive=False, age_seconds=7200.0)
    left = check_region(orphan)
    assert left.status == WARN and "(gone) 2.0 h ago" in left.detail and "left behind" in left.detail
    other_host = check_region(dataclasses.replace(kept, creator_alive=None, created_host="pod-7"))
    assert "(on host 'pod-7')" in other_host.detail and other_host.status == OK
    facts = read_facts(cuda=False)
    listed = run_checks(dataclasses.replace(facts, regions=tuple(regions)), None)
    assert [c.name for c in listed][-2:] == ["region", "region"]


def test_doctor_lists_regions_in_dev_shm(shm_dir: Path) -> None:
    make_region(shm_dir / "kept", MiB)
    result = preloaded.run(
        [sys.executable, "-m", "pinpool", "doctor", "--no-cuda", "--json"], capture_output=True, text=True,
        timeout=120, cwd=ROOT,
    )  # fmt: skip
    report = json.loads(result.stdout)
    listed = [c for c in report["checks"] if c["name"] == "region" and str(shm_dir / "kept") in c["detail"]]
    assert len(listed) == 1 and listed[0]["status"] == "ok", report


def test_the_trailer_format_is_as_documented(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    make_region(path, MiB)
    raw = path.read_bytes()[-TRAILER_BYTES:]
    magic, version, length, crc, flags, generation, reserved = struct.unpack_from("<8sIIIIQQ", raw)
    assert (magic, version, flags, generation, reserved) == (b"pinpoolR", 1, 1 | 2, 0, 0)  # kept, write intents
    body = raw[40 : 40 + length]
    assert zlib.crc32(body) == crc
    parsed = json.loads(body)
    assert set(parsed) == {"nbytes", "page_size", "region_id", "record", "created"} and parsed["nbytes"] == MiB
    assert re.fullmatch(r"[0-9a-f]{32}", parsed["region_id"])
    assert set(parsed["created"]) == {"uid", "pid", "start", "unix", "host"}
    assert not any(raw[40 + length :])
