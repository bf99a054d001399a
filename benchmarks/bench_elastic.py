"""Elastic pools (issue 36): growing while a serving thread runs, and memory back after a pressure signal.

    python benchmarks/bench_elastic.py                     # 1 GiB segments, mlock, 3 reps
    python benchmarks/bench_elastic.py --step 512MiB --reps 5 --json out.json

Part 1, **growing while serving**: an elastic pool (``size=`` a 256 MiB floor, ``reserve=`` floor + step,
``grow_step=`` step, mlock) is open; a "serving" thread maps a small anonymous region
(``mmap.mmap(-1, 64 KiB)``), writes one byte per 4 KiB page and unmaps it, once per millisecond (as
benchmarks/bench_serving.py's part 2: mmap and munmap wait behind the pool's mmap_lock-holding calls).
Its latencies are recorded for ``--idle-seconds`` with the pool idle, then while ``pool.grow_sync()``
pins one segment of ``--step``; reported as p99 (and max) during the grow against idle, per rep.

Part 2, **memory back after a pressure signal**: the same pool, grown, with its policy loop on
(``elastic=ElasticPolicy(floor=..., step=...)``, ``on_give_up`` giving up the grown segment,
``pressure=pinpool.testing.FakePressure()``). The clock starts when the fake source reports pressure
(PSI some avg10 = 50 %) and stops when the process's VmLck has fallen by the segment: the loop's
decision, the server's callback, the unpin and the give-back (``MADV_DONTNEED``), end to end. A real
PSI or cgroup v1 notification adds its own latency before that (tests/host/test_squeeze.py: ~10-50 ms).

Reps alternate the parts; one pool at a time. Benchmark code, not part of the package: pinpool's public
API (and ``pinpool.testing.FakePressure``) only.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import pinpool
from pinpool.testing import FakePressure

MiB = 1 << 20


def vm_locked() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmLck in /proc/self/status")


def percentile(values: Sequence[float], q: float) -> float:
    """0.0 for no value: a grow can end between two iterations, and then nothing waited on it."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Serving:
    """A thread that maps, touches and unmaps 64 KiB once per millisecond, recording (start, seconds)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            region = mmap.mmap(-1, 64 << 10)
            for offset in range(0, 64 << 10, 4096):
                region[offset] = 1
            region.close()
            self.samples.append((started, time.monotonic() - started))
            time.sleep(0.001)

    def __enter__(self) -> Serving:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[float]:
        """The iterations that ran in ``[start, end)`` at least in part (one that waited on the grow too)."""
        return [seconds for started, seconds in self.samples if started < end and started + seconds > start]


def grow_while_serving(floor: int, step: int, idle_seconds: float) -> dict[str, Any]:
    pool = pinpool.PinnedPool(size=floor, reserve=floor + step, grow_step=step, runtime="mlock", registry=None)
    with pool, Serving() as serving:
        idle_start = time.monotonic()
        time.sleep(idle_seconds)
        grow_start = time.monotonic()
        pool.grow_sync(nbytes=step)
        grow_end = time.monotonic()
        assert pool.pinned_pages == pool.num_pages
    idle, growing = serving.between(idle_start, grow_start), serving.between(grow_start, grow_end)
    return {
        "grow_seconds": grow_end - grow_start,
        "idle_p99_ms": percentile(idle, 99) * 1e3,
        "grow_p99_ms": percentile(growing, 99) * 1e3,
        "grow_max_ms": max(growing, default=0.0) * 1e3,
        "samples": [len(idle), len(growing)],
    }


def back_after_pressure(floor: int, step: int) -> dict[str, Any]:
    pressure = FakePressure()
    grown: list[range] = []
    policy = pinpool.ElasticPolicy(floor=floor, step=step, shrink_interval_seconds=0.0, read_interval_seconds=0.05)
    pool = pinpool.PinnedPool(
        size=floor, reserve=floor + step, grow_step=step, runtime="mlock", registry=None, elastic=policy,
        on_give_up=lambda nbytes: list(grown), pressure=pressure,
    )  # fmt: skip
    with pool:
        grown.extend(pool.grow_sync(nbytes=step).pages)
        before = vm_locked()
        started = time.monotonic()
        pressure.set(FakePressure.reading(50.0))
        deadline = started + 30
        while vm_locked() > before - step and time.monotonic() < deadline:
            time.sleep(0.0005)
        seconds = time.monotonic() - started
        fell = before - vm_locked()
    return {"pressure_to_back_seconds": seconds, "vmlck_fell_bytes": fell}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floor", default="256MiB", help="the pool's floor, pinned at entry (default 256MiB)")
    parser.add_argument("--step", default="1GiB", help="the segment grown and given back (default 1GiB)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument("--json", help="write the runs and the summary here")
    args = parser.parse_args(argv)
    floor, step = pinpool.parse_size(args.floor), pinpool.parse_size(args.step)
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        grow = grow_while_serving(floor, step, args.idle_seconds)
        back = back_after_pressure(floor, step)
        runs.append(grow | back)
        print(
            f"rep {rep}: grow {grow['grow_seconds']:.2f} s, serving p99 {grow['grow_p99_ms']:.2f} ms vs idle "
            f"{grow['idle_p99_ms']:.2f} ms ({grow['grow_p99_ms'] / grow['idle_p99_ms']:.2f}x, max "
            f"{grow['grow_max_ms']:.2f} ms); pressure to {step // MiB} MiB back "
            f"{back['pressure_to_back_seconds']:.3f} s",
            flush=True,
        )
    ratios = [run["grow_p99_ms"] / run["idle_p99_ms"] for run in runs]
    summary = {
        "p99_ratio_median": statistics.median(ratios),
        "p99_ratios": ratios,
        "pressure_to_back_seconds_median": statistics.median(run["pressure_to_back_seconds"] for run in runs),
    }
    print(
        f"median: serving p99 during a {step // MiB} MiB grow {summary['p99_ratio_median']:.2f}x idle (goal <= 1.5x); "
        f"pressure to memory back {summary['pressure_to_back_seconds_median']:.3f} s (goal < 1 s)"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"runs": runs, "summary": summary, "floor": floor, "step": step}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
