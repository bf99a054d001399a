"""PressureWatch against the real kernel: a fresh cgroup v1 memory cgroup under this process's own,
squeezed by a child that writes page cache past the limit (reclaim, no OOM kill: the page cache can be
dropped), must wake the watch through ``memory.pressure_level`` and through a PSI trigger."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pinpool import ConfigError
from pinpool._host import (
    PressureError,
    PressureEvent,
    PressureWatch,
    PsiTrigger,
    binding_memory_cgroup,
    libc,
    psi_file,
)

from .cgroup_squeeze import remove_cgroup

MiB = 1 << 20
LIMIT = 128 * MiB
DEADLINE = 60.0  # seconds: generous, the events come within a few seconds


def _own_v1_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _id, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    pytest.skip("this process is in no cgroup v1 memory hierarchy (memory.pressure_level is v1 only)")


@contextlib.contextmanager
def v1_cgroup(limit: int) -> Iterator[Path]:
    """A new v1 memory cgroup under this process's, limited to ``limit``; its tasks are moved back out
    and it is removed afterwards. Skips, saying why, where cgroups are not writable."""
    parent = _own_v1_memory_cgroup()
    group = parent / f"pinpool-pressure-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {error} (read-only cgroupfs, or not root)")
    try:
        try:
            (group / "memory.limit_in_bytes").write_text(str(limit))
        except OSError as error:
            pytest.skip(f"cannot limit {group}: {error}")
        yield group
    finally:
        remove_cgroup(group, parent)


@contextlib.contextmanager
def squeeze(group: Path, directory: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A child in ``group`` that writes and deletes a file of 1.5 times the limit, over and over: every
    round fills the cgroup with page cache and makes the kernel reclaim it (the file is on disk, not
    tmpfs: its pages can be dropped, so nothing is OOM-killed). Killed (by its pid) afterwards."""
    file = directory / "squeeze"
    count = LIMIT * 3 // 2 // MiB
    script = (
        f'echo $$ > {group}/cgroup.procs && while :; do dd if=/dev/zero of="{file}" bs=1M count={count} '
        f'status=none || exit 3; rm -f "{file}"; done'
    )
    child = subprocess.Popen(["sh", "-c", script])
    try:
        yield child
    finally:
        child.kill()
        child.wait()
        file.unlink(missing_ok=True)


def wait_for(watch: PressureWatch, sources: set[str], child: subprocess.Popen[bytes]) -> dict[str, PressureEvent]:
    """The first event of each source in ``sources``; fails at the deadline, or if the child died."""
    seen: dict[str, PressureEvent] = {}
    deadline = time.monotonic() + DEADLINE
    while not sources <= seen.keys():
        assert child.poll() is None, f"the squeezing child exited with {child.returncode} (-9: OOM-killed)"
        left = deadline - time.monotonic()
        assert left > 0, f"no pressure event from {sources - seen.keys()} within {DEADLINE} s; saw {seen}"
        event = watch.wait(min(left, 1.0))
        if event is not None:
            seen.setdefault(event.source, event)
    return seen


@pytest.fixture
def group() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    with v1_cgroup(LIMIT) as made:
        yield made


def test_a_squeezed_v1_cgroup_wakes_the_watch_through_pressure_level_and_psi(group: Path, tmp_path: Path) -> None:
    if (psi := psi_file()) is None:
        pytest.skip("this kernel has no memory PSI")
    # 10 ms stalled in 2 s: a page-cache squeeze stalls reclaimers for tens of ms in all (measured here),
    # so a PSI threshold any higher may never be crossed by this test (a real policy would use ~150 ms).
    with (
        PressureWatch(PsiTrigger("some", 10_000, 2_000_000), "low", v1_cgroup=str(group)) as watch,
        squeeze(group, tmp_path) as child,
    ):
        assert {e.source for e in watch.armed} == {"psi", "cgroup_v1"} and watch.unavailable == ()
        seen = wait_for(watch, {"psi", "cgroup_v1"}, child)
    assert seen["cgroup_v1"].path == str(group) and seen["cgroup_v1"].level == "low"
    assert seen["cgroup_v1"].count >= 1
    assert seen["psi"] == PressureEvent("psi", psi, "some")
    assert int((group / "memory.failcnt").read_text()) > 0  # the limit was hit: reclaim, not an OOM kill
    assert "oom_kill 0" in (group / "memory.oom_control").read_text()


