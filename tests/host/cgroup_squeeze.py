"""A real memory cgroup for tests, and the squeeze of issue 36 item 4: a server pinning a pool and a
neighbour allocating memory in steps, both inside one cgroup with a limit; who the OOM killer takes.

:func:`memory_cgroup` makes a cgroup under this process's own memory cgroup (v2 where the unified
hierarchy has the memory controller, else v1 under /sys/fs/cgroup/memory) and always removes it,
moving out whatever is left in it; it skips, saying why, where cgroups are not writable.
:meth:`MemoryCgroup.entered` runs this process inside it for a while, so its usage is this test's alone.

:func:`start` runs a script in a child (forked from the preloaded interpreter: torch is imported
already) that joins the cgroup before anything else. Scripts report events as JSON lines through
``say(event=..., ...)``, stamped with ``CLOCK_MONOTONIC`` (one clock for every process), and a test
waits for them (:meth:`Process.wait_for`), never for a time. :func:`squeeze` runs the neighbour
against a started server and returns what happened (:class:`Outcome`). An elastic server is another
script given to :func:`start`, checked with the same :func:`squeeze`::

    with memory_cgroup() as group:
        with start(group, ELASTIC_SERVER, str(256 * MiB)) as server:
            server.wait_for("ready")
            group.set_limit(group.usage() + HEADROOM)
            out = squeeze(group, server, total=2 * HEADROOM)
        assert out.server_code is None and out.oom_kills == 0
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from .. import preloaded

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
CGROUP_FS = Path("/sys/fs/cgroup")
DEADLINE_S = 60.0  # for an event that comes in milliseconds: only a hung child reaches it
_names = itertools.count()


# -- the cgroup --------------------------------------------------------------------------------------------


def _own_cgroups(text: str) -> tuple[str | None, str | None]:
    """``(v1 memory path, v2 path)`` of a process, from its /proc/<pid>/cgroup ``text``."""
    v1 = v2 = None
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif controllers == "":
            v2 = path
    return v1, v2


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:  # one write(2): a cgroup file takes a value per write
        f.write(text)


@dataclass
class MemoryCgroup:
    """A memory cgroup this test made: ``path``, its cgroup ``version`` and the ``home`` cgroup
    (this process's) that what is left in it is moved back to."""

    path: Path
    version: int
    home: Path

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def usage(self) -> int:
        """Bytes charged to the cgroup now (v1 ``memory.usage_in_bytes``, v2 ``memory.current``); v1
        charges in per-CPU batches of 64 pages, so it runs up to 256 KiB per CPU ahead."""
        return int(self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current"))

    def peak_usage(self) -> int:
        """The most it was charged (v2 before Linux 5.19 has no ``memory.peak``: the usage now)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int(self._read(name)) if (self.path / name).exists() else self.usage()

    def set_limit(self, nbytes: int) -> None:
        """The limit the OOM killer enforces, with no swap to make room by (where swap is accounted)."""
        if self.version == 1:
            memory, memsw = self.path / "memory.limit_in_bytes", self.path / "memory.memsw.limit_in_bytes"
            # v1 keeps memory+swap's limit at or above memory's: raised first, lowered last.
            order = [memsw, memory] if memsw.exists() and nbytes > int(memsw.read_text()) else [memory, memsw]
            for path in order:
                if path.exists():
                    _write(path, str(nbytes))
        else:
            _write(self.path / "memory.max", str(nbytes))
            if (self.path / "memory.swap.max").exists():
                _write(self.path / "memory.swap.max", "0")

    def oom_kills(self) -> int:
        """Processes the OOM killer took in this cgroup (v1 ``memory.oom_control``, v2 ``memory.events``)."""
        text = self._read("memory.oom_control" if self.version == 1 else "memory.events")
        found = re.search(r"^oom_kill (\d+)$", text, re.M)
        if found is None:
            raise AssertionError(f"no oom_kill counter in {self.path} (kernel < 4.13?): {text!r}")
        return int(found.group(1))

    def pids(self) -> list[int]:
        return [int(pid) for pid in self._read("cgroup.procs").split()]

    def add(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    @contextlib.contextmanager
    def entered(self) -> Iterator[MemoryCgroup]:
        """This process inside the cgroup: what it faults meanwhile is charged here (what it had stays
        charged where it was: v1 moves no charges unless told, v2 never does)."""
        self.add(os.getpid())
        try:
            yield self
        finally:
            _write(self.home / "cgroup.procs", str(os.getpid()))


def _hierarchy() -> tuple[Path, int] | str:
    """This process's memory cgroup directory and version, or why there is none to nest one under."""
    v1, v2 = _own_cgroups(Path("/proc/self/cgroup").read_text())
    unified = CGROUP_FS / "unified" if (CGROUP_FS / "unified").is_dir() else CGROUP_FS
    if v2 is not None:
        home = unified / v2.lstrip("/")
        controllers = home / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return home, 2
    if v1 is not None and (CGROUP_FS / "memory" / "memory.limit_in_bytes").exists():
        return CGROUP_FS / "memory" / v1.lstrip("/"), 1
    return f"no memory controller: not in cgroup v2 at {unified}, no v1 hierarchy at {CGROUP_FS / 'memory'}"


@contextlib.contextmanager
def memory_cgroup(limit: int | None = None) -> Iterator[MemoryCgroup]:
    """A new memory cgroup under this process's own (``limit`` bytes, or none), removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    found = _hierarchy()
    if isinstance(found, str):
        pytest.skip(found)
    home, version = found
    group = MemoryCgroup(home / f"pinpool-squeeze-{os.getpid()}-{next(_names)}", version, home)
    try:
        group.path.mkdir()
    except OSError as error:
        pytest.skip(f"cannot make a cgroup under {home} (cgroup v{version}): {error}")
    try:
        if version == 2:
            subtree = home / "cgroup.subtree_control"
            if "memory" not in subtree.read_text().split():
                try:
                    _write(subtree, "+memory")
                except OSError as error:  # EBUSY: a cgroup with processes of its own hands on no controller
                    pytest.skip(f"cannot enable the memory controller below {home} (cgroup v2): {error}")
        if limit is not None:
            group.set_limit(limit)
        yield group
    finally:
        _remove(group)


def _remove(group: MemoryCgroup) -> None:
    remove_cgroup(group.path, group.home)


def remove_cgroup(path: Path, home: Path) -> None:
    """A cgroup a test made, v1 or v2: what is left in it moved to ``home`` (a dying process may linger a
    moment), then removed; loud when it stays."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        for pid in (path / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError, OSError):  # it may exit meanwhile
                _write(home / "cgroup.procs", pid)
        try:
            path.rmdir()
            return
        except OSError as error:
            if time.monotonic() > deadline:
                raise AssertionError(f"the test's cgroup {path} could not be removed: {error}") from error
            time.sleep(0.01)


# -- processes in it ---------------------------------------------------------------------------------------

# Joins the cgroup before anything else runs; say() reports one event.
PRELUDE = """
import json, os, sys, time
from pinpool.testing import locked_bytes
with open(sys.argv.pop(1), "w") as _procs:
    _procs.write(str(os.getpid()))
def say(event, **fields):
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)
"""

# A server with a fixed pool of argv[1] bytes, mlocked; it serves until its stdin closes, answering each
# line with the pool's sum (its bytes still all ones).
FIXED_SERVER = """
import torch
import pinpool
with pinpool.PinnedPool(size=int(sys.argv[1]), runtime="mlock", registry=None, name="squeezed") as pool:
    pool.tensor.fill_(1)
    say("ready", pinned=pool.pinned_bytes, locked=locked_bytes())
    for line in sys.stdin:
        say("served", sum=int(pool.tensor.sum(dtype=torch.int64)))
say("closed")
"""

# A server with an elastic pool: a floor of argv[1] bytes, grown to argv[2] reserved in segments of argv[3],
# its policy loop on, stepping by argv[4] bytes (following this cgroup: v1 pressure_level, its usage against
# the limit) and giving up the tail; it reports the pool's events (pool.grow, pool.shrink, elastic.*) as they
# come, and serves as the fixed one does, checking its floor.
ELASTIC_SERVER = """
import threading
import torch
import pinpool
_say, _lines = say, threading.Lock()
def say(event, **fields):  # the loop's thread says things too: a line at a time
    with _lines:
        _say(event, **fields)
floor, reserve, segment, step = (int(a) for a in sys.argv[1:5])
class Say:  # a structlog-shaped logger: each of the pool's events (but chunks') is a line
    def bind(self, **fields): return self
    def debug(self, event, **fields): pass
    def _say(self, event, **fields):
        plain = (int, float, str, bool, type(None))
        say(event, **{k: v if isinstance(v, plain) else str(v) for k, v in fields.items()})
    info = warning = error = critical = _say
box = []
def give_up(nbytes):  # the server's allocator frees from the top: the tail, never below the floor
    top = box[0].pinned_runs[-1].stop
    return [range(max(floor, top - nbytes), top)]
policy = pinpool.ElasticPolicy(step=step, headroom=0, grow_while_free=True, shrink_psi=50.0, calm_psi=5.0,
    shrink_used=0.75, calm_used=0.6, cooldown_seconds=0.2, shrink_interval_seconds=0.05, read_interval_seconds=0.05)
with pinpool.PinnedPool(size=floor, reserve=reserve, grow_step=segment, runtime="mlock", registry=None,
                        name="squeezed", logger=Say(), elastic=policy, on_give_up=give_up) as pool:
    box.append(pool)
    pool.grow_sync(nbytes=reserve - floor)
    pool.tensor[:floor].fill_(1)
    say("ready", pinned=pool.pinned_bytes, locked=locked_bytes())
    for line in sys.stdin:
        floor_bytes = pool.tensor[:floor]  # min and max: no temporary (a sum to int64 would copy it 8 times over)
        say("served", intact=int(floor_bytes.min()) == int(floor_bytes.max()) == 1, pinned=pool.pinned_bytes)
say("closed")
"""

# A neighbour that touches argv[2] bytes in steps of argv[1], pausing argv[3] s after each, then holds
# them until its stdin closes.
NEIGHBOUR = """
import mmap
step, total, pause = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
held, touched = [], 0
while touched < total:
    m = mmap.mmap(-1, step)
    for offset in range(0, step, mmap.PAGESIZE):
        m[offset] = 1
    held.append(m)
    touched += step
    say("touched", bytes=touched)
    if pause:
        time.sleep(pause)
say("done", bytes=touched)
sys.stdin.read()
"""


@dataclass
class Process:
    """A child in the cgroup, its events read on a thread as they come."""

    child: preloaded.Child
    events: list[dict[str, Any]] = field(default_factory=list)
    _queue: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            self._queue.put(json.loads(line))
        self._queue.put(None)  # EOF: it exited

    def wait_for(self, event: str) -> dict[str, Any] | None:
        """The next ``event`` it reports, or None once it has exited without reporting one."""
        while True:
            try:
                got = self._queue.get(timeout=DEADLINE_S)
            except queue.Empty:
                raise AssertionError(f"no {event!r} from {self.child.args[2][:40]!r} within {DEADLINE_S} s") from None
            if got is None:
                self._queue.put(None)  # every later wait sees the exit too
                return None
            self.events.append(got)
            if got["event"] == event:
                return got

    def send(self, line: str) -> None:
        """Write ``line`` to its stdin; to a child that is gone, nothing (its output's end says so)."""
        assert self.child.stdin is not None
        try:
            self.child.stdin.write(line + "\n")
            self.child.stdin.flush()
        except BrokenPipeError:
            with contextlib.suppress(BrokenPipeError):
                self.child.stdin.close()  # the write that failed stays buffered: closing once drops it

    def stderr(self) -> str:
        assert self.child.stderr is not None
        return str(self.child.stderr.read())

    def close(self) -> int:
        """Close its stdin (a server leaves its pool, a neighbour lets go) and wait for it."""
        assert self.child.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.child.stdin.close()
        return self.child.wait(DEADLINE_S)


@contextlib.contextmanager
def start(group: MemoryCgroup, script: str, *args: str) -> Iterator[Process]:
    """Run ``script`` (after :data:`PRELUDE`) in a child that joins ``group`` first; killed on the way out."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", PRELUDE + script, str(group.path / "cgroup.procs"), *args]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with preloaded.Child(argv, cwd=ROOT, env=env, text=True, **pipes) as child:
        yield Process(child)


@dataclass(frozen=True)
class Outcome:
    """What a squeeze did: exit codes (None: alive, and it served once more: ``server.events``), the OOM
    kills it caused, how far the neighbour got, the cgroup's peak usage."""

    server_code: int | None
    neighbour_code: int | None
    oom_kills: int
    neighbour_bytes: int
    peak_usage: int
    neighbour_events: tuple[dict[str, Any], ...]  # each step's "touched", stamped: to time the server's answers by


def squeeze(group: MemoryCgroup, server: Process, *, total: int, step: int = 16 * MiB, pause: float = 0.0) -> Outcome:
    """Run the neighbour against ``server`` (started, ready) until it has touched ``total`` bytes or died,
    then ask the server to serve once: it answers (alive: its ``served`` event is in ``server.events``)
    or its output ends (dead: its exit code is waited for). The neighbour is let go before this returns."""
    kills = group.oom_kills()
    with start(group, NEIGHBOUR, str(step), str(total), str(pause)) as neighbour:
        done = neighbour.wait_for("done")
        reached = max((e["bytes"] for e in neighbour.events if e["event"] == "touched"), default=0)
        neighbour_code = neighbour.child.wait(DEADLINE_S) if done is None else None
        # A killed server may still be freeing its pinned pages: no poll, its answer or its end says.
        server.send("serve")
        served = server.wait_for("served")
        server_code = server.child.wait(DEADLINE_S) if served is None else None
        peak = group.peak_usage()
        oom_kills = group.oom_kills() - kills
        if neighbour_code is None:
            neighbour.close()
    return Outcome(server_code, neighbour_code, oom_kills, reached, peak, tuple(neighbour.events))
