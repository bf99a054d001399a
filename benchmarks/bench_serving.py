"""Serving while pinning: background pinning and the stall budget, measured in one run.

    python benchmarks/bench_serving.py                        # both parts, mlock, 3 reps (+1 warm-up)
    python benchmarks/bench_serving.py --reps 5 --json out.json --markdown out.md
    python benchmarks/bench_serving.py --parts first --extra-chunk-bytes 256MiB
    python benchmarks/bench_serving.py --help

Part 1, **first GiB usable vs full pin**: an 8 GiB ``PinnedPool(..., background=True)`` (Raw
layout) is entered with ``async with``; timed from just before entering until
``await pool.wait_ready(min_bytes=...)`` returns for half of ``--first-bytes`` and for all of it
(default 512 MiB and 1 GiB: the first shows whether the first two populate spans land together),
and until ``await pool.wait_ready()`` returns (the whole pool), in the same pool; with pinpool's
defaults and with a stall budget (``max_call_seconds``). A foreground pool (``async with``
returns once pinned) of the same size gives the reference full pin time.
``--extra-chunk-bytes`` adds background pools with a smaller ``chunk_bytes``, to show what the
chunk plan does to the first GiB.

Part 2, **the stall budget**: a "serving" thread maps a small anonymous region
(``mmap.mmap(-1, 64 KiB)``), writes one byte per 4 KiB page and unmaps it, once per millisecond,
while a 4 GiB pool pins on the same process (``with PinnedPool(...)``). Each iteration's latency
(mmap + touch + munmap) is recorded; those that started during the pin are reported as
p50/p99/max, with pinpool's defaults and with the budget, against the same thread with no pin
running at all (the floor). mmap and munmap take the process's ``mmap_lock`` for writing, which
every populate call (MADV_POPULATE_WRITE, reading) and lock call (mlock2, writing) holds, so the
thread waits behind the pool's longest call. The pool's longest call per op comes from
``pinpool_call_seconds_max`` in a fresh ``CollectorRegistry`` per pool (unregister: from
``pool.stats.longest_call_seconds``, since a closed pool's gauges are removed). Teardown (munlock of
each piece, then munmap of the pool) is reported apart.

Configurations run interleaved (A B C A B C ...) so machine noise hits all alike; the first
repetition warms fresh memory and is discarded. One pool exists at a time. Benchmark code,
not part of the package: pinpool's public API only.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import hashlib
import math
import mmap
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from bench_memory import PAGE_SIZE, format_bytes, machine, publish
from prometheus_client import CollectorRegistry

import pinpool

OPS = ("register", "populate", "unregister")


# -- helpers -------------------------------------------------------------------------------------


def vm_locked() -> int:
    """VmLck of this process, in bytes (what mlock charges; 0 once every pool is unpinned)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def smaps_locked() -> int:
    """Resident bytes in locked mappings of this process (/proc/self/smaps_rollup ``Locked:``)."""
    with open("/proc/self/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Locked:"):
                return int(line.split()[1]) * 1024
    return 0


