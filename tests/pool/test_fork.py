"""Fork safety of the memory pinpool maps: every private mapping (a pool's, ``pinpool.empty()``'s)
is MADV_DONTFORK, so a forked child has nothing mapped there, the parent's pinned pages are never
shared copy-on-write (a write by the parent after the fork keeps its frames), and a child that
inherits the pool object exits cleanly, touching nothing of the parent's."""

from __future__ import annotations

import errno
import json
import sys
from unittest import mock

import pytest
import torch

import pinpool
from pinpool._host import HostMapping
from pinpool._host import libc as _libc
from tests import preloaded
from tests.pool.test_open_close import in_forked_child

MiB = 1 << 20

# The parent pins a private pool (mlock: really locked) and writes a pattern, then forks. The child
# says what /proc/self/maps has over the pool's range, waits while the parent writes the pool again,
# then falls off the end of the script: interpreter exit with the inherited pool object (open, its
# tensor alive), its stderr on a pipe of its own. The parent reads its page frames (/proc/self/pagemap)
# before the fork and after its write, while the child is still alive (once the child is gone a
# copy-on-write page would be reused in place, hiding the copy).
SCRIPT = r"""
import json, os, struct, sys
import torch
import pinpool
from pinpool._host import libc as _libc

SIZE = 4 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")


def frames(address, length):
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // PAGE * 8)
        data = pagemap.read(length // PAGE * 8)
    return [entry & ((1 << 55) - 1) for entry in struct.unpack(f"<{len(data) // 8}Q", data)]


def mapped_over(address, length):
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo < address + length and address < hi:
                return line.strip()
    return None


pool = pinpool.PinnedPool(size=SIZE, chunk_bytes=1 << 20, runtime="mlock")
pool.open()
tensor = pool.tensor
address = pool.data_ptr
pattern = torch.arange(SIZE, dtype=torch.int64).remainder(251).to(torch.uint8)
tensor.copy_(pattern)
locked = _libc.vm_locked_bytes()
before = frames(address, SIZE)
child_reads, parent_writes = os.pipe()
parent_reads, child_writes = os.pipe()
errors_read, errors_write = os.pipe()
pid = os.fork()
if pid == 0:  # the child
    os.dup2(errors_write, 2)
    for fd in (parent_writes, parent_reads, errors_read, errors_write):
        os.close(fd)
    os.write(child_writes, (json.dumps({"mapped": mapped_over(address, SIZE)}) + "\n").encode())
    os.read(child_reads, 1)  # the parent has written the pool again
else:  # the parent
    for fd in (child_reads, child_writes, errors_write):
        os.close(fd)
    child = json.loads(os.fdopen(parent_reads).readline())
    tensor.add_(1)  # every page written while the child lives
    after = frames(address, SIZE)
    intact = bool(torch.equal(tensor, pattern + 1))
    os.write(parent_writes, b"x")
    _, status = os.waitpid(pid, 0)
    with os.fdopen(errors_read) as errors:
        child_stderr = errors.read()
    print(json.dumps({
        "child_mapped": child["mapped"], "child_exit": os.waitstatus_to_exitcode(status),
        "child_stderr": child_stderr, "frames_before": before, "frames_after": after,
        "locked_before": locked, "locked_after": _libc.vm_locked_bytes(), "intact": intact,
        "pinned_bytes": pool.pinned_bytes, "state": pool.state.name,
    }), flush=True)
    pool.close()
    print(json.dumps({"locked_closed": _libc.vm_locked_bytes(), "state": pool.state.name}), flush=True)
"""


def test_a_fork_while_pinned_copies_nothing_and_the_child_exits_cleanly() -> None:
    result = preloaded.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # the parent: no warning, nothing printed
    report, closed = (json.loads(line) for line in result.stdout.splitlines())
    # The child: nothing mapped over the pool's range, a clean interpreter exit with the pool object.
    assert report["child_mapped"] is None
    assert report["child_exit"] == 0
    assert report["child_stderr"] == ""  # no traceback, no UnclosedPoolWarning: the pool is the parent's
    # The parent: still pinned, same locked bytes, the data it wrote, its pool closes as usual.
    assert report["intact"] is True
    assert report["state"] == "READY" and report["pinned_bytes"] == 4 * MiB
    assert report["locked_after"] == report["locked_before"] >= 4 * MiB
    assert closed == {"locked_closed": report["locked_before"] - 4 * MiB, "state": "CLOSED"}
    before, after = report["frames_before"], report["frames_after"]
    assert len(before) == len(after) == 4 * MiB // _libc.PAGE_SIZE
    if not any(before):
        pytest.skip("/proc/self/pagemap shows no page frame numbers to this user (CAP_SYS_ADMIN): not compared")
    assert 0 not in before
    assert after == before  # no page was copied on write: the registered frames are the parent's still


