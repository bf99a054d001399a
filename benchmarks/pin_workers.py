"""Pin throughput by worker count, and orchestration overhead per chunk, measured in one run.

    ./dev bench                       # 4 GiB, mlock, 5 repetitions (+1 warm-up, discarded)
    ./dev bench --size 8GiB --reps 7 --json out.json

Configurations run interleaved (A B C A B C ...) so machine noise hits all of them alike;
the report gives medians, spread (min-max) and ratios against the 1-worker baseline of the
same run. The overhead part pins N chunks with a zero-delay FakeRuntime and compares the
pool's wall time per chunk with a bare Python loop making the same register/unregister calls.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import anyio

import pinpool
from pinpool import _libc
from pinpool._units import format_bytes, parse_size
from pinpool.testing import FakeRuntime


def _pin_once(size: int, runtime: str, workers: int | None, chunk_bytes: int | None) -> dict[str, float]:
    pool = pinpool.PinnedPool(size=size, runtime=runtime, max_workers=workers, chunk_bytes=chunk_bytes, name="bench")
    with pool:
        pass
    return {
        "pin_s": pool.pin_seconds,
        "unpin_s": pool.unpin_seconds,
        "chunks": len(pool.chunks),
        "workers": pool.workers,
    }


def throughput(size: int, runtime: str, reps: int) -> list[dict[str, Any]]:
    configs: list[tuple[str, int | None, int | None]] = [
        ("1 worker, default chunking", 1, None),
        ("1 worker, 1 GiB chunks", 1, 1 << 30),
        ("default workers", None, None),
    ]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in configs}
    for rep in range(reps + 1):  # repetition 0 warms fresh guest memory and is discarded
        for name, workers, chunk in configs:
            gc.collect()
            result = _pin_once(size, runtime, workers, chunk)
            if rep:
                samples[name].append(result)
    base = statistics.median(size / s["pin_s"] / 1e9 for s in samples[configs[0][0]])
    rows = []
    for name, _, _ in configs:
        rates = [size / s["pin_s"] / 1e9 for s in samples[name]]
        unpin = [size / s["unpin_s"] / 1e9 for s in samples[name]]
        rows.append({
            "config": name,
            "workers": int(samples[name][0]["workers"]),
            "chunks": int(samples[name][0]["chunks"]),
            "pin_gbps_median": statistics.median(rates),
            "pin_gbps_min": min(rates),
            "pin_gbps_max": max(rates),
            "ratio_to_1_worker": statistics.median(rates) / base,
            "unpin_gbps_median": statistics.median(unpin),
        })  # fmt: skip
    return rows


def overhead(nchunks: int, reps: int) -> dict[str, float]:
    page = _libc.PAGE_SIZE
    size = nchunks * page

    def bare() -> float:
        fake = FakeRuntime()
        mapping = pinpool._memory.HostMapping(size)
        started = time.perf_counter()
        for offset in range(0, size, page):
            fake.register(mapping.address + offset, page)
        for offset in range(size - page, -1, -page):
            fake.unregister(mapping.address + offset)
        return time.perf_counter() - started

    def pool_sync() -> float:
        started = time.perf_counter()
        with pinpool.PinnedPool(size=size, chunk_bytes=page, runtime=FakeRuntime(), max_workers=1):
            pass
        return time.perf_counter() - started

    def pool_async() -> float:
        async def run() -> float:
            started = time.perf_counter()
            async with pinpool.PinnedPool(size=size, chunk_bytes=page, runtime=FakeRuntime(), max_workers=1):
                pass
            return time.perf_counter() - started

        return anyio.run(run)

    runs: dict[str, list[float]] = {"bare": [], "sync": [], "async": []}
    fns: dict[str, Callable[[], float]] = {"bare": bare, "sync": pool_sync, "async": pool_async}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            gc.collect()
            seconds = fn()
            if rep:
                runs[name].append(seconds)
    med = {name: statistics.median(values) for name, values in runs.items()}
    return {
        "chunks": nchunks,
        "bare_us_per_chunk": med["bare"] / nchunks * 1e6,
        "sync_us_per_chunk": med["sync"] / nchunks * 1e6,
        "async_us_per_chunk": med["async"] / nchunks * 1e6,
        "sync_overhead_us_per_chunk": (med["sync"] - med["bare"]) / nchunks * 1e6,
        "async_overhead_us_per_chunk": (med["async"] - med["bare"]) / nchunks * 1e6,
    }


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpus = len(os.sched_getaffinity(0))
    return (
        f"{platform.machine()}, {cpus} CPUs, {format_bytes(mem)} RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, THP {_libc.transparent_huge_pages_mode()}"
    )


def markdown(size: int, runtime: str, reps: int, rows: list[dict[str, Any]], over: dict[str, float]) -> str:
    lines = [
        f"Machine: {machine()}. Runtime `{runtime}`, pool {format_bytes(size)}, {reps} interleaved repetitions "
        "(+1 warm-up discarded), medians.",
        "",
        "| configuration | workers | chunks | pin GB/s median | min–max | ratio to 1 worker | unpin GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {r['config']} | {r['workers']} | {r['chunks']} | {r['pin_gbps_median']:.2f} | "
        f"{r['pin_gbps_min']:.2f}–{r['pin_gbps_max']:.2f} | {r['ratio_to_1_worker']:.2f}× | "
        f"{r['unpin_gbps_median']:.1f} |"
        for r in rows
    )
    lines += [
        "",
        f"Orchestration overhead, zero-delay FakeRuntime, {over['chunks']:,} chunks, 1 worker:",
        "",
        "| driver | µs per chunk (pin + unpin) | overhead vs bare loop |",
        "|---|---|---|",
        f"| bare Python loop | {over['bare_us_per_chunk']:.2f} | — |",
        f"| `with PinnedPool` | {over['sync_us_per_chunk']:.2f} | {over['sync_overhead_us_per_chunk']:+.2f} µs |",
        f"| `async with PinnedPool` | {over['async_us_per_chunk']:.2f} | "
        f"{over['async_overhead_us_per_chunk']:+.2f} µs |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="4GiB")
    parser.add_argument("--runtime", default="mlock", choices=["mlock", "cuda", "auto"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=10_000, help="chunks for the overhead measurement")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    rows = throughput(size, args.runtime, args.reps)
    over = overhead(args.chunks, args.reps)
    print(markdown(size, args.runtime, args.reps, rows, over))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine(), "size": size, "runtime": args.runtime, "throughput": rows,
                       "overhead": over}, out, indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
