"""Node pacing against hostile or broken files in its directory (same user: an attacker or an accident).

Each test would hang, overwrite a file or raise a raw ``OSError`` without its fix; each one
that could hang runs the candidate on a daemon thread with a deadline, and unblocks it after.
"""

from __future__ import annotations

import ast
import fcntl
import inspect
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

import pinpool
from pinpool._errors import NodeBusyError, NodeWaitCancelled
from pinpool._node import NodeAdmission, NodeHolder, NodePacing, holder_state
from pinpool._observe import Observer
from pinpool.testing import FakeRuntime

from .. import preloaded
from .conftest import admission, in_thread, open_fds

GiB = 1 << 30
MiB = 1 << 20
PACKAGE_DIR = str(Path(pinpool.__file__).parent)
DEADLINE = 5.0


def within(seconds: float, target: Callable[[], object], unblock: Callable[[], None] = lambda: None) -> object:
    """``target()``'s result or exception, or a test failure if it has not returned after ``seconds``
    (then ``unblock()`` is called so the daemon thread can end)."""
    thread, out = in_thread(target)
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        thread.join(seconds)
        pytest.fail(f"still blocked after {seconds} s")
    (result,) = out
    if isinstance(result, BaseException) and not isinstance(result, Exception):
        raise result
    return result


def release_fifo(path: Path) -> Callable[[], None]:
    """Opens the FIFO for writing (never blocks with O_RDWR), which frees a reader blocked in open."""

    def unblock() -> None:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        time.sleep(0.5)
        os.close(fd)

    return unblock