def test_pinpool_empty_is_not_mapped_in_a_forked_child() -> None:
    tensor = pinpool.empty(3 * MiB, dtype=torch.uint8)
    tensor.fill_(7)
    address, length = tensor.data_ptr(), 3 * MiB

    def child() -> None:
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                assert not (lo < address + length and address < hi), f"mapped in the child: {line.strip()}"

    assert in_forked_child(child) == "ok"
    assert int(tensor.sum()) == 7 * length  # the parent's memory is untouched


def test_a_forked_child_never_unmaps_what_it_mapped_where_the_parents_mapping_is() -> None:
    """The child has nothing at the parent's address (MADV_DONTFORK), so it may map something of its
    own there; collecting the inherited mapping object in the child must not unmap that."""
    mapping = HostMapping(2 * MiB)
    address, length = mapping.address, mapping.length

    def child() -> None:
        fixed = 0x100000  # MAP_FIXED_NOREPLACE: fails rather than replace anything mapped there
        flags = _libc.MAP_PRIVATE | _libc.MAP_ANONYMOUS | fixed
        got = _libc._mmap(address, length, _libc.PROT_READ | _libc.PROT_WRITE, flags, -1, 0)
        assert got == address, f"the child could not map its own memory at {address:#x}: the parent's is there"
        mapping._finalizer()  # what collecting the inherited object runs
        with open("/proc/self/maps") as maps:
            assert any(int(line.split("-")[0], 16) == address for line in maps), "the child's own mapping went"

    assert in_forked_child(child) == "ok"
    assert not mapping.unmapped
    mapping._finalizer()
    assert mapping.unmapped


def test_a_refused_madvise_dontfork_unmaps_and_raises_before_anything_is_faulted() -> None:
    real_madvise, real_munmap = _libc.madvise, _libc.munmap
    advised: list[tuple[int, int]] = []
    unmapped: list[tuple[int, int]] = []

    def madvise(address: int, length: int, advice: int) -> int:
        advised.append((address, advice))
        if advice == _libc.MADV_DONTFORK:
            return errno.ENOMEM
        return real_madvise(address, length, advice)

    def munmap(address: int, length: int) -> int:
        unmapped.append((address, length))
        return real_munmap(address, length)

    with mock.patch.object(_libc, "madvise", madvise), mock.patch.object(_libc, "munmap", munmap):
        with pytest.raises(pinpool.AllocationError, match=r"MADV_DONTFORK.*ENOMEM.*vm.max_map_count"):
            pinpool.empty(MiB, dtype=torch.uint8, huge_pages=True)  # THP's MADV_HUGEPAGE would come after it
    assert [advice for _, advice in advised] == [_libc.MADV_DONTFORK]  # first: nothing faulted or advised before
    address = advised[0][0]
    assert (address, 2 * MiB) in unmapped  # the mapping (2 MiB-aligned with THP) was given back


