"""Elastic pools (issue 36): growing while a serving thread runs, and memory back after a pressure signal.

    python benchmarks/bench_elastic.py                     # 1 GiB segments, mlock, 3 reps
    python benchmarks/bench_elastic.py --step 512MiB --reps 5 --json out.json

Part 1, **growing while serving**: an elastic pool (``size=`` a 256 MiB floor, ``reserve=`` floor + step,
``grow_step=`` step, mlock) is open; bench_serving.py's "serving" thread maps a small anonymous region
(``mmap.mmap(-1, 64 KiB)``), writes one byte per 4 KiB page and unmaps it, once per millisecond (its part
2: mmap and munmap wait behind the pool's mmap_lock-holding calls). Its latencies are recorded for
``--idle-seconds`` with the pool idle, then while ``pool.grow_sync()`` pins one segment of ``--step``;
reported as p99 (and max) during the grow against idle, per rep.

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
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench_serving import Server, percentile, vm_locked

import pinpool
from pinpool.testing import FakePressure

MiB = 1 << 20


def overlapping(server: Server, start: float, end: float) -> list[float]:
    """The iterations that ran in ``[start, end)`` at least in part (one that waited on the grow too)."""
    return [seconds for started, seconds in server.samples if started < end and started + seconds > start]


def p99_ms(values: list[float]) -> float:
    """0.0 for no value: a grow can end between two iterations, and then nothing waited on it."""
    return percentile(values, 0.99) * 1e3 if values else 0.0


def grow_while_serving(floor: int, step: int, idle_seconds: float) -> dict[str, Any]:
    pool = pinpool.PinnedPool(size=floor, reserve=floor + step, grow_step=step, runtime="mlock", registry=None)
    with pool, Server(64 << 10, 0.001) as serving:
        idle_start = time.perf_counter()  # the serving thread's clock
        time.sleep(idle_seconds)
        grow_start = time.perf_counter()
        pool.grow_sync(nbytes=step)
        grow_end = time.perf_counter()
        assert pool.pinned_pages == pool.num_pages
    idle, growing = overlapping(serving, idle_start, grow_start), overlapping(serving, grow_start, grow_end)
    return {
        "grow_seconds": grow_end - grow_start,
        "idle_p99_ms": p99_ms(idle),
        "grow_p99_ms": p99_ms(growing),
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