def swap_after_the_lstat(monkeypatch: pytest.MonkeyPatch, path: Path, swap: Callable[[], None]) -> list[str]:
    """The race itself: the first ``lstat`` of ``path``'s name (``os.stat(..., follow_symlinks=False)``) sees
    what is there, then ``swap()`` replaces it before the open. Returns the names swapped (once)."""
    real = os.stat
    swapped: list[str] = []

    def stat(name: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        st = real(name, *args, **kwargs)
        if name == path.name and kwargs.get("follow_symlinks") is False and not swapped:
            swapped.append(name)
            swap()
        return st

    monkeypatch.setattr(os, "stat", stat)
    return swapped


def acquire(ours: NodeAdmission, kind: str) -> Any:
    if kind == "slot":
        return ours.acquire_slot()
    return ours.reserve_budget(GiB)


# -- 1. a FIFO under a lock file's name never blocks admission ----------------------------------------

PLANTED = [("slot", "slot-0"), ("budget", "budget.lock"), ("budget", "hold-4242-planted")]


@pytest.mark.parametrize(("kind", "name"), PLANTED)
def test_a_fifo_named_like_a_lock_file_is_refused_at_once(node_dir: Path, kind: str, name: str) -> None:
    ours = admission(node_dir, slots=1, budget=GiB)
    fifo = node_dir / name
    os.mkfifo(fifo, 0o600)
    before = open_fds()
    result = within(DEADLINE, lambda: acquire(ours, kind), release_fifo(fifo))
    assert isinstance(result, pinpool.ConfigError), result
    assert f"{str(fifo)!r} is not a regular file (a FIFO); remove it" in str(result)
    assert open_fds() == before
    fifo.unlink()
    with ours.acquire_slot(), ours.reserve_budget(GiB):  # nothing stayed locked (budget.lock)
        pass


@pytest.mark.parametrize(("kind", "name"), PLANTED)
def test_a_fifo_already_there_is_refused_by_the_constructor(node_dir: Path, kind: str, name: str) -> None:
    node_dir.mkdir(mode=0o700)
    os.mkfifo(node_dir / name, 0o600)
    result = within(DEADLINE, lambda: admission(node_dir, slots=1, budget=GiB), release_fifo(node_dir / name))
    assert isinstance(result, pinpool.ConfigError), result
    assert f"{name}' is not a regular file (a FIFO); remove it" in str(result)


@pytest.mark.parametrize(("kind", "name"), PLANTED)
def test_a_fifo_swapped_in_after_the_lstat_does_not_block_the_open(
    node_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str, name: str
) -> None:
    """The race: the name was a regular file at ``lstat`` and is a FIFO at ``open``. O_NONBLOCK
    keeps the open from waiting for a writer (with budget.lock held); fstat refuses it."""
    ours = admission(node_dir, slots=1, budget=GiB)
    fifo = node_dir / name
    fifo.touch(0o600)

    def to_a_fifo() -> None:
        fifo.unlink()
        os.mkfifo(fifo, 0o600)

    swapped = swap_after_the_lstat(monkeypatch, fifo, to_a_fifo)
    result = within(DEADLINE, lambda: acquire(ours, kind), release_fifo(fifo))
    monkeypatch.undo()
    assert swapped and isinstance(result, pinpool.ConfigError), result
    assert "is not a regular file (a FIFO)" in str(result)
    fifo.unlink()
    with ours.acquire_slot(), ours.reserve_budget(GiB):
        pass


def test_a_pool_entering_with_a_fifo_as_hold_file_fails_within_a_deadline(fake: FakeRuntime, node_dir: Path) -> None:
    """End to end: the pool raises ConfigError from its entry instead of hanging in the admission thread."""
    pool = pinpool.PinnedPool(
        size=MiB, runtime=fake, registry=None, node_budget=GiB, node_dir=str(node_dir), node_wait=False
    )
    fifo = node_dir / "hold-4242-planted"
    os.mkfifo(fifo, 0o600)

    def enter() -> None:
        with pool:
            pass

    result = within(DEADLINE, enter, release_fifo(fifo))
    assert isinstance(result, pinpool.ConfigError) and "a FIFO" in str(result), result


# -- 2. a hard link in place of a lock file is never written through -------------------------------------


@pytest.fixture
def precious(tmp_path: Path) -> Path:
    """A file of ours on the node directory's file system, which a hard link could point at."""
    path = tmp_path / "precious"
    path.write_bytes(b"do not overwrite\n")
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(("kind", "name"), PLANTED)
def test_a_hard_link_in_place_of_a_lock_file_is_refused_and_its_target_is_untouched(
    node_dir: Path, precious: Path, kind: str, name: str
) -> None:
    ours = admission(node_dir, slots=1, budget=GiB)
    os.link(precious, node_dir / name)
    with pytest.raises(pinpool.ConfigError, match=rf"{name}' has 2 hard links .*; remove it"):
        acquire(ours, kind)
    assert precious.read_bytes() == b"do not overwrite\n"
    assert (node_dir / name).exists()  # not even unlinked as a stale hold
    (node_dir / name).unlink()
    with ours.acquire_slot(), ours.reserve_budget(GiB):
        pass
    assert precious.read_bytes() == b"do not overwrite\n" and os.stat(precious).st_nlink == 1


def test_a_hard_link_already_there_is_refused_by_the_constructor(
    fake: FakeRuntime, node_dir: Path, precious: Path
) -> None:
    node_dir.mkdir(mode=0o700)
    os.link(precious, node_dir / "slot-1")
    with pytest.raises(pinpool.ConfigError, match=r"slot-1' has 2 hard links"):
        admission(node_dir, slots=2)
    with pytest.raises(pinpool.ConfigError, match=r"slot-1' has 2 hard links"):
        pinpool.PinnedPool(size=MiB, runtime=fake, registry=None, node_slots=2, node_dir=str(node_dir))
    admission(node_dir, slots=1)  # slot-1 is no file of a one-slot pacing
    assert precious.read_bytes() == b"do not overwrite\n"


def test_a_hard_link_swapped_in_after_the_lstat_is_refused_before_any_write(
    node_dir: Path, precious: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = admission(node_dir, slots=1)
    slot = node_dir / "slot-0"
    slot.touch(0o600)

    def to_a_link() -> None:
        slot.unlink()
        os.link(precious, slot)

    swapped = swap_after_the_lstat(monkeypatch, slot, to_a_link)
    with pytest.raises(pinpool.ConfigError, match="has 2 hard links"):
        ours.acquire_slot()
    assert swapped == ["slot-0"]
    assert precious.read_bytes() == b"do not overwrite\n"


# -- 3. an unwritable node_dir is a ConfigError at construction ------------------------------------------


def in_unprivileged_owner(fn: Callable[[Path], None]) -> str:
    """``fn(node_dir)`` for a node_dir its caller owns with mode 0500, run as a user the kernel holds
    to it (root ignores permissions: then in a forked child running as uid 65534). Returns
    ``"ok"`` or ``"<ErrorType>: <message>"``."""
    base = Path(tempfile.mkdtemp(prefix="pinpool-hostile-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        directory = base / "node"
        directory.mkdir(mode=0o700)
        if os.geteuid() != 0:
            directory.chmod(0o500)
            try:
                fn(directory)
                return "ok"
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
            finally:
                directory.chmod(0o700)
        base.chmod(0o755)
        os.chown(directory, 65534, 65534)
        directory.chmod(0o500)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop root, run, report
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                try:
                    fn(directory)
                    report = "ok"
                except Exception as exc:
                    report = f"{type(exc).__name__}: {exc}"
                os.write(write_end, report.encode())
            finally:
                os._exit(0)
        os.close(write_end)
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        os.close(read_end)
        os.waitpid(pid, 0)
        return b"".join(chunks).decode()
    finally:
        shutil.rmtree(base)


def test_an_unwritable_node_dir_is_a_config_error_at_construction() -> None:
    report = in_unprivileged_owner(lambda d: admission(d, slots=1, budget=GiB) and None)
    assert report.startswith("ConfigError: node pacing directory "), report
    assert "is not writable by this process (EACCES: Permission denied)" in report
    assert "chmod u+rwx" in report and "PINPOOL_NODE_DIR" in report


def test_a_node_dir_made_unwritable_later_is_a_config_error_at_acquire() -> None:
    def later(directory: Path) -> None:
        directory.chmod(0o700)
        ours = admission(directory, slots=1)
        directory.chmod(0o500)
        ours.acquire_slot()

    report = in_unprivileged_owner(later)
    assert report.startswith("ConfigError: ") and "(EACCES: Permission denied)" in report, report


def test_a_pool_with_an_unwritable_node_dir_fails_in_its_constructor(
    fake: FakeRuntime, node_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What PinnedPool does when the kernel says the directory is not writable (os.access, as
    for a non-root owner of a mode-0500 directory: root passes every permission check)."""
    node_dir.mkdir(mode=0o700)
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with pytest.raises(pinpool.ConfigError, match=r"is not writable by this process \(EACCES"):
        pinpool.PinnedPool(size=MiB, runtime=fake, registry=None, node_slots=1, node_dir=str(node_dir))
    monkeypatch.undo()
    assert fake.registered == {} and list(node_dir.iterdir()) == []


def test_a_read_only_file_system_names_erofs_and_another_directory(
    node_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class ReadOnly:
        f_flag = os.ST_RDONLY

    node_dir.mkdir(mode=0o700)
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    monkeypatch.setattr(os, "fstatvfs", lambda fd: ReadOnly())
    with pytest.raises(pinpool.ConfigError, match=r"\(EROFS: Read-only file system\).*writable file system"):
        admission(node_dir, slots=1)


# /proc and /sys pass every check a directory gets (root owns them, root passes access()), then refuse
# to create a file: that was a raw FileNotFoundError at entry. A file, a path under one, a name /proc
# cannot create: each a ConfigError from the constructor that names the value, with nothing pinned.
HOSTILE_DIRS = ["/proc", "/sys", "/proc/self/fd", "/proc/self/fdinfo", "/proc/pinpool-new", "/proc/self", "/dev/null",
                "/dev/null/x"]  # fmt: skip


@pytest.mark.parametrize("kind", ["node_slots", "node_budget"])
@pytest.mark.parametrize("directory", HOSTILE_DIRS)
def test_a_node_dir_that_holds_no_files_is_a_config_error_at_construction(
    fake: FakeRuntime, directory: str, kind: str
) -> None:
    pacing: dict[str, Any] = {"node_slots": 1} if kind == "node_slots" else {"node_budget": GiB}
    with pytest.raises(pinpool.ConfigError, match=rf"node pacing directory {directory!r} .*node_dir="):
        pinpool.PinnedPool(size=MiB, runtime=fake, registry=None, node_dir=directory, **pacing)
    assert fake.registered == {}


# -- 4. a rank waiting behind a stopped holder says so -----------------------------------------------------

HOLDER = r"""
import json, os, sys, time, types, fcntl
spec = json.loads(sys.argv[1])
package = types.ModuleType("pinpool")
package.__path__ = [spec["package"]]
sys.modules["pinpool"] = package  # pinpool._node.pacing without pinpool/__init__ (and torch)
from pinpool._node import NodeAdmission, NodePacing

if spec["kind"] == "lock":  # a rank stopped while admitting: it holds budget.lock itself
    fd = os.open(os.path.join(spec["dir"], "budget.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
else:
    pacing = NodePacing(directory=spec["dir"], slots=1, budget_bytes=spec["budget"])
    admission = NodeAdmission(pacing, label="stuck")
    hold = admission.acquire_slot() if spec["kind"] == "slot" else admission.reserve_budget(spec["budget"])
open(spec["ready"], "w").close()
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path, node_dir: Path) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(kind: str) -> subprocess.Popen[bytes]:
        ready = tmp_path / f"{kind}.ready"
        spec = {"package": PACKAGE_DIR, "dir": str(node_dir), "kind": kind, "budget": GiB, "ready": str(ready)}
        proc = preloaded.spawn([sys.executable, "-c", HOLDER, json.dumps(spec)], stderr=subprocess.PIPE)
        procs.append(proc)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[1].decode()
            assert time.monotonic() < deadline, "the holder never got ready"
            time.sleep(0.01)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.communicate()


@pytest.fixture
def fast_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NodeAdmission, "waiting_first_seconds", 0.2)
    monkeypatch.setattr(NodeAdmission, "waiting_every_seconds", 0.3)


Report = tuple[str, tuple[NodeHolder, ...], float]


def wait_for_reports(ours: NodeAdmission, kind: str, reports: list[Report], count: int) -> object:
    """Wait (on a thread, cancelled once ``count`` reports came) and return how the wait ended."""
    attempt = ours.acquire_slot if kind == "slot" else lambda **kw: ours.reserve_budget(GiB, **kw)
    return within(DEADLINE, lambda: attempt(cancelled=lambda: len(reports) >= count, poll=0.02))


@pytest.mark.parametrize("kind", ["slot", "budget", "lock"])
def test_a_wait_behind_a_stopped_holder_reports_it_after_a_while_and_then_again(
    node_dir: Path, holder: Callable[[str], subprocess.Popen[bytes]], fast_reports: None, kind: str
) -> None:
    reports: list[Report] = []
    ours = admission(node_dir, slots=1, budget=GiB, wait=True, on_waiting=lambda *r: reports.append(r))
    proc = holder(kind)
    os.kill(proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    ended = wait_for_reports(ours, "slot" if kind == "slot" else "budget", reports, 2)
    assert isinstance(ended, NodeWaitCancelled), ended
    first, second = reports
    assert first[0] == ("slots" if kind == "slot" else "budget")
    assert 0.2 <= first[2] < second[2] and second[2] - first[2] >= 0.3
    assert time.monotonic() - started < DEADLINE
    (who,) = first[1]
    assert who.pid == proc.pid and who.state == "stopped"
    assert who.label == ("" if kind == "lock" else "stuck")
    assert "[stopped]" in who.describe()
    if kind == "budget":
        assert who.nbytes == GiB


def test_a_running_holder_is_reported_running_and_a_short_wait_not_at_all(
    node_dir: Path, holder: Callable[[str], subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    reports: list[Report] = []
    ours = admission(node_dir, slots=1, wait=True, on_waiting=lambda *r: reports.append(r))
    proc = holder("slot")
    calls = 0

    def after_a_few() -> bool:
        nonlocal calls
        calls += 1
        return calls > 5

    ended = within(DEADLINE, lambda: ours.acquire_slot(cancelled=after_a_few, poll=0.02))
    assert isinstance(ended, NodeWaitCancelled) and reports == []  # the default: first after 10 s
    monkeypatch.setattr(NodeAdmission, "waiting_first_seconds", 0.0)
    ended = wait_for_reports(ours, "slot", reports, 1)
    assert isinstance(ended, NodeWaitCancelled)
    ((kind, (who,), _waited),) = reports
    assert kind == "slots" and who.pid == proc.pid and who.state == "running"


def test_a_report_that_raises_does_not_change_the_wait(node_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NodeAdmission, "waiting_first_seconds", 0.0)
    monkeypatch.setattr(NodeAdmission, "waiting_every_seconds", 0.0)
    calls: list[float] = []

    def broken(kind: str, holders: tuple[NodeHolder, ...], waited: float) -> None:
        calls.append(waited)
        raise RuntimeError("a broken log handler")

    ours = admission(node_dir, slots=1, wait=True, on_waiting=broken)
    with ours.acquire_slot():
        ended = within(DEADLINE, lambda: ours.acquire_slot(cancelled=lambda: len(calls) >= 3, poll=0.01))
    assert isinstance(ended, NodeWaitCancelled) and len(calls) >= 3
    with pytest.raises(pinpool.ConfigError, match="on_waiting=3 must be callable"):
        admission(node_dir, slots=1, on_waiting=3)  # type: ignore[arg-type]


def test_the_observer_logs_node_waiting_with_the_holders(node_dir: Path, fast_reports: None) -> None:
    """What a pool logs once the lead wires ``on_waiting=observer.node_waiting`` (see _pool.py)."""
    with structlog.testing.capture_logs() as logs:
        observer = Observer(pool="kv", runtime="fake", layout="raw", registry=None, logger=None)
        ours = admission(node_dir, budget=GiB, wait=True, on_waiting=observer.node_waiting)
        with ours.reserve_budget(GiB):
            ended = within(DEADLINE, lambda: ours.reserve_budget(GiB, cancelled=lambda: bool(logs), poll=0.02))
    assert isinstance(ended, NodeWaitCancelled)
    (event,) = logs
    assert event["event"] == "node.waiting" and event["log_level"] == "warning" and event["pool"] == "kv"
    assert event["kind"] == "budget" and event["seconds"] >= 0.2
    assert event["holders"] == [f"pid {os.getpid()} (pool 'test') [running]: 1 GiB"]


def test_a_pool_waiting_for_the_budget_logs_node_waiting(node_dir: Path, fast_reports: None) -> None:
    options: dict[str, Any] = {"size": MiB, "registry": None, "node_budget": MiB, "node_dir": str(node_dir)}
    with structlog.testing.capture_logs() as logs:
        first = pinpool.PinnedPool(name="first", runtime=FakeRuntime(), **options)
        second = pinpool.PinnedPool(name="second", runtime=FakeRuntime(), **options)

        def enter_second() -> None:
            with second:
                pass

        with first:
            thread = threading.Thread(target=enter_second, daemon=True)
            thread.start()
            deadline = time.monotonic() + 2.0
            while not any(e["event"] == "node.waiting" for e in logs) and time.monotonic() < deadline:
                time.sleep(0.02)
        thread.join(DEADLINE)
    assert not thread.is_alive()
    waiting = [e for e in logs if e["event"] == "node.waiting"]
    assert waiting, [e["event"] for e in logs]
    assert waiting[0]["pool"] == "second" and waiting[0]["kind"] == "budget"
    assert waiting[0]["holders"] == [f"pid {os.getpid()} (pool 'first') [running]: 1 MiB"]


@pytest.mark.parametrize(
    ("stat_line", "state"),
    [
        (b"42 (python) S 1 42", "running"),
        (b"42 (a) T (b) R 1 42", "running"),  # the name may hold ") T ": the state follows the last ")"
        (b"42 (pin) T 1 42", "stopped"),
        (b"42 (gdb me) t 1 42", "stopped"),
        (b"42 (x) Z 1 42", "zombie"),
        (b"", "unknown"),
    ],
)
def test_holder_state_reads_proc_stat(tmp_path: Path, stat_line: bytes, state: str) -> None:
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_bytes(stat_line)
    assert holder_state(42, proc=str(tmp_path)) == state
    assert holder_state(43, proc=str(tmp_path)) == "not found"
    assert holder_state(None) == "unknown"
    assert holder_state(os.getpid()) == "running"


def test_busy_errors_still_compare_without_a_state() -> None:
    busy = NodeBusyError("b", directory="/d", kind="slots", limit=1, in_use=1, holders=(NodeHolder(pid=1),))
    assert busy.holders == (NodeHolder(pid=1, nbytes=None, label="", state=None),)
    assert NodeHolder(pid=7, nbytes=GiB, label="kv", state="stopped").describe() == "pid 7 (pool 'kv') [stopped]: 1 GiB"


# -- 5. one wait loop, no async API that only tests called --------------------------------------------------


def test_node_admission_has_one_wait_loop_and_no_async_api() -> None:
    for gone in ("acquire_slot_sync", "reserve_budget_sync", "_wait_async", "_wait_sync"):
        assert not hasattr(NodeAdmission, gone), gone
    sleepers: list[str] = []
    for module in (inspect.getmodule(NodeAdmission), inspect.getmodule(NodePacing)):
        assert module is not None
        assert "anyio" not in vars(module), module.__name__
        tree = ast.parse(inspect.getsource(module))
        assert not [n.name for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)], module.__name__
        sleepers += [
            f"{module.__name__}.{n.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef)
            and any(isinstance(c, ast.Attribute) and c.attr == "sleep" for c in ast.walk(n))
        ]
    assert sleepers == ["pinpool._node.pacing._wait"]  # the one loop that waits: slots and budget share it


def test_fifo_checks_leave_lock_files_regular(node_dir: Path) -> None:
    """The files pinpool makes itself pass its own checks: regular, one link, mode 0600."""
    ours = admission(node_dir, slots=1, budget=GiB)
    with ours.acquire_slot(), ours.reserve_budget(GiB) as hold:
        for name in ("slot-0", "budget.lock", str(hold.name)):
            st = os.lstat(node_dir / name)
            assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and stat.S_IMODE(st.st_mode) == 0o600
        with open(node_dir / "slot-0", "rb") as f:
            assert f.read().split(b"\n")[:2] == [b"slot", str(os.getpid()).encode()]
    fd = os.open(node_dir / "budget.lock", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    finally:
        os.close(fd)