def test_the_host_probe_never_goes_through_a_faked_madvise(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-time MADV_POPULATE_WRITE probe (``probe_host``) uses the raw calls, so a test faking
    ``libc.madvise`` sees the pool's calls only, whichever test happened to probe the host first."""
    monkeypatch.setattr(_libc, "_populate_supported", None)  # unprobed, as in a fresh process
    seen: list[tuple[int, ...]] = []
    with (
        mock.patch.object(_libc, "madvise", lambda *call: seen.append(call) or 0),
        mock.patch.object(_libc, "munmap", lambda *call: seen.append(call) or 0),
    ):
        _libc.populate_write_supported()
    assert seen == []


# The parent holds a private mlock pool, a fake-runtime pool and a pinned torch tensor, then forks
# (os.fork, and multiprocessing's fork context). Each child reports whether it could pin on its own:
# a 16 MiB mlock pool (VmLck of its own), a fake pool, pin() of a fresh tensor and of its copy of the
# parent's pinned one (copy-on-write, neither locked nor claimed in the child); then it claims the
# address of the parent's pool itself (the kernel may map the child's memory there: the parent's is
# MADV_DONTFORK) and closes the inherited pools, which must leave that claim alone.
CHILD_PINS = r"""
import json, multiprocessing, os, sys
import torch
import pinpool
from pinpool._host import libc as _libc
from pinpool._ranges import PINNED_RANGES
from pinpool.testing import FakeRuntime

SIZE = 16 << 20


def child_pins(inherited, address):
    report = {"book_at_start": len(PINNED_RANGES.snapshot()), "locked_at_start": _libc.vm_locked_bytes()}
    try:
        with pinpool.PinnedPool(size=SIZE, runtime="mlock", name="child-mlock"):
            report["locked_while_pinned"] = _libc.vm_locked_bytes()
        with pinpool.PinnedPool(size=SIZE, runtime=FakeRuntime(), name="child-fake"):
            pass
        with pinpool.pin(torch.empty(SIZE, dtype=torch.uint8), runtime="mlock"):
            report["locked_tensor"] = _libc.vm_locked_bytes()
        with pinpool.pin(inherited[-1].tensor, runtime="mlock", name="parents-tensor"):
            report["locked_parents_tensor"] = _libc.vm_locked_bytes()
        assert PINNED_RANGES.add(address, SIZE) is None
        for pool in inherited:
            pool.close()
        report["own_claim_kept"] = PINNED_RANGES.get(address) == SIZE
        PINNED_RANGES.pop(address)
        report["locked_at_end"] = _libc.vm_locked_bytes()
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    return report


def in_mp_child(queue, inherited, address):
    queue.put(child_pins(inherited, address))


if __name__ == "__main__":
    pool = pinpool.PinnedPool(size=SIZE, runtime="mlock", name="parent-mlock").open()
    fake = pinpool.PinnedPool(size=SIZE, runtime=FakeRuntime(), name="parent-fake").open()
    tensor = pinpool.pin(torch.empty(SIZE, dtype=torch.uint8), runtime="mlock").open()
    inherited = [pool, fake, tensor]
    reports = []
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, json.dumps(child_pins(inherited, pool.data_ptr)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        reports.append(json.loads(pipe.read()))
    os.waitpid(pid, 0)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=in_mp_child, args=(queue, inherited, pool.data_ptr))
    process.start()
    reports.append(queue.get(timeout=60))
    process.join(60)
    print(json.dumps({"reports": reports, "exitcode": process.exitcode, "parent_book": len(PINNED_RANGES.snapshot())}))
    for each in inherited:
        each.close()
"""


def test_a_forked_child_pins_on_its_own_whatever_its_parent_pins() -> None:
    """Issue 33, finding 2: the child inherited the parent's book of pinned ranges, not its
    MADV_DONTFORK memory, so its own pools landed in a range the book claimed: AlreadyPinnedError."""
    result = preloaded.run([sys.executable, "-c", CHILD_PINS], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["exitcode"] == 0 and report["parent_book"] == 3
    for child in report["reports"]:  # os.fork, then multiprocessing's fork context
        assert "error" not in child, child["error"]
        assert child["book_at_start"] == 0  # nothing pinned in the child: mlocks are not inherited
        assert child["locked_at_start"] == 0
        assert child["locked_while_pinned"] == 16 * MiB  # its own pool, really locked
        assert child["locked_tensor"] >= 16 * MiB
        # Its copy of the parent's tensor: every page locked, the two it shares in part included
        # (the parent's holders of those pages are not the child's).
        assert child["locked_parents_tensor"] == child["locked_tensor"]
        assert child["own_claim_kept"] is True  # closing an inherited pool leaves the child's claims alone
        assert child["locked_at_end"] == 0


# Threads open and close small pools (mlock and fake) while the main thread forks 100 children; each
# child pins an mlock pool and a fake one. A child that hangs (a lock held at the fork by a thread
# the child does not have) is killed after a minute and counted.
FORK_STORM = r"""
import json, os, sys, threading, time
import pinpool
from pinpool.testing import FakeRuntime

MiB = 1 << 20
stop = threading.Event()
opened = [0]


def churn(i):
    while not stop.is_set():
        runtime = FakeRuntime() if i % 2 else "mlock"
        with pinpool.PinnedPool(size=MiB, chunk_bytes=256 << 10, runtime=runtime, name=f"churn-{i}"):
            opened[0] += 1


def child():
    try:
        with pinpool.PinnedPool(size=4 * MiB, runtime="mlock", name="child-mlock"):
            pass
        with pinpool.PinnedPool(size=4 * MiB, runtime=FakeRuntime(), name="child-fake"):
            pass
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


threads = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
for thread in threads:
    thread.start()
while opened[0] < 20:
    time.sleep(0.01)
outcomes = []
for _ in range(100):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        os.write(write, child().encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    with os.fdopen(read) as pipe:
        outcomes.append(pipe.read() or "hung")
stop.set()
for thread in threads:
    thread.join()
print(json.dumps({"outcomes": outcomes, "opened": opened[0]}))
"""


def test_children_forked_while_other_threads_open_pools_all_pin() -> None:
    """Issue 33, finding 2: with only other threads opening small pools at fork time, 77 of 100
    children failed with AlreadyPinnedError (their book held the parent's threads' claims)."""
    result = preloaded.run([sys.executable, "-c", FORK_STORM], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    failed = [outcome for outcome in report["outcomes"] if outcome != "ok"]
    assert not failed, f"{len(failed)} of 100 children failed, the first: {failed[0]}"
    assert report["opened"] > 20  # the threads kept opening pools across the forks


# A background pool pins in the parent; a thread holds its session's lock (as a pinning worker does
# around each booking) while the main thread forks. The child just exits: its interpreter's exit ran
# the parent's "stop background pinning" hooks, which waited on that lock for ever.
CHILD_EXITS = r"""
import os, sys, threading, time
import pinpool
from pinpool.testing import FakeRuntime
from tests.conftest import lifecycle_of

pool = pinpool.PinnedPool(
    size=64 << 20, chunk_bytes=1 << 20, runtime=FakeRuntime(register_delay=0.05), background=True, name="slow"
).open()
pool.wait_ready_sync(min_bytes=1 << 20)
session = lifecycle_of(pool).session
held, forked = threading.Event(), threading.Event()


def hold():
    with session.lock:
        held.set()
        forked.wait()


threading.Thread(target=hold).start()
held.wait()
pid = os.fork()
if pid == 0:
    sys.exit(0)
forked.set()
deadline = time.monotonic() + 60
while not os.waitpid(pid, os.WNOHANG)[0]:
    if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("the child hung at exit")
        break
    time.sleep(0.01)
else:
    print("the child exited")
pool.close()
"""


def test_a_child_forked_while_its_parent_pins_in_the_background_exits() -> None:
    result = preloaded.run([sys.executable, "-c", CHILD_EXITS], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "the child exited\n"


# A worker thread forks while the main thread opens a pool (pinpool's Ctrl-C handler installed). The
# child's only thread never leaves that guard: its handler must be Python's own again, so that
# asyncio.run in the child installs its Ctrl-C handling (it does only over the default handler).
CHILD_HANDLER = r"""
import asyncio, json, os, signal
import pinpool
from pinpool.testing import FakeRuntime

forked = []


def name_of_handler():
    handler = signal.getsignal(signal.SIGINT)
    return getattr(getattr(handler, "func", handler), "__name__", None)  # asyncio's is a partial


async def under_asyncio():
    return name_of_handler()


def child():
    report = {"at_fork": name_of_handler()}
    with pinpool.PinnedPool(size=4 << 20, chunk_bytes=1 << 20, runtime=FakeRuntime(), name="child"):
        pass
    report["after_a_pool"] = name_of_handler()
    report["under_asyncio"] = asyncio.run(under_asyncio())
    return report


def fork_once(op, ptr, nbytes):
    if op == "register" and not forked:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, json.dumps(child()).encode())
            os._exit(0)
        os.close(write)
        forked.append((pid, read))


with pinpool.PinnedPool(size=4 << 20, chunk_bytes=1 << 20, runtime=FakeRuntime(before_call=fork_once), name="parent"):
    pass
pid, read = forked[0]
with os.fdopen(read) as pipe:
    print(pipe.read())
os.waitpid(pid, 0)
"""


def test_a_child_forked_while_the_main_thread_opens_a_pool_has_pythons_ctrl_c_handler() -> None:
    result = preloaded.run([sys.executable, "-c", CHILD_HANDLER], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {
        "at_fork": "default_int_handler", "after_a_pool": "default_int_handler", "under_asyncio": "_on_sigint",
    }  # fmt: skip
