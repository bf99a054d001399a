"""Does a background pool leave its server the CPU, with and without a container CPU limit?

    python benchmarks/bench_cpu_budget.py                      # 4 GiB mlock pool, 3 reps, host and 1-CPU cgroup
    python benchmarks/bench_cpu_budget.py --reps 5 --json out.json
    python benchmarks/bench_cpu_budget.py --where host         # no cgroup (no privileges needed)
    python benchmarks/bench_cpu_budget.py --help

Each run is a fresh child process (this file with ``--child``), the "server": a serving thread
runs a CPU task of about ``--task-ms`` (SHA-256 over a buffer, calibrated once in the parent so
every run does the same work) in a loop, sleeping ``--gap-ms`` between tasks, as a server's
scheduler loop does between steps; each task's latency is recorded. The child measures (a)
**idle**: ``--idle-seconds`` of tasks with nothing else running before the pool, and as long
again as the pin took (at most 4x ``--idle-seconds``) once it is ready, then (b) **pinning**:
the tasks that ran while a ``PinnedPool(size=--size, runtime="mlock", background=True)``
pinned, from entering the pool until it is ready. The ratio p99 (b) / p99 (a) is of the same
process, so the noise of a shared host weighs on both.

Configurations, interleaved in alternating order:

- ``today``: the worker counts pinpool chose before the CPU budget: one per CPU of the affinity
  (``populate_workers=`` and ``register_workers=`` given explicitly as ``len(sched_getaffinity)``).
- ``default``: no worker options: the CPU budget (affinity bounded by the cgroup's quota), less
  one CPU left to the server for a background pool.

Where: ``host`` (the child in this process's own cgroup) and ``cgroup`` (the child moved into a
new cgroup with a ``--quota-cpus`` CPU quota before it imports anything: cgroup v2 ``cpu.max``
where the unified hierarchy has the ``cpu`` controller, else v1 ``cpu.cfs_quota_us``, mounting a
v1 ``cpu`` hierarchy if none is). Making a cgroup needs root (or a delegated cgroup v2 subtree):
without it the benchmark says so and how to run it, e.g. ``sudo``, or under systemd
``systemd-run --scope -p CPUQuota=100% python benchmarks/bench_cpu_budget.py --where host``.
The cgroup's ``cpu.stat`` throttling counters are reported for the pinning phase.

Reported: per configuration and place, the median over ``--reps`` of the per-run ratio, the
p99s, the pin seconds, the pin time against ``today`` (paired per repetition), and the throttled
periods. Benchmark code, not part of the package: pinpool's public API only (and the cgroup
filesystem).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CONFIGS = ("today", "default")
BLOCK = bytes(range(256)) * 64  # 16 KiB: hashlib releases the GIL for it, so the task is CPU, not GIL


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def task(rounds: int) -> None:
    h = hashlib.sha256()
    for _ in range(rounds):
        h.update(BLOCK)


def calibrate(task_ms: float) -> int:
    """Rounds of ``task`` that take about ``task_ms`` here (the median of a few tries)."""
    rounds = 64
    while True:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            task(rounds)
            times.append(time.perf_counter() - t0)
        took = statistics.median(times) * 1000
        if took >= task_ms / 4:
            return max(1, round(rounds * task_ms / took))
        rounds *= 4


# -- the child: one server, one run ----------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    import pinpool  # imported here: the parent never pins

    latencies: list[tuple[float, float]] = []  # (start, seconds)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            task(args.rounds)
            latencies.append((t0, time.perf_counter() - t0))
            if args.gap_ms:
                time.sleep(args.gap_ms / 1000)

    cpus = len(os.sched_getaffinity(0))
    options: dict[str, Any] = {}
    if args.config == "today":
        options = {"populate_workers": cpus, "register_workers": cpus}
    server = threading.Thread(target=serve, name="serving")
    stat_before = _cpu_stat(args.cpu_stat)
    server.start()
    time.sleep(args.idle_seconds)
    idle_end = time.perf_counter()
    pool = pinpool.PinnedPool(size=args.size, runtime="mlock", background=True, registry=None, **options)
    with pool:
        pin_start = time.perf_counter()
        stat_start = _cpu_stat(args.cpu_stat)
        pool.wait_ready_sync()
        pin_end = time.perf_counter()
        stat_end = _cpu_stat(args.cpu_stat)
        # Idle again, as long as the pin took (within bounds): the host's noise then weighs on
        # both phases alike (other work on a shared machine comes and goes).
        time.sleep(min(max(args.idle_seconds, pin_end - pin_start), 4 * args.idle_seconds))
        stop.set()
        server.join()
        workers = (pool.plan.populate_workers, pool.plan.register_workers, pool.plan.threads)
    after = pin_end + 0.2  # the pool's last books and the workers' exit
    idle = [s for t0, s in latencies if (t0 + s <= idle_end) or t0 >= after]
    pinning = [s for t0, s in latencies if t0 >= pin_start and t0 + s <= pin_end]
    throttled = None
    if stat_start and stat_end:
        throttled = {k: stat_end.get(k, 0) - stat_start.get(k, 0) for k in stat_end}
    result = {
        "config": args.config, "idle_p50_ms": percentile(idle, 50) * 1000, "idle_p99_ms": percentile(idle, 99) * 1000,
        "pin_p50_ms": percentile(pinning, 50) * 1000, "pin_p99_ms": percentile(pinning, 99) * 1000,
        "pin_max_ms": max(pinning) * 1000, "idle_n": len(idle), "pin_n": len(pinning),
        "pin_seconds": pin_end - pin_start, "workers": workers, "affinity": cpus, "throttled": throttled,
        "idle_throttled": None if not (stat_before and stat_start) else {
            k: stat_start.get(k, 0) - stat_before.get(k, 0) for k in stat_start
        },
    }  # fmt: skip
    result["ratio"] = result["pin_p99_ms"] / result["idle_p99_ms"]
    print("RESULT " + json.dumps(result), flush=True)


def _cpu_stat(path: str | None) -> dict[str, int] | None:
    if not path:
        return None
    with contextlib.suppress(OSError):
        return {k: int(v) for k, v in (line.split() for line in Path(path).read_text().splitlines())}
    return None


# -- the cgroup ----------------------------------------------------------------------------------------


class NoCgroup(Exception):
    pass


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(fstype, mount point, super options) of the cgroup mounts."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        tail = right.split()
        if len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((tail[0], left.split()[4], tail[2].split(",")))
    return found


@contextlib.contextmanager
def quota_cgroup(cpus: float) -> Iterator[tuple[str, str, str]]:
    """A new cgroup with a CPU quota of ``cpus``: (its cgroup.procs, its cpu.stat, a description)."""
    name = f"pinpool-bench-{uuid.uuid4().hex[:8]}"
    period = 100_000
    mounts = _mounts()
    mounted_here: str | None = None
    group: Path | None = None
    try:
        for fstype, point, _ in mounts:
            if fstype == "cgroup2" and "cpu" in Path(point, "cgroup.controllers").read_text().split():
                group = Path(point, name)
                try:
                    group.mkdir()
                    (group / "cpu.max").write_text(f"{round(cpus * period)} {period}")
                except OSError:
                    with contextlib.suppress(OSError):
                        group.rmdir()
                    group = None
                    continue
                yield str(group / "cgroup.procs"), str(group / "cpu.stat"), f"cgroup v2 {group} cpu.max"
                return
        v1 = [point for fstype, point, opts in mounts if fstype == "cgroup" and "cpu" in opts]
        if not v1:
            mounted_here = f"/tmp/{name}-cpu"
            os.makedirs(mounted_here)
            if subprocess.run(["mount", "-t", "cgroup", "-o", "cpu", "cgroup", mounted_here]).returncode:
                raise NoCgroup("no cgroup v2 cpu controller and no v1 cpu hierarchy (mounting one failed)")
            v1 = [mounted_here]
        group = Path(v1[0], name)
        try:
            group.mkdir()
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(round(cpus * period)))
        except OSError as exc:
            raise NoCgroup(f"cannot make a v1 cpu cgroup in {v1[0]}: {exc}") from exc
        yield str(group / "cgroup.procs"), str(group / "cpu.stat"), f"cgroup v1 {group} cpu.cfs_quota_us"
    except PermissionError as exc:
        raise NoCgroup(str(exc)) from exc
    finally:
        if group is not None:
            with contextlib.suppress(OSError):
                group.rmdir()
        if mounted_here is not None:
            subprocess.run(["umount", mounted_here], check=False)
            with contextlib.suppress(OSError):
                os.rmdir(mounted_here)


# -- the parent ----------------------------------------------------------------------------------------


def run_child(
    args: argparse.Namespace, config: str, rounds: int, procs: str | None, stat: str | None
) -> dict[str, Any]:
    argv = [
        sys.executable, __file__, "--child", "--config", config, "--rounds", str(rounds), "--size", args.size,
        "--gap-ms", str(args.gap_ms), "--idle-seconds", str(args.idle_seconds),
    ]  # fmt: skip
    if stat:
        argv += ["--cpu-stat", stat]
    if procs:  # into the cgroup before the interpreter starts: everything it runs is charged there
        argv = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[7:])
            return result
    raise RuntimeError(f"child {config} failed (rc {out.returncode}): {out.stderr[-2000:]}")


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {c: [r for r in runs if r["config"] == c] for c in CONFIGS}
    today_pin = [r["pin_seconds"] for r in by["today"]]
    out: dict[str, Any] = {}
    for config, rs in by.items():
        paired = [r["pin_seconds"] / t for r, t in zip(rs, today_pin, strict=False)]
        throttled = [r["throttled"] for r in rs if r["throttled"]]
        out[config] = {
            "ratio_median": statistics.median(r["ratio"] for r in rs),
            "ratios": [round(r["ratio"], 2) for r in rs],
            "idle_p99_ms": statistics.median(r["idle_p99_ms"] for r in rs),
            "pin_p99_ms": statistics.median(r["pin_p99_ms"] for r in rs),
            "pin_seconds": statistics.median(r["pin_seconds"] for r in rs),
            "pin_vs_today": statistics.median(paired),
            "workers": rs[0]["workers"],
            "throttled_periods": [f"{t.get('nr_throttled', 0)}/{t.get('nr_periods', 0)}" for t in throttled],
        }
    return out


def render(where: str, summary: dict[str, Any]) -> str:
    lines = [
        f"### {where}",
        "",
        "| configuration | workers (populate, register, threads) | p99 pinning / idle, median (per run) "
        "| p99 ms idle / pinning | pin s | pin time vs today | throttled periods while pinning |",
        "|---|---|---|---|---|---|---|",
    ]
    for config, s in summary.items():
        ratios = ", ".join(map(str, s["ratios"]))
        lines.append(
            f"| {config} | {', '.join(map(str, s['workers']))} | {s['ratio_median']:.2f}x ({ratios}) "
            f"| {s['idle_p99_ms']:.2f} / {s['pin_p99_ms']:.2f} | {s['pin_seconds']:.2f} | {s['pin_vs_today']:.2f}x "
            f"| {', '.join(s['throttled_periods']) or '-'} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="4GiB", help="the background pool's size (default 4GiB)")
    parser.add_argument("--reps", type=int, default=3, help="runs per configuration and place (default 3)")
    parser.add_argument("--where", choices=("host", "cgroup", "both"), default="both")
    parser.add_argument("--quota-cpus", type=float, default=1.0, help="the cgroup's CPU quota (default 1)")
    parser.add_argument("--task-ms", type=float, default=2.0, help="the serving task's length (default 2 ms)")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="sleep between tasks (default 2 ms)")
    parser.add_argument("--idle-seconds", type=float, default=3.0, help="the idle phase (default 3 s)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write the runs and summaries here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-stat", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    rounds = calibrate(args.task_ms)
    print(f"task: {rounds} x 16 KiB SHA-256 (~{args.task_ms} ms here), {args.gap_ms} ms between tasks", flush=True)
    report: dict[str, Any] = {"rounds": rounds, "args": vars(args), "places": {}}
    places = ("host", "cgroup") if args.where == "both" else (args.where,)
    for where in places:
        runs: list[dict[str, Any]] = []
        try:
            with contextlib.ExitStack() as stack:
                procs = stat = None
                label = "host (this process's cgroup, no quota)"
                if where == "cgroup":
                    procs, stat, made = stack.enter_context(quota_cgroup(args.quota_cpus))
                    label = f"{args.quota_cpus:g}-CPU quota ({made})"
                print(f"{where}: {label}", flush=True)
                for rep in range(args.reps):
                    order = CONFIGS if rep % 2 == 0 else CONFIGS[::-1]
                    for config in order:
                        run = run_child(args, config, rounds, procs, stat)
                        run["rep"] = rep
                        runs.append(run)
                        print(
                            f"  rep {rep} {config}: p99 idle {run['idle_p99_ms']:.2f} ms, pinning "
                            f"{run['pin_p99_ms']:.2f} ms ({run['ratio']:.2f}x), pin {run['pin_seconds']:.2f} s, "
                            f"workers {run['workers']}, throttled {run['throttled']}",
                            flush=True,
                        )
        except NoCgroup as exc:
            print(
                f"cgroup: skipped, cannot make a cgroup with a CPU quota here ({exc}). Run as root, or in a "
                "delegated cgroup v2 subtree, or under systemd: systemd-run --scope -p CPUQuota=100% "
                f"{sys.executable} {__file__} --where host",
                flush=True,
            )
            continue
        summary = summarise(runs)
        report["places"][where] = {"label": label, "runs": runs, "summary": summary}
        print(render(label, summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
