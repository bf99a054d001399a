"""A real cgroup v2 PSI trigger: a child in a new cgroup v2 group (and, for the squeeze, a memory cgroup with a
limit) arms the watch pinpool would arm for it, and a page-cache squeeze inside both wakes it through THAT v2
cgroup's ``memory.pressure``, not the system-wide file's.

On a hybrid host (cgroup v1 controllers, a cgroup2 mount at /sys/fs/cgroup/unified, often with no memory
controller) every v2 cgroup still keeps ``memory.pressure``: the stall of its own tasks. The limit then comes
from the v1 memory cgroup; on a pure v2 host with the memory controller, from the v2 group's ``memory.max``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from .cgroup_squeeze import remove_cgroup
from .test_pressure_watch import v1_cgroup

MiB = 1 << 20
LIMIT = 128 * MiB
DEADLINE_S = 60.0  # for a wake that comes in a second or two: only a hung child reaches it

# argv: the cgroup.procs files to join (colon-separated), the file to squeeze with, the deadline, the file's MiB.
# Joins the groups before anything else, arms the watch pinpool arms (PSI only: the v1 level would wake it too),
# then squeezes: a shell child (in the same groups) writes and deletes a file of 1.5 times the limit, over and over.
CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    procs, file, deadline = sys.argv[1].split(":"), sys.argv[2], float(sys.argv[3])
    for path in procs:
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    from pinpool._host import PressureWatch, PsiTrigger, psi_file

    def say(**fields):
        print(json.dumps(fields), flush=True)

    chosen = psi_file()
    # 10 ms stalled in 2 s: a page-cache squeeze stalls its reclaimers for tens of ms (docs/performance.md).
    watch = PressureWatch(PsiTrigger("some", 10_000, 2_000_000), None)
    say(event="armed", psi_file=chosen, armed=[e.path for e in watch.armed], cgroup=open("/proc/self/cgroup").read())
    count = int(sys.argv[4])
    script = f'while :; do dd if=/dev/zero of="{file}" bs=1M count={count} status=none || exit 3; rm -f "{file}"; done'
    crossed = []

    def sample():  # when the group's own stall first passed the threshold, to tell it from the trigger's delay
        while not crossed:
            with open(chosen) as f:
                if int(f.readline().rsplit("total=", 1)[1]) >= 10_000:
                    crossed.append(time.monotonic())
            time.sleep(0.005)
    threading.Thread(target=sample, daemon=True).start()
    started = time.monotonic()
    squeezer = subprocess.Popen(["sh", "-c", script])
    try:
        event = watch.wait(deadline)
        woke = time.monotonic()
    finally:
        squeezer.kill()
        squeezer.wait()
        watch.close()
    say(event="woke", path=None if event is None else event.path, source=None if event is None else event.source,
        seconds=woke - started, stalled=crossed[0] - started if crossed else None, squeezer=squeezer.returncode)
    """
)


def _v2_mount() -> Path | None:
    """Where this process's cgroup2 hierarchy is mounted (a hybrid host: /sys/fs/cgroup/unified)."""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ")
        if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
            return Path(fields[0].split()[4])
    return None


def _own_v2_path() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


@contextlib.contextmanager
def v2_cgroup() -> Iterator[Path]:
    """A new cgroup v2 group under this process's own; its tasks are moved back and it is removed afterwards.
    Skips, saying why, where there is no cgroup2 mount or it is not writable."""
    mount = _v2_mount()
    if mount is None:
        pytest.skip("no cgroup2 hierarchy is mounted here (a v1-only host has no per-cgroup memory.pressure)")
    parent = mount / _own_v2_path().lstrip("/")
    group = parent / f"pinpool-psi-{os.getpid()}"
    try:
        group.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a cgroup v2 group under {parent}: {error} (read-only cgroupfs, or not root)")
    try:
        if not (group / "memory.pressure").exists():
            pytest.skip(f"{group} has no memory.pressure (a kernel without PSI, or psi=0)")
        yield group
    finally:
        remove_cgroup(group, parent)


def test_a_squeeze_wakes_the_trigger_on_the_processs_own_v2_cgroup(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    with v2_cgroup() as v2, contextlib.ExitStack() as stack:
        pure_v2 = (v2 / "memory.max").exists()
        if pure_v2:
            (v2 / "memory.max").write_text(str(LIMIT))
            procs = [v2 / "cgroup.procs"]
        else:
            v1 = stack.enter_context(v1_cgroup(LIMIT))
            procs = [v1 / "cgroup.procs", v2 / "cgroup.procs"]
        child = subprocess.run(
            [sys.executable, "-c", CHILD, ":".join(map(str, procs)), str(tmp_path / "squeeze"), str(DEADLINE_S),
             str(LIMIT * 3 // 2 // MiB)],
            capture_output=True, text=True, timeout=DEADLINE_S * 2,
        )  # fmt: skip
        assert child.returncode == 0, child.stderr
        armed, woke = (json.loads(line) for line in child.stdout.splitlines())
        own = str(v2 / "memory.pressure")
        assert f"0::/{v2.relative_to(_v2_mount() or '/')}" in armed["cgroup"]  # it lived in the new group
        assert armed["psi_file"] == own and armed["armed"] == [own]  # that group's file, not /proc/pressure/memory
        assert woke["source"] == "psi" and woke["path"] == own, (woke, child.stderr)
        assert woke["squeezer"] == -9  # still squeezing when it woke: killed by the child, never OOM-killed
        some = (v2 / "memory.pressure").read_text().splitlines()[0]
        assert int(some.rsplit("total=", 1)[1]) > 0, some  # the group's own tasks stalled
        assert woke["stalled"] is not None and woke["stalled"] <= woke["seconds"], woke
        print(f"v2 PSI: {own} stalled 10 ms {woke['stalled']:.3f} s into the squeeze; woke at {woke['seconds']:.3f} s")