def test_removing_the_watched_cgroup_is_a_typed_error(group: Path) -> None:
    doomed = group / "doomed"
    doomed.mkdir()
    with PressureWatch(None, "critical", v1_cgroup=str(doomed)) as watch:
        doomed.rmdir()
        with pytest.raises(PressureError, match="was removed") as caught:
            watch.wait(DEADLINE)
        assert caught.value.path == str(doomed)


def test_the_watch_closes_its_files() -> None:
    before = len(os.listdir("/proc/self/fd"))
    watch = PressureWatch(PsiTrigger(), "medium")
    assert watch.armed
    assert len(os.listdir("/proc/self/fd")) == before + len(watch.armed) + 1  # and wake()'s eventfd
    watch.close()
    watch.close()  # idempotent
    assert len(os.listdir("/proc/self/fd")) == before
    with pytest.raises(PressureError, match="closed"):
        watch.wait(0)


def test_wake_ends_a_wait_from_another_thread() -> None:
    with PressureWatch(PsiTrigger(), "medium") as watch:
        waker = threading.Timer(0.01, watch.wake)  # after the wait began, or before: either ends it
        waker.start()
        assert watch.wait(None) is None  # a wait for ever, ended by wake() alone
        waker.join()
        watch.wake()
        assert watch.wait(None) is None  # a wake before the wait is kept for it
    with pytest.raises(PressureError, match="closed"):
        watch.wake()


def test_this_hosts_sources() -> None:
    cgroup = binding_memory_cgroup()
    watch = PressureWatch()
    with watch:
        armed = {e.source: e for e in watch.armed}
    if psi_file() is not None:
        assert armed["psi"].path == psi_file()
    if cgroup is not None and cgroup[0] == 1:
        assert armed["cgroup_v1"].path == cgroup[2] and armed["cgroup_v1"].level == "medium"


def test_a_sub_2s_window_needs_cap_sys_resource() -> None:
    if psi_file() is None:
        pytest.skip("this kernel has no memory PSI")
    trigger = PsiTrigger("some", 100_000, 1_000_000)
    if libc.has_capability(libc.CAP_SYS_RESOURCE):
        with PressureWatch(trigger, None) as watch:
            assert [e.source for e in watch.armed] == ["psi"]
        return
    with pytest.raises(PressureError, match="multiples of 2 s") as caught:
        PressureWatch(trigger, None)
    assert caught.value.path == psi_file()


def test_nothing_armable_is_a_pressure_error_with_the_fallback(tmp_path: Path) -> None:
    missing = str(tmp_path / "memory.pressure")
    with pytest.raises(PressureError, match="read_memory_pressure every 1-2 s") as caught:
        PressureWatch(PsiTrigger(), "low", psi_path=missing, v1_cgroup=str(tmp_path))
    assert missing in str(caught.value) and "memory.pressure_level" in str(caught.value)
    with pytest.raises(PressureError, match="no source was asked for"):
        PressureWatch(None, None)


def test_one_source_missing_still_arms_the_other(tmp_path: Path) -> None:
    if psi_file() is None:
        pytest.skip("this kernel has no memory PSI")
    with PressureWatch(PsiTrigger(), "low", v1_cgroup=str(tmp_path)) as watch:
        assert [e.source for e in watch.armed] == ["psi"]
        assert len(watch.unavailable) == 1 and str(tmp_path) in watch.unavailable[0]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kind": "most"}, "use 'some' or 'full'"),
        ({"threshold_us": 0}, "threshold_us=0"),
        ({"threshold_us": 1.5}, "threshold_us=1.5"),
        ({"window_us": 100_000}, "from 500000"),
        ({"window_us": 20_000_000}, "to 10000000"),
        ({"threshold_us": 3_000_000}, "above window_us"),
    ],
)
def test_trigger_checks(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        PsiTrigger(**kwargs)  # type: ignore[arg-type]


def test_level_check() -> None:
    with pytest.raises(ConfigError, match="v1_level='severe'"):
        PressureWatch(None, "severe")


def test_the_trigger_line_ends_in_a_nul() -> None:
    # /proc/pressure/* overwrite the last byte written with a NUL: without one, the window loses a digit.
    assert PsiTrigger("full", 150_000, 2_000_000).line() == b"full 150000 2000000\0"