def source_digest() -> str:
    """SHA-256 of pinpool's sources as imported (the tree may change between runs: say which one ran)."""
    digest = hashlib.sha256()
    root = Path(pinpool.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def call_max(registry: CollectorRegistry, name: str) -> dict[str, float | None]:
    """``pinpool_call_seconds_max`` by op, for the pool ``name`` (None: no call of that op)."""
    return {
        op: registry.get_sample_value("pinpool_call_seconds_max", {"pool": name, "runtime": "mlock", "op": op})
        for op in OPS
    }


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method (the value a fraction ``q`` stay at or below)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def med(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def spread(values: Sequence[float | None]) -> tuple[float, float] | None:
    present = [v for v in values if v is not None]
    return (min(present), max(present)) if present else None


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value * scale, spec)


def _range(values: Sequence[float | None], spec: str, scale: float = 1.0) -> str:
    r = spread(values)
    return "—" if r is None else f"{format(r[0] * scale, spec)}–{format(r[1] * scale, spec)}"


def _hi(bounds: tuple[float, float] | None, spec: str, scale: float = 1.0) -> str:
    return "—" if bounds is None else format(bounds[1] * scale, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"] + [f"| {' | '.join(row)} |" for row in rows]


# -- part 1: first GiB usable vs the full pin -----------------------------------------------------


@dataclass
class FirstConfig:
    name: str
    what: str
    options: dict[str, Any]
    background: bool
    samples: list[dict[str, Any]] = field(default_factory=list)


def first_configs(budget: float, extra_chunk_bytes: Sequence[int]) -> list[FirstConfig]:
    configs = [
        FirstConfig("background default", "background=True, no other option", {}, True),
        FirstConfig(
            f"background budget {budget:g}s",
            f"background=True, max_call_seconds={budget:g}",
            {"max_call_seconds": budget},
            True,
        ),
    ]
    configs.extend(
        FirstConfig(
            f"background chunks {format_bytes(chunk)}",
            f"background=True, chunk_bytes={format_bytes(chunk)}",
            {"chunk_bytes": chunk},
            True,
        )
        for chunk in extra_chunk_bytes
    )
    configs.append(FirstConfig("foreground default", "background=False (reference full pin)", {}, False))
    return configs


def run_first(config: FirstConfig, size: int, first_bytes: int, *, verify: bool) -> dict[str, Any]:
    """One pool of ``config``: seconds from entering to the first ``first_bytes`` usable and to ready."""
    registry = CollectorRegistry()
    name = "first"
    pool = pinpool.PinnedPool(
        size=size, runtime="mlock", background=config.background, registry=registry, name=name, **config.options
    )
    plan = {"chunks": len(pool.plan.chunks), "chunk_bytes": pool.plan.chunk_bytes, "span_bytes": pool._plan.span_bytes}

    async def body() -> dict[str, Any]:
        out: dict[str, Any] = {}
        started = time.perf_counter()
        async with pool:
            out["enter_s"] = time.perf_counter() - started
            if config.background:
                await pool.wait_ready(min_bytes=first_bytes // 2)
                out["half_s"] = time.perf_counter() - started
                await pool.wait_ready(min_bytes=first_bytes)
                out["first_s"] = time.perf_counter() - started
                out["first_pinned_pages"] = pool.pinned_pages
                if verify:  # warm-up only: smaps_rollup walks the page tables (and takes mmap_lock)
                    out["first_smaps_locked"] = smaps_locked()
                await pool.wait_ready()
            out["full_s"] = time.perf_counter() - started
            out["pin_seconds"] = pool.stats.pin_seconds
            out["state"] = pool.state.value
            out["call_max"] = call_max(registry, name)
        out["vm_locked_after_exit"] = vm_locked()
        return out

    result = anyio.run(body)
    result.update(plan)
    if not config.background:
        result["first_s"] = result["half_s"] = None
    return result


def first_rows(configs: Sequence[FirstConfig], size: int) -> list[dict[str, Any]]:
    foreground = [c for c in configs if not c.background]
    fg_full = med([s["full_s"] for s in foreground[0].samples]) if foreground else None
    rows = []
    for config in configs:
        samples = config.samples
        firsts = [s["first_s"] for s in samples]
        fulls = [s["full_s"] for s in samples]
        ratios = [s["first_s"] / s["full_s"] if s["first_s"] is not None else None for s in samples]
        first = med(firsts)
        rows.append({
            "config": config.name,
            "what": config.what,
            "chunks": samples[0]["chunks"],
            "chunk_bytes": samples[0]["chunk_bytes"],
            "span_bytes": samples[0]["span_bytes"],
            "enter_s_median": med([s["enter_s"] for s in samples]),
            "half_s_median": med([s["half_s"] for s in samples]),
            "half_s": [s["half_s"] for s in samples],
            "first_s_median": first,
            "first_s": firsts,
            "full_s_median": med(fulls),
            "full_s": fulls,
            "full_gbps_median": size / med(fulls) / 1e9,  # type: ignore[operator]
            "ratio_median": med(ratios),
            "ratio": ratios,
            "ratio_to_foreground": first / fg_full if first is not None and fg_full else None,
            "longest_call_s": {op: med([s["call_max"][op] for s in samples]) for op in OPS},
            "longest_call_s_max": {op: spread([s["call_max"][op] for s in samples]) for op in OPS},
        })  # fmt: skip
    return rows


# -- part 2: the serving thread and the stall budget -----------------------------------------------


class Server:
    """The "serving" thread: mmap + touch one byte per page + munmap, every ``period`` seconds."""

    def __init__(self, nbytes: int, period: float) -> None:
        self.nbytes = nbytes
        self.period = period
        self.samples: list[tuple[float, float]] = []  # (start, seconds) per iteration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving", daemon=True)

    def _run(self) -> None:
        nbytes, period, samples, stop = self.nbytes, self.period, self.samples, self._stop
        clock = time.perf_counter
        offsets = range(0, nbytes, PAGE_SIZE)
        due = clock()
        while not stop.is_set():
            t0 = clock()
            region = mmap.mmap(-1, nbytes)
            for offset in offsets:
                region[offset] = 1
            region.close()
            samples.append((t0, clock() - t0))
            due += period
            delay = due - clock()
            if delay > 0:
                time.sleep(delay)
            else:  # late (it waited behind something): the next iteration starts now, no burst
                due = clock()

    def __enter__(self) -> Server:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[float]:
        """Latencies of the iterations that started in ``[start, end)``."""
        return [seconds for t0, seconds in self.samples if start <= t0 < end]

    def arrivals(self, start: float, end: float) -> list[float]:
        """Response times of requests arriving once per period in ``[start, end)``, each served by
        the first iteration that starts at or after its arrival (waiting for the thread included:
        no coordinated omission, unlike per-iteration latencies, which a stall thins out)."""
        starts = [t0 for t0, _ in self.samples]
        out = []
        arrival = start
        while arrival < end:
            i = bisect.bisect_left(starts, arrival)
            if i == len(starts):
                break
            t0, seconds = self.samples[i]
            out.append(t0 + seconds - arrival)
            arrival += self.period
        return out


@dataclass
class StallConfig:
    name: str
    what: str
    options: dict[str, Any] | None  # None: no pin at all (the floor)
    samples: list[dict[str, Any]] = field(default_factory=list)


def stall_configs(budget: float) -> list[StallConfig]:
    return [
        StallConfig("no pin (floor)", "the serving thread alone, for as long as a pin takes", None),
        StallConfig("default", "no stall budget", {}),
        StallConfig(f"budget {budget:g}s", f"max_call_seconds={budget:g}", {"max_call_seconds": budget}),
    ]


def _latency_summary(
    latencies: Sequence[float], window_s: float, period: float, over: float, arrivals: Sequence[float] = ()
) -> dict[str, Any]:
    return {
        "arrival_p50_s": percentile(arrivals, 0.50),
        "arrival_p99_s": percentile(arrivals, 0.99),
        "iterations": len(latencies),
        "expected_iterations": int(window_s / period),
        "p50_s": percentile(latencies, 0.50),
        "p99_s": percentile(latencies, 0.99),
        "max_s": max(latencies) if latencies else math.nan,
        "over_limit": sum(1 for s in latencies if s > over),
    }


def run_stall(
    config: StallConfig, size: int, serve_bytes: int, period: float, floor_s: float, over: float
) -> dict[str, Any]:
    settle = 0.05  # the serving thread runs alone a moment before and after
    with Server(serve_bytes, period) as server:
        time.sleep(settle)
        if config.options is None:
            start = time.perf_counter()
            time.sleep(floor_s)
            end = time.perf_counter()
            result: dict[str, Any] = {"pin_s": None, "window_s": end - start}
            result["pin"] = _latency_summary(
                server.between(start, end), end - start, period, over, server.arrivals(start, end)
            )
            time.sleep(settle)
            return result
        registry = CollectorRegistry()
        name = "stall"
        pool = pinpool.PinnedPool(size=size, runtime="mlock", registry=registry, name=name, **config.options)
        start = time.perf_counter()
        pool.__enter__()
        end = time.perf_counter()
        try:
            pinned_max = call_max(registry, name)
            pin_seconds = pool.stats.pin_seconds
        finally:
            td_start = time.perf_counter()
            pool.__exit__(None, None, None)
            td_end = time.perf_counter()
        time.sleep(settle)
    longest = pool.stats.longest_call_seconds  # the gauge is gone once the pool closed
    return {
        "pin_s": pin_seconds,
        "window_s": end - start,
        "gbps": size / pin_seconds / 1e9,
        "pin": _latency_summary(server.between(start, end), end - start, period, over, server.arrivals(start, end)),
        "teardown": _latency_summary(server.between(td_start, td_end), td_end - td_start, period, over),
        "teardown_s": td_end - td_start,
        "call_max": {"register": pinned_max["register"], "populate": pinned_max["populate"],
                     "unregister": longest["unregister"]},
        "vm_locked_after_exit": vm_locked(),
    }  # fmt: skip


def stall_rows(configs: Sequence[StallConfig]) -> list[dict[str, Any]]:
    default = next((c for c in configs if c.options == {}), None)
    default_gbps = med([s["gbps"] for s in default.samples]) if default else None
    rows = []
    for config in configs:
        samples = config.samples
        pin = [s["pin"] for s in samples]
        gbps = [s.get("gbps") for s in samples]
        row: dict[str, Any] = {
            "config": config.name,
            "what": config.what,
            "iterations_median": med([p["iterations"] for p in pin]),
            "expected_iterations_median": med([p["expected_iterations"] for p in pin]),
            "p50_s_median": med([p["p50_s"] for p in pin]),
            "p50_s": [p["p50_s"] for p in pin],
            "p99_s_median": med([p["p99_s"] for p in pin]),
            "p99_s": [p["p99_s"] for p in pin],
            "max_s_median": med([p["max_s"] for p in pin]),
            "max_s": [p["max_s"] for p in pin],
            "over_limit_median": med([p["over_limit"] for p in pin]),
            "arrival_p50_s_median": med([p["arrival_p50_s"] for p in pin]),
            "arrival_p99_s_median": med([p["arrival_p99_s"] for p in pin]),
            "arrival_p99_s": [p["arrival_p99_s"] for p in pin],
            "gbps_median": med(gbps),
            "gbps": gbps,
            "gbps_vs_default": (med(gbps) / default_gbps) if med(gbps) is not None and default_gbps else None,  # type: ignore[operator]
        }
        if config.options is not None:
            row["longest_call_s"] = {op: med([s["call_max"][op] for s in samples]) for op in OPS}
            row["longest_call_s_max"] = {op: spread([s["call_max"][op] for s in samples]) for op in OPS}
            row["longest_call_s_all"] = {op: [s["call_max"][op] for s in samples] for op in OPS}
            row["teardown_s_median"] = med([s["teardown_s"] for s in samples])
            row["teardown_max_s_median"] = med([s["teardown"]["max_s"] for s in samples])
        rows.append(row)
    return rows


# -- the run ------------------------------------------------------------------------------------------


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Machine: {result['machine']}. Runtime `mlock`. {result['reps']} interleaved repetitions "
        f"(+1 warm-up discarded), medians with (min–max). Run {result['date']}, {result['seconds']:.0f} s, "
        f"pinpool sources {result['pinpool_source_sha256']}.",
    ]
    if result.get("first"):
        first = result["first"]
        lines += [
            "",
            f"**First {format_bytes(first['first_bytes'])} usable vs full pin**, {format_bytes(first['size'])} pool "
            "(Raw layout), seconds from just before `async with` until `await pool.wait_ready(min_bytes=...)` / "
            "`await pool.wait_ready()` returns (it polls every ≤ 20 ms):",
            "",
        ]
        lines += _table(
            ["configuration", "plan", f"first {format_bytes(first['first_bytes'] // 2)} s",
             f"first {format_bytes(first['first_bytes'])} s", "full s", "first / full (same pool)",
             "first / foreground full", "full GB/s", "longest call s, median (max): register / populate"],
            [[r["config"],
              f"{r['chunks']} × {format_bytes(r['chunk_bytes'])}, spans {format_bytes(r['span_bytes'])}",
              f"{_fmt(r['half_s_median'], '.3f')} ({_range(r['half_s'], '.3f')})" if r["half_s_median"] else "—",
              f"{_fmt(r['first_s_median'], '.3f')} ({_range(r['first_s'], '.3f')})" if r["first_s_median"] else "—",
              f"{_fmt(r['full_s_median'], '.3f')} ({_range(r['full_s'], '.3f')})",
              f"{_fmt(r['ratio_median'], '.1f', 100)} % ({_range(r['ratio'], '.1f', 100)})"
              if r["ratio_median"] is not None else "—",
              _fmt(r["ratio_to_foreground"], ".1f", 100) + (" %" if r["ratio_to_foreground"] is not None else ""),
              f"{r['full_gbps_median']:.2f}",
              " / ".join(f"{_fmt(r['longest_call_s'][op], '.3f')} ({_hi(r['longest_call_s_max'][op], '.3f')})"
                         for op in ("register", "populate"))]
             for r in first["rows"]],
        )  # fmt: skip
    if result.get("stall"):
        stall = result["stall"]
        lines += [
            "",
            f"**Stall budget**: a serving thread doing mmap + touch ({format_bytes(stall['serve_bytes'])}, one byte "
            f"per page) + munmap every {stall['period_s'] * 1e3:g} ms while a {format_bytes(stall['size'])} pool "
            "pins (`with`); latency of the iterations that started during the pin, ms; "
            f'"> {stall["over_s"] * 1e3:g} ms" counts iterations above 1.5 × the budget. A stalled iteration '
            'also delays the ones due after it (they are never issued): "per-arrival" counts a request due every '
            "period, served by the next iteration to start, waiting included:",
            "",
        ]
        lines += _table(
            ["configuration", "iterations (of ~expected)", "p50 ms", "p99 ms", "max ms",
             f"> {stall['over_s'] * 1e3:g} ms", "pin GB/s", "GB/s vs default",
             "per-arrival p50 / p99 ms", "longest call ms, median (max): register / populate / unregister"],
            [[r["config"],
              f"{_fmt(r['iterations_median'], '.0f')} (~{_fmt(r['expected_iterations_median'], '.0f')})",
              f"{_fmt(r['p50_s_median'], '.3f', 1e3)} ({_range(r['p50_s'], '.3f', 1e3)})",
              f"{_fmt(r['p99_s_median'], '.1f', 1e3)} ({_range(r['p99_s'], '.1f', 1e3)})",
              f"{_fmt(r['max_s_median'], '.1f', 1e3)} ({_range(r['max_s'], '.1f', 1e3)})",
              _fmt(r["over_limit_median"], ".0f"),
              f"{_fmt(r['gbps_median'], '.2f')} ({_range(r['gbps'], '.2f')})" if r["gbps_median"] else "—",
              _fmt(r["gbps_vs_default"], ".2f") + ("×" if r["gbps_vs_default"] is not None else ""),
              f"{_fmt(r['arrival_p50_s_median'], '.1f', 1e3)} / {_fmt(r['arrival_p99_s_median'], '.1f', 1e3)} "
              f"({_range(r['arrival_p99_s'], '.1f', 1e3)})",
              " / ".join(f"{_fmt(r['longest_call_s'][op], '.1f', 1e3)} ({_hi(r['longest_call_s_max'][op], '.1f', 1e3)})"
                         for op in OPS) if "longest_call_s" in r else "—"]
             for r in stall["rows"]],
        )  # fmt: skip
        teardown = [r for r in stall["rows"] if "teardown_s_median" in r]
        if teardown:
            lines += [
                "",
                "Teardown (munlock on the unpin workers, then munmap): "
                + "; ".join(
                    f"{r['config']}: {_fmt(r['teardown_s_median'], '.3f')} s, serving max "
                    f"{_fmt(r['teardown_max_s_median'], '.1f', 1e3)} ms"
                    for r in teardown
                )
                + ".",
            ]
    if result.get("leaks"):
        lines += ["", f"**VmLck was not 0 after exit** in {len(result['leaks'])} pools: {result['leaks']}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_serving.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="first,stall", help="which parts: first, stall (default both)")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions (+1 warm-up, discarded)")
    parser.add_argument("--budget", type=float, default=0.02, help="max_call_seconds of the budget rows (0.02)")
    parser.add_argument("--first-size", default="8GiB", help="part 1 pool size (default 8GiB)")
    parser.add_argument("--first-bytes", default="1GiB", help="part 1 prefix to wait for (default 1GiB)")
    parser.add_argument(
        "--extra-chunk-bytes", default="", help="part 1: also background pools with these chunk_bytes (comma-separated)"
    )
    parser.add_argument("--stall-size", default="4GiB", help="part 2 pool size (default 4GiB)")
    parser.add_argument("--serve-bytes", default="64KiB", help="part 2: the serving thread's mapping (64KiB)")
    parser.add_argument("--period-ms", type=float, default=1.0, help="part 2: serving period in ms (1)")
    parser.add_argument("--json", default=None, help="write every sample and the summaries as JSON here")
    parser.add_argument("--markdown", default=None, help="write the markdown tables here")
    parser.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= {"first", "stall"}:
        raise SystemExit(f"--parts: unknown {sorted(parts - {'first', 'stall'})}")
    reps = max(1, args.reps)
    started = time.perf_counter()

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"bench: {line}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "reps": reps,
        "pinpool_source_sha256": source_digest(),
        "leaks": [],
    }
    progress(result["machine"])
    if "first" in parts:
        size = pinpool.parse_size(args.first_size, what="--first-size")
        first_bytes = pinpool.parse_size(args.first_bytes, what="--first-bytes")
        extra = [pinpool.parse_size(s, what="--extra-chunk-bytes") for s in args.extra_chunk_bytes.split(",") if s]
        configs = first_configs(args.budget, extra)
        for rep in range(reps + 1):
            for config in configs:
                gc.collect()
                sample = run_first(config, size, first_bytes, verify=rep == 0)
                if sample["vm_locked_after_exit"]:
                    result["leaks"].append((config.name, rep, sample["vm_locked_after_exit"]))
                first = (
                    ""
                    if sample["first_s"] is None
                    else f"half {sample['half_s']:.3f} s, first {sample['first_s']:.3f} s, "
                )
                checked = (
                    f", smaps Locked at first {format_bytes(sample['first_smaps_locked'])}"
                    if "first_smaps_locked" in sample
                    else ""
                )
                progress(
                    f"first rep {rep}{' (warm-up)' if rep == 0 else ''} {config.name}: {first}"
                    f"full {sample['full_s']:.3f} s (enter {sample['enter_s']:.3f} s){checked}"
                )
                if rep:
                    config.samples.append(sample)
        result["first"] = {"size": size, "first_bytes": first_bytes, "rows": first_rows(configs, size),
                           "samples": {c.name: c.samples for c in configs}}  # fmt: skip
    if "stall" in parts:
        size = pinpool.parse_size(args.stall_size, what="--stall-size")
        serve_bytes = pinpool.parse_size(args.serve_bytes, what="--serve-bytes")
        period = args.period_ms / 1e3
        over = 1.5 * args.budget
        stalls = stall_configs(args.budget)
        windows: list[float] = []
        for rep in range(reps + 1):
            for stall_config in stalls:
                gc.collect()
                floor_s = statistics.median(windows) if windows else 1.5
                sample = run_stall(stall_config, size, serve_bytes, period, floor_s, over)
                if sample.get("vm_locked_after_exit"):
                    result["leaks"].append((stall_config.name, rep, sample["vm_locked_after_exit"]))
                if sample["pin_s"] is not None:
                    windows.append(sample["window_s"])
                pin = sample["pin"]
                rate = f", {sample['gbps']:.2f} GB/s" if sample.get("gbps") else ""
                calls = (
                    ", longest " + " ".join(f"{op} {_fmt(v, '.1f', 1e3)} ms" for op, v in sample["call_max"].items())
                    if "call_max" in sample
                    else ""
                )
                progress(
                    f"stall rep {rep}{' (warm-up)' if rep == 0 else ''} {stall_config.name}: "
                    f"{pin['iterations']} iterations, "
                    f"p50 {pin['p50_s'] * 1e3:.3f} ms, p99 {pin['p99_s'] * 1e3:.1f} ms, "
                    f"max {pin['max_s'] * 1e3:.1f} ms{rate}{calls}"
                )
                if rep:
                    stall_config.samples.append(sample)
        result["stall"] = {"size": size, "serve_bytes": serve_bytes, "period_s": period, "budget_s": args.budget,
                           "over_s": over, "rows": stall_rows(stalls),
                           "samples": {c.name: c.samples for c in stalls}}  # fmt: skip
    result["seconds"] = time.perf_counter() - started
    text = markdown(result)
    publish(text, result, json_path=args.json, markdown_path=args.markdown)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except pinpool.PinpoolError as exc:
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
