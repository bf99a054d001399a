"""Shared regions another process can change (issue 23, item 4): a region truncated under its
mappings, a trailer planted by another user, an ancestor directory or link another user
controls, a region removed and created again, a creation an attacher polls for or a SIGKILL
interrupts, a tmpfs that fills up. Crash cases run in a child process: a SIGBUS there is an
exit status (-7) to assert on, not the end of the test run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import pinpool
from pinpool import _cli, layouts
from pinpool._cli import OK, WARN, check_half_made, check_region
from pinpool._host import libc as _libc
from pinpool._shared import (
    MAGIC,
    TRAILER_BYTES,
    SharedMemory,
    find_half_made,
    find_regions,
    layout_record,
    read_region,
    remove_stale_temps,
)
from pinpool.testing import FakeRuntime

from ..conftest import needs_mlock
from ..depth import depth, runs
from .conftest import mounted_tmpfs

MiB = 1 << 20
PAGE = _libc.PAGE_SIZE
ROOT = Path(__file__).resolve().parents[2]
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file or directory to another user")


def record(nbytes: int) -> dict[str, object]:
    return layout_record(layouts.Raw(), nbytes // layouts.Raw().page_bytes)


def make_region(path: Path, nbytes: int = MiB) -> None:
    mapping = SharedMemory(path, keep=True).open_mapping(nbytes, record(nbytes))
    del mapping
    gc.collect()


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


# -- finding 12: a trailer is untrusted input ----------------------------------------------------------


def plant(path: Path, body: bytes, *, data: int = PAGE) -> None:
    """A file whose trailer is well-formed (magic, version, checksum) around ``body``."""
    head = struct.pack("<8sIIIIQQ", MAGIC, 1, len(body), zlib.crc32(body), 0, 0, 0)
    path.write_bytes(b"\0" * data + (head + body).ljust(TRAILER_BYTES, b"\0"))
    path.chmod(0o600)


def body(**fields: object) -> bytes:
    base: dict[str, object] = {"nbytes": PAGE, "page_size": PAGE, "record": record(PAGE), "created": {"pid": 1}}
    return json.dumps({**base, **fields}).encode()


PLANTED = {
    "nested 2,000 deep": b'{"nbytes": 4096, "page_size": 4096, "x": ' + b"[" * 2000 + b"]" * 2000 + b"}",
    "nbytes 1e400": body().replace(b'"nbytes": 4096', b'"nbytes": 1e400'),
    "nbytes a float": body(nbytes=4096.0),
    "nbytes negative": body(nbytes=-4096),
    "nbytes beyond 2**62": body(nbytes=1 << 70),
    "page_size not a power of two": body(page_size=5000),
    "NaN": body().replace(b'"pid": 1', b'"pid": NaN'),
    "an escape sequence": body(record={"layout": "\x1b[2J\x1b]0;owned\x07"}),
    "not an object": b"[1, 2, 3]",
    "a region_id that is a number": body(region_id=7),
}


@pytest.mark.parametrize("case", sorted(PLANTED))
def test_a_planted_trailer_is_a_config_error_never_a_crash(shm_dir: Path, case: str) -> None:
    path = shm_dir / "kv"
    plant(path, PLANTED[case])
    assert read_region(str(path)) is None
    assert find_regions([str(shm_dir)]) == []
    with pytest.raises(pinpool.ConfigError, match=r"exists already; attach to it with create=False"):
        SharedMemory(path).open_mapping(PAGE, record(PAGE))
    with pytest.raises(pinpool.ConfigError, match=r"corrupt pinpool trailer \(its description cannot be read"):
        SharedMemory(path, create=False).open_mapping(PAGE, record(PAGE))


def test_a_region_whose_name_holds_escape_sequences_reaches_the_terminal_escaped(shm_dir: Path) -> None:
    path = shm_dir / "kv\x1b[31mred"
    make_region(path)
    (region,) = find_regions([str(shm_dir)])
    check = check_region(region)
    assert "\x1b" not in check.detail + check.fix and "\\x1b[31mred" in check.detail


@pytest.mark.parametrize(
    "created",
    [{"pid": 10**300, "unix": 1.0}, {"pid": -5, "unix": 10**300}, {"pid": 0, "unix": -1e308}, {"pid": True},
     {"pid": 4.5, "unix": 10**400}],
)  # fmt: skip
def test_a_crafted_creator_is_shown_as_invalid_never_as_300_digits(shm_dir: Path, created: dict[str, object]) -> None:
    # A trailer's "created" fields are untrusted: doctor printed a pid of 300 digits, and an age of as many.
    plant(shm_dir / "kv", body(created={**created, "host": socket.gethostname(), "start": 1}))
    (region,) = find_regions([str(shm_dir)])
    assert region.created_pid is None and region.creator_alive is None
    check = check_region(region)
    assert "created by an unknown process (its trailer names no valid pid)" in check.detail, check.detail
    assert not re.search(r"\d{20}", check.detail) and len(check.detail) < 400, check.detail


def test_ten_thousand_empty_files_sorted_first_hide_no_region(shm_dir: Path) -> None:
    for i in range(10_000):
        os.close(os.open(shm_dir / f"0{i:05d}", os.O_CREAT | os.O_WRONLY, 0o600))
    make_region(shm_dir / "zz-kv")
    started = time.monotonic()
    assert [r.path for r in find_regions([str(shm_dir)])] == [str(shm_dir / "zz-kv")]
    assert time.monotonic() - started < 5


# -- finding 7: truncated under the mapping -------------------------------------------------------------

TRUNCATE = """
import gc, os, sys
import pinpool
from pinpool._shared import SharedMemory, layout_record
from pinpool import layouts
path, size = sys.argv[1], sys.argv[2]
nbytes = 4 << 20
shared = SharedMemory(path, keep=True)
mapping = shared.open_mapping(nbytes, layout_record(layouts.Raw(), nbytes // 4096))
mapping.set_generation(3)
os.truncate(path, 0 if size == "zero" else mapping.file_bytes // 2)
failures = []
for what, call in [
    ("generation", lambda: mapping.generation), ("set_generation", lambda: mapping.set_generation(4)),
    ("shared.generation", lambda: shared.generation), ("shared.set_generation", lambda: shared.set_generation(5)),
    ("keep", lambda: setattr(shared, "keep", False)),
    ("check_size", mapping.check_size),
]:
    try:
        call()
        failures.append(what + ": no error")
    except pinpool.ConfigError as exc:
        assert "truncated or resized" in str(exc) or "holds no pinpool region" in str(exc), exc
print("FAILURES", failures, "REGION", shared._region(), flush=True)
"""


@pytest.mark.parametrize("size", ["zero", "half"])
def test_a_region_truncated_by_another_process_is_a_config_error_not_sigbus(shm_dir: Path, size: str) -> None:
    done = run_child(TRUNCATE, str(shm_dir / "kv"), size)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 was SIGBUS
    assert "FAILURES [] REGION None" in done.stdout, done.stdout + done.stderr[-2000:]


MAPPED_STORE = """
import os, sys
from pinpool import ConfigError
from pinpool._shared import TRAILER_BYTES, store
path, huge = sys.argv[1], 2 << 20
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 2 * huge)
store(fd, 2 * huge, 0, b"generation", "kv", page_size=huge)  # a mapped store, as on hugetlbfs
assert os.pread(fd, 10, 2 * huge - TRAILER_BYTES) == b"generation"
os.ftruncate(fd, huge)  # another process, between the size check and the store
try:
    store(fd, 2 * huge, 0, b"generation", "kv", page_size=huge)
except ConfigError as exc:
    print("REFUSED", exc, flush=True)
"""


def test_a_store_through_the_trailers_mapping_after_a_truncation_is_a_config_error_not_sigbus(shm_dir: Path) -> None:
    """hugetlbfs files cannot be written with pwrite, so the generation is stored through a mapping of
    the trailer's page (here on tmpfs, with a 2 MiB page as hugetlbfs has): through /proc/self/mem a
    page the file no longer has is EIO, where a plain store was SIGBUS."""
    done = run_child(MAPPED_STORE, str(shm_dir / "kv"))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 was SIGBUS
    assert "REFUSED" in done.stdout and "truncated or resized" in done.stdout, done.stdout + done.stderr[-2000:]


POOL_TRUNCATED = """
import os, sys
import pinpool
from pinpool.runtimes import MlockRuntime
path = sys.argv[1]

class Truncating(MlockRuntime):
    done = False
    def truncate(self):
        if not Truncating.done:
            Truncating.done = True
            os.truncate(path, os.stat(path).st_size // 2)  # another process, while the pool pins

    def register(self, ptr, nbytes):
        self.truncate()
        return super().register(ptr, nbytes)

    def lock_on_fault(self, ptr, nbytes):
        self.truncate()
        return super().lock_on_fault(ptr, nbytes)

shared = pinpool.SharedMemory(path, keep=True)
try:
    with pinpool.PinnedPool(size="8MiB", runtime=Truncating(), memory=shared, registry=None, name="kv") as pool:
        print("USED", pool.pinned_pages, flush=True)
except pinpool.PinpoolError as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
from pinpool.testing import locked_bytes
print("VMLCK", locked_bytes(), flush=True)
"""


@needs_mlock
def test_a_region_truncated_while_the_pool_pins_fails_the_pool_with_a_config_error(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    done = run_child(POOL_TRUNCATED, str(path))
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    # A PinError (the populate step failed) or a ConfigError (mlock skipped the missing pages; the
    # pool refuses them before calling them pinned), either naming the region and what happened
    assert re.search(r"REFUSED (PinError|ConfigError) .*another process truncated or resized it", done.stdout)
    assert "host is probably short of memory" not in done.stdout
    assert f"{path}" in done.stdout and "VMLCK 0" in done.stdout, done.stdout


def _wait_failed(pool: pinpool.PinnedPool) -> None:
    deadline = time.monotonic() + 60
    while pool.state is pinpool.PoolState.PINNING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.state is pinpool.PoolState.FAILED, pool.state


@needs_mlock
def test_a_region_truncated_while_a_background_pool_pins_leaves_no_page_called_usable(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, finding 5: the PinError named the truncation, then said pages [0, k) "stay pinned
    and usable", and pinned_pages was k: a server that wrote page 0 died of SIGBUS. Real region,
    real mlock; another process truncates the file (os.truncate by path) before the 5th pre-fault."""
    path = shm_dir / "kv"
    real, calls = _libc.madvise, [0]

    def madvise(address: int, length: int, advice: int) -> int:
        # A pre-fault of the pool (not the one-page probe of MADV_POPULATE_WRITE's support).
        if advice in (_libc.MADV_POPULATE_READ, _libc.MADV_POPULATE_WRITE) and length > _libc.PAGE_SIZE:
            calls[0] += 1
            if calls[0] == 5:  # four 1 MiB chunks pinned and pre-faulted: pages [0, 4 MiB) were usable
                os.truncate(path, 0)
        return real(address, length, advice)

    monkeypatch.setattr(_libc, "madvise", madvise)
    locked = _libc.vm_locked_bytes()
    pool = pinpool.PinnedPool(
        size=16 * MiB, chunk_bytes=MiB, runtime="mlock", memory=SharedMemory(str(path)), background=True,
        populate_workers=1, max_retries=0, registry=None, name="kv",
    )  # fmt: skip
    with pytest.raises(pinpool.MemoryGoneError) as raised:
        with pool:
            _wait_failed(pool)
            assert pool.pinned_pages == 0 and pool.pinned_bytes == 4 * MiB  # the registrations stay until exit
            with pytest.raises(pinpool.MemoryGoneError):
                pool.wait_ready_sync(min_bytes=1)
            raise pool.error  # type: ignore[misc]
    text = str(raised.value)
    assert isinstance(raised.value, pinpool.PinError)
    assert "another process truncated or resized it" in text
    assert "no page of the pool may be touched" in text and "pinned_pages is 0" in text
    assert "usable" not in text
    assert text.count("truncated") == 1  # the pre-fault's message names it; not said twice
    assert pool.pinned_pages == 0 and _libc.vm_locked_bytes() == locked


def test_memory_gone_is_found_whichever_call_failed(shm_dir: Path) -> None:
    """A call that fails without naming the truncation (here an injected register failure, as a GPU
    runtime's may be) still finds the memory gone: the file is asked, not the failure's text."""
    path = shm_dir / "kv"
    fake = FakeRuntime(fail_register_on=5, before_call=lambda op, ptr, n: op == "register" and truncate_once())
    done: list[int] = []

    def truncate_once() -> None:
        if not done and len(fake.register_calls) == 3:
            done.append(1)
            os.truncate(path, 4 * MiB)  # the pages past 4 MiB are gone

    pool = pinpool.PinnedPool(
        size=16 * MiB, chunk_bytes=MiB, runtime=fake, memory=SharedMemory(str(path)), background=True,
        register_workers=1, max_retries=0, registry=None, name="kv",
    )  # fmt: skip
    with pytest.raises(pinpool.MemoryGoneError), pool:  # reading pool.error does not take it from exit
        _wait_failed(pool)
        error = pool.error
        assert isinstance(error, pinpool.MemoryGoneError) and pool.pinned_pages == 0
        assert "injected failure" in str(error) and "another process truncated or resized it" in str(error)
        assert "no page of the pool may be touched" in str(error)
    assert fake.registered == {}


# -- finding 11: a region's pages are reserved when it is created ---------------------------------------


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A tmpfs of 8 MiB mounted for the test (root only; skipped where mounting is not permitted)."""
    with mounted_tmpfs("8M") as point:
        yield point


FILL_THEN_WRITE = """
import gc, os, sys
from pinpool._shared import SharedMemory, layout_record
from pinpool import layouts
path, filler = sys.argv[1], sys.argv[2]
nbytes = 4 << 20
mapping = SharedMemory(path, keep=True).open_mapping(nbytes, layout_record(layouts.Raw(), nbytes // 4096))
with open(filler, "wb", buffering=0) as f:  # another program fills the file system
    try:
        while True:
            f.write(b"x" * 4096)
    except OSError:
        pass
mapping.view(0, nbytes).fill_(7)  # every page of the region: SIGBUS had they not been reserved
print("WROTE", flush=True)
"""


def test_a_full_tmpfs_never_takes_a_created_regions_pages(small_tmpfs: Path) -> None:
    done = run_child(FILL_THEN_WRITE, str(small_tmpfs / "kv"), str(small_tmpfs / "filler"))
    assert done.returncode == 0 and "WROTE" in done.stdout, (done.returncode, done.stderr[-2000:])


def test_a_region_the_tmpfs_has_no_room_for_is_a_config_error_before_anything_is_pinned(small_tmpfs: Path) -> None:
    (small_tmpfs / "filler").write_bytes(b"x" * 6 * MiB)
    with pytest.raises(pinpool.ConfigError, match=r"has .* free of 8 MiB, the region needs 4 MiB"):
        SharedMemory(small_tmpfs / "kv").open_mapping(4 * MiB, record(4 * MiB))
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler"]  # nothing left behind


def test_pages_the_tmpfs_cannot_reserve_are_a_config_error_naming_the_fix(small_tmpfs: Path) -> None:
    from pinpool._shared import reserve_pages

    fd = os.open(small_tmpfs / "kv", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 16 * MiB)  # sized past the mount: a fault past 8 MiB would be SIGBUS
        with pytest.raises(pinpool.ConfigError, match=r"could not reserve the region's 16 MiB .*nothing was pinned"):
            reserve_pages(fd, 16 * MiB, "'kv'", page_size=PAGE, directory=str(small_tmpfs))
    finally:
        os.close(fd)


# -- finding 8: every component of the path -------------------------------------------------------------


@as_root
def test_a_link_or_directory_another_user_controls_higher_in_the_path_is_refused(shm_dir: Path) -> None:
    (shm_dir / "real" / "regions").mkdir(parents=True, mode=0o700)
    link = shm_dir / "theirs-link"
    link.symlink_to(shm_dir / "real")
    os.lchown(link, 65534, 65534)
    with pytest.raises(pinpool.ConfigError, match=r"theirs-link' is a symbolic link owned by uid 65534"):
        SharedMemory(link / "regions" / "kv")
    ours = shm_dir / "our-link"
    ours.symlink_to(shm_dir / "real")  # a link of ours (or root's) higher in the path is followed
    make_region(ours / "regions" / "kv")
    assert read_region(str(shm_dir / "real" / "regions" / "kv")) is not None
    theirs = shm_dir / "theirs"
    (theirs / "mine").mkdir(parents=True, mode=0o700)
    theirs.chmod(0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(pinpool.ConfigError, match=r"theirs' is owned by uid 65534"):
        SharedMemory(theirs / "mine" / "kv")
    os.chown(theirs, 0, 0)
    theirs.chmod(0o777)
    with pytest.raises(pinpool.ConfigError, match=r"theirs' is group- or world-writable without the sticky bit"):
        SharedMemory(theirs / "mine" / "kv", create=False)


@as_root
def test_an_ancestor_swapped_for_another_users_link_after_construction_is_refused(shm_dir: Path) -> None:
    (shm_dir / "a" / "regions").mkdir(parents=True, mode=0o700)
    path = shm_dir / "a" / "regions" / "kv"
    make_region(path)
    shared = SharedMemory(path, create=False)  # checked now; the walk is done again at each use
    (shm_dir / "planted" / "regions").mkdir(parents=True, mode=0o700)
    make_region(shm_dir / "planted" / "regions" / "kv", 2 * MiB)  # what another user wants read
    (shm_dir / "a").rename(shm_dir / "a-real")
    (shm_dir / "a").symlink_to(shm_dir / "planted")
    os.lchown(shm_dir / "a", 65534, 65534)
    for use in (
        shared._region, lambda: shared.generation, lambda: shared.set_generation(9),
        lambda: shared.resident_bytes(MiB), lambda: shared.open_mapping(2 * MiB, record(2 * MiB)),
    ):  # fmt: skip
        with pytest.raises(pinpool.ConfigError, match=r"'.*/a' is a symbolic link owned by uid 65534"):
            use()


# -- finding 9: a region's identity ----------------------------------------------------------------------


def test_a_region_created_again_has_another_identity_so_an_old_index_never_matches(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    first = SharedMemory(path, keep=True)
    mapping = first.open_mapping(MiB, record(MiB))
    saved = (first.region_id, first.generation + 1)  # the documented pattern: bump, serve, save
    first.set_generation(saved[1])
    assert len(saved[0]) == 32 and int(saved[0], 16) >= 0 and mapping.region_id == saved[0]
    del mapping
    gc.collect()
    attached = SharedMemory(path, create=False)
    assert (attached.region_id, attached.generation) == saved == (read_region(str(path)).region_id, 1)  # type: ignore[union-attr]
    path.unlink()  # a tmpfs wipe: a reboot, an operator's rm
    second = SharedMemory(path, keep=True)
    second.open_mapping(MiB, record(MiB))
    second.set_generation(1)  # the new region's own generation 1
    assert second.generation == saved[1] and second.region_id != saved[0]
    assert (second.region_id, second.generation) != saved


def test_a_memfd_is_sealed_against_truncation_and_further_seals() -> None:
    shared = SharedMemory()
    mapping = shared.open_mapping(MiB, record(MiB))
    seals = fcntl.fcntl(mapping.fd, fcntl.F_GET_SEALS)
    assert seals == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    for size in (0, mapping.file_bytes // 2, mapping.file_bytes * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(mapping.fd, size)


# -- finding 10: creating is atomic ------------------------------------------------------------------


@depth
def test_attachers_polling_for_a_region_never_break_its_creation(shm_dir: Path) -> None:
    path = shm_dir / "kv"
    stop = threading.Event()
    seen: list[str] = []

    def attach() -> None:
        while not stop.is_set():
            try:
                SharedMemory(path, create=False).open_mapping(MiB, record(MiB))
                seen.append("mapped")
            except pinpool.ConfigError as exc:
                if "does not exist" not in str(exc) and "was removed while being opened" not in str(exc):
                    seen.append(str(exc))

    threads = [threading.Thread(target=attach) for _ in range(3)]
    for t in threads:
        t.start()
    failures = []
    try:
        for _ in range(runs(15, 60)):
            try:
                mapping = SharedMemory(path).open_mapping(MiB, record(MiB))
            except pinpool.ConfigError as exc:
                failures.append(str(exc))
                continue
            del mapping
            gc.collect()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert failures == [] and [s for s in seen if s != "mapped"] == []


KILLS = runs(12, 40, "PINPOOL_KILLS")  # SIGKILLed creators; more for a deeper search


def test_an_interrupt_while_creating_leaves_nothing_and_a_file_system_without_renameat2_links(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(_libc, "rename_noreplace", interrupted)  # publishing's first step
        with pytest.raises(KeyboardInterrupt):
            SharedMemory(shm_dir / "kv").open_mapping(MiB, record(MiB))
    assert list(shm_dir.iterdir()) == []
    monkeypatch.setattr(_libc, "rename_noreplace", lambda *args: errno.ENOSYS)  # linkat, then unlink
    make_region(shm_dir / "kv")
    assert [p.name for p in shm_dir.iterdir()] == ["kv"] and read_region(str(shm_dir / "kv")) is not None
    with pytest.raises(pinpool.ConfigError, match=r"holds a pinpool region already"):
        SharedMemory(shm_dir / "kv").open_mapping(MiB, record(MiB))
    assert [p.name for p in shm_dir.iterdir()] == ["kv"]


@pytest.mark.parametrize("renameat2", [True, False])
def test_a_name_taken_while_a_region_was_being_made_is_never_replaced(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, renameat2: bool
) -> None:
    from pinpool._shared import publish

    if not renameat2:
        monkeypatch.setattr(_libc, "rename_noreplace", lambda *args: errno.ENOSYS)
    (shm_dir / ".kv.pinpool-new-1").write_bytes(b"mine")
    (shm_dir / "kv").write_bytes(b"theirs")  # another process created the name meanwhile
    dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(pinpool.ConfigError, match=r"kv' exists already; attach to it with create=False"):
            publish(dir_fd, str(shm_dir / "kv"), ".kv.pinpool-new-1")
    finally:
        os.close(dir_fd)
    assert (shm_dir / "kv").read_bytes() == b"theirs"


def test_what_a_dead_creator_left_is_removed_by_the_next_creation_and_a_live_one_is_not(shm_dir: Path) -> None:
    dead = shm_dir / ".kv.pinpool-new-0123456789abcdef"
    dead.write_bytes(b"\0" * 2 * PAGE)
    dead.chmod(0o600)
    live = shm_dir / ".kv.pinpool-new-fedcba9876543210"
    live.write_bytes(b"")
    live.chmod(0o600)
    holder = os.open(live, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # a creation in progress in another process
    try:
        checks = [check_half_made(h) for h in find_half_made([str(shm_dir)])]
        assert [(c.status, c.detail) for c in checks] == [
            (WARN, f"{dead}: a region left half-made by a creator that died while creating it, 8 KiB held "
             "in memory"),
            (OK, f"{live}: a region being created now"),
        ]  # fmt: skip
        assert checks[0].fix == (
            "remove it: pinpool doctor --remove-stale, or rm it (the next creation of a region in its directory "
            "removes it too)"
        )
        make_region(shm_dir / "other")  # any name: a temporary's name is its creator's own
        assert sorted(p.name for p in shm_dir.iterdir()) == [live.name, "other"]
        assert [r.path for r in find_regions([str(shm_dir)])] == [str(shm_dir / "other")]
        assert [h.path for h in find_half_made([str(shm_dir)])] == [str(live)]
    finally:
        os.close(holder)


def stalled_creator(path: Path, nbytes: int) -> int:
    """A forked child creating a region at ``path``, stopped where publishing it would begin: its
    temporary file holds every page, locked. Its pid, once it is there."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(ready_r)

            def stall(*args: object) -> None:
                os.write(ready_w, b"R")
                time.sleep(600)

            _libc.rename_noreplace = stall  # publishing's first step, in this child only
            SharedMemory(path).open_mapping(nbytes, layout_record(layouts.Raw(), nbytes // PAGE))
        finally:
            os._exit(1)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"R"
    finally:
        os.close(ready_r)
    return pid


def temporaries(directory: Path) -> dict[str, int]:
    """Each region temporary file's name and the bytes it holds."""
    return {p.name: p.stat().st_blocks * 512 for p in directory.iterdir() if ".pinpool-new-" in p.name}


@pytest.fixture
def creators() -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def shm_free(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def test_a_creator_killed_mid_creation_leaves_a_temporary_the_next_creation_of_any_region_removes(
    shm_dir: Path, creators: list[int]
) -> None:
    # Each process names its own region: its temporary waited for that name to be created again, so for ever.
    nbytes = 64 * MiB
    creators.append(dead := stalled_creator(shm_dir / f"kv-{os.getpid()}-a", nbytes))
    ((dead_temp, held),) = temporaries(shm_dir).items()
    assert held >= nbytes  # every page reserved
    creators.append(stalled_creator(shm_dir / f"kv-{os.getpid()}-b", nbytes))
    (live_temp,) = set(temporaries(shm_dir)) - {dead_temp}
    os.kill(dead, signal.SIGKILL)
    os.waitpid(dead, 0)
    free = shm_free(shm_dir)
    make_region(shm_dir / "other", MiB)
    assert sorted(temporaries(shm_dir)) == [live_temp]  # the dead creator's is gone, the live one's kept
    assert shm_free(shm_dir) - free >= nbytes - 2 * MiB - 16 * MiB  # its pages freed (less the new region's)
    assert read_region(str(shm_dir / "other")) is not None


def test_doctor_remove_stale_removes_a_dead_creators_temporary_and_says_so(
    shm_dir: Path, creators: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    here = ["--region-dir", str(shm_dir)]  # this test's directory only: other tests' planted temporaries stay theirs
    creators.append(dead := stalled_creator(shm_dir / "kv-a", 8 * MiB))
    (dead_temp,) = temporaries(shm_dir)
    creators.append(stalled_creator(shm_dir / "kv-b", 8 * MiB))
    (live_temp,) = set(temporaries(shm_dir)) - {dead_temp}
    os.kill(dead, signal.SIGKILL)
    os.waitpid(dead, 0)
    assert _cli.main(["doctor", "--no-cuda", *here]) in (0, 1)  # without the flag it only warns
    out = capsys.readouterr().out
    assert f"{shm_dir / dead_temp}: a region left half-made by a creator that died" in out
    elsewhere = shm_dir / "elsewhere"
    elsewhere.mkdir()
    assert _cli.main(["doctor", "--no-cuda", "--remove-stale", "--region-dir", str(elsewhere)]) in (0, 1)
    assert str(dead_temp) not in capsys.readouterr().out  # --region-dir: only there is looked at (and cleaned)
    assert sorted(temporaries(shm_dir)) == sorted([dead_temp, live_temp])
    assert _cli.main(["doctor", "--no-cuda", "--remove-stale", *here]) in (0, 1)
    out = capsys.readouterr().out
    assert re.search(
        rf"ok +region +{re.escape(str(shm_dir / dead_temp))}: removed, a region left half-made by a creator that "
        r"died while creating it \(8 MiB of memory freed\)\n", out,
    ), out  # fmt: skip
    assert f"{shm_dir / live_temp}: a region being created now" in out and str(shm_dir / dead_temp) + ":" not in (
        out.replace(f"{shm_dir / dead_temp}: removed", "")
    )
    assert sorted(temporaries(shm_dir)) == [live_temp]


@pytest.mark.parametrize("meanwhile", ["removed", "looked at"])
def test_a_temporary_taken_before_its_creator_locks_it_is_made_again(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str
) -> None:
    """Between naming its temporary and locking it, a creator's file looks like a dead creator's:
    another creation in the directory removes it, or doctor holds its lock a moment to look."""
    real = fcntl.flock
    taken: list[str] = []

    def flock(fd: int, operation: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if not taken and ".pinpool-new-" in name and operation == fcntl.LOCK_EX | fcntl.LOCK_NB:
            taken.append(name)
            if meanwhile == "removed":
                dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    assert [n for n, _ in remove_stale_temps(dir_fd)] == [os.path.basename(name)]
                finally:
                    os.close(dir_fd)
            else:
                looking = os.open(name, os.O_RDONLY)
                real(looking, fcntl.LOCK_SH)
                try:
                    real(fd, operation)  # raises BlockingIOError
                finally:
                    os.close(looking)
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock)
    make_region(shm_dir / "kv")
    monkeypatch.undo()
    assert taken and [p.name for p in shm_dir.iterdir()] == ["kv"] and read_region(str(shm_dir / "kv")) is not None


@depth
def test_a_creator_killed_at_any_moment_leaves_no_half_made_region(shm_dir: Path) -> None:
    """A forked creator loops creating and removing the region and is SIGKILLed at a random moment;
    forked from this process (pinpool already imported) so each kill costs milliseconds, not an
    interpreter start."""
    path = shm_dir / "kv"
    rng = random.Random(23)
    nbytes = 8 << 20
    for _ in range(KILLS):
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(ready_r)
                os.write(ready_w, b"R")
                while True:
                    m = SharedMemory(path).open_mapping(nbytes, layout_record(layouts.Raw(), nbytes // PAGE))
                    del m  # unmapped and removed at once: the loop is mostly creating
            finally:
                os._exit(1)
        os.close(ready_w)
        assert os.read(ready_r, 1) == b"R"
        os.close(ready_r)
        time.sleep(rng.uniform(0.002, 0.03))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if path.exists():  # killed between linking it and removing it: a whole region, never a half-made one
            assert read_region(str(path)) is not None
            path.unlink()
        mapping = SharedMemory(path).open_mapping(MiB, record(MiB))  # creating again cleans up what was left
        assert [p.name for p in shm_dir.iterdir()] == ["kv"]
        del mapping
        gc.collect()
