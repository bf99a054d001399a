"""Pin throughput against the field's baselines, measured in one run (``./dev bench``).

    ./dev bench                                     # 4 GiB, auto runtime, 5 reps (+1 warm-up)
    ./dev bench --runtime cuda --size 64GiB --reps 3 --json out.json --markdown out.md
    ./dev bench --write-docs docs/performance.md    # replace the results block there
    python benchmarks/pin_throughput.py --help      # the same, with any Python that has pinpool

Every configuration pins fresh memory of the same size; configurations run interleaved
(A B C A B C ...) so machine noise hits all alike, and the first repetition only warms the
memory and is discarded. Reported: median GB/s with spread (min-max), the ratio of pinpool's
default to each configuration, teardown time, the longest single registration call (the
stall a serving process sees), orchestration overhead per chunk against a bare loop, and
peak RSS beyond the pool.

This is benchmark code, not part of the package: it uses pinpool's public API only, and the
stdlib (mmap, ctypes) for the baselines' raw memory.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from bench_memory import (
    FIRST_TOUCH,
    PAGE_SIZE,
    AnonymousMemory,
    available_cpus,
    first_touch,
    format_bytes,
    machine,
    parallel,
    publish,
    spans,
    transparent_huge_pages_mode,
)
from bench_runtime import TimedRuntime

import pinpool
from pinpool.runtimes import resolve_runtime, runtime_choices
from pinpool.testing import FakeRuntime

DOCS_START = "<!-- bench:start -->"
DOCS_END = "<!-- bench:end -->"


@dataclass
class Sample:
    pin_s: float
    unpin_s: float | None
    longest_call_s: float | None


@dataclass
class Config:
    name: str
    what: str
    run: Callable[[], Sample]
    samples: list[Sample] = field(default_factory=list)


class Bench:
    def __init__(self, size: int, runtime: str, reps: int, huge_pages: bool, only: Sequence[str] = ()) -> None:
        self.size = size
        self.runtime_name = runtime
        self.reps = reps
        self.cpus = available_cpus()
        probe = pinpool.PinnedPool(size=size, runtime=runtime, registry=None)  # planned, never entered
        self.runtime_kind = probe.runtime.name
        self.default_chunks = probe.plan.chunks
        self.default_description = (
            f"{len(probe.plan.chunks)} chunks of <= {format_bytes(probe.plan.chunk_bytes)}, "
            f"order {probe.plan.order.value}, "
            f"{probe.plan.populate_workers} populate + {probe.plan.register_workers} register threads, "
            f"{probe.plan.unpin_workers} unpin threads"
        )
        self.configs = self._configs(huge_pages)
        if only:
            unknown = set(only) - {c.name for c in self.configs}
            if unknown:
                raise SystemExit(f"--configs: unknown {sorted(unknown)}; known: {[c.name for c in self.configs]}")
            # pinpool default stays first: every ratio is against it
            self.configs = [c for c in self.configs if c.name == "pinpool default" or c.name in only]

    def _runtime(self) -> TimedRuntime:
        return TimedRuntime(resolve_runtime(self.runtime_name))

    def _raw(self, pin: Callable[[TimedRuntime, int], list[int]], *, lock: bool = True) -> Callable[[], Sample]:
        """A baseline on fresh memory: ``pin`` returns the bases to unregister (in order)."""

        def run() -> Sample:
            runtime = self._runtime()
            with AnonymousMemory(self.size) as memory:
                started = time.perf_counter()
                bases = pin(runtime, memory.address)
                pin_s = time.perf_counter() - started
                started = time.perf_counter()
                for base in bases:
                    runtime.unregister(base)
                unpin_s = time.perf_counter() - started if lock else None
            longest = max(runtime.register_seconds) if runtime.register_seconds else None
            return Sample(pin_s, unpin_s, longest)

        return run

    def _pool(self, **options: Any) -> Callable[[], Sample]:
        def run() -> Sample:
            runtime = self._runtime()
            pool = pinpool.PinnedPool(size=self.size, runtime=runtime, registry=None, name="bench", **options)
            with pool:
                pass
            return Sample(pool.stats.pin_seconds, pool.stats.unpin_seconds, max(runtime.register_seconds))

        return run

    def _configs(self, huge_pages: bool) -> list[Config]:
        size, cpus, chunks = self.size, self.cpus, self.default_chunks

        def sequential(runtime: TimedRuntime, base: int) -> list[int]:
            for chunk in chunks:
                runtime.register(base + chunk.offset, chunk.nbytes)
            return [base + c.offset for c in reversed(chunks)]

        def single(runtime: TimedRuntime, base: int) -> list[int]:
            runtime.register(base, size)
            return [base]

        def fault_then_register(runtime: TimedRuntime, base: int) -> list[int]:
            parallel(first_touch, spans(base, size), cpus)
            runtime.register(base, size)
            return [base]

        def limit(runtime: TimedRuntime, base: int) -> list[int]:
            parallel(first_touch, spans(base, size), cpus)
            return []

        configs = [
            Config("pinpool default", self.default_description, self._pool()),
            Config(
                "sequential",
                f"reference: the same {len(chunks)} chunks on one thread, no pre-fault",
                self._raw(sequential),
            ),
            Config("single call", "one registration of the whole buffer", self._raw(single)),
            Config(
                "fault-then-register",
                f"{FIRST_TOUCH} on {cpus} threads, then one registration",
                self._raw(fault_then_register),
            ),
        ]
        if huge_pages and transparent_huge_pages_mode() in ("always", "madvise"):
            configs.append(Config("pinpool huge pages", "huge_pages=True (THP)", self._pool(huge_pages=True)))
            # Right after another THP pin: on VMs whose host reclaims freed guest memory, the
            # first touch after 4 KiB runs pays the host's faults; this shows the difference.
            configs.append(
                Config(
                    "pinpool huge pages, again",
                    "the same, right after the previous row (memory its pin just freed)",
                    self._pool(huge_pages=True),
                )
            )
        configs.append(
            Config(
                "limit",
                f"first touch on {cpus} threads, no locking (the page-fault bound)",
                self._raw(limit, lock=False),
            )
        )
        if self.runtime_kind == "cuda":
            configs += [
                Config("torch pin_memory", "torch.empty(pin_memory=True) (cudaHostAlloc)", _torch_child(size, None)),
                Config(
                    "torch host_register x8",
                    "PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
                    _torch_child(size, "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"),
                ),
            ]
        return configs

    def run(self, progress: Callable[[str], None]) -> None:
        for rep in range(self.reps + 1):  # repetition 0 warms fresh memory and is discarded
            for config in self.configs:
                gc.collect()
                sample = config.run()
                gbps = self.size / sample.pin_s / 1e9
                progress(f"rep {rep}{' (warm-up)' if rep == 0 else ''} {config.name}: {gbps:.2f} GB/s")
                if rep:
                    config.samples.append(sample)

    def rows(self) -> list[dict[str, Any]]:
        default = statistics.median(s.pin_s for s in self.configs[0].samples)
        rows = []
        for config in self.configs:
            rates = [self.size / s.pin_s / 1e9 for s in config.samples]
            unpins = [s.unpin_s for s in config.samples if s.unpin_s is not None]
            stalls = [s.longest_call_s for s in config.samples if s.longest_call_s is not None]
            pin_s = statistics.median(s.pin_s for s in config.samples)
            rows.append({
                "config": config.name,
                "what": config.what,
                "pin_s_median": pin_s,
                "pin_gbps_median": statistics.median(rates),
                "pin_gbps_min": min(rates),
                "pin_gbps_max": max(rates),
                "pinpool_speedup": pin_s / default,
                "unpin_s_median": statistics.median(unpins) if unpins else None,
                "unpin_gbps_median": self.size / statistics.median(unpins) / 1e9 if unpins else None,
                "longest_call_s_median": statistics.median(stalls) if stalls else None,
            })  # fmt: skip
        return rows


def _torch_child(size: int, alloc_conf: str | None) -> Callable[[], Sample]:
    """PyTorch's own pinned allocation, timed inside a fresh process (its allocator config is global)."""
    code = (
        "import time, torch\n"
        "torch.cuda.init()\n"
        "t0 = time.perf_counter()\n"
        f"x = torch.empty({size}, dtype=torch.uint8, pin_memory=True)\n"
        "t1 = time.perf_counter()\n"
        "del x\n"
        "torch._C._host_emptyCache()\n"
        "print(t1 - t0, time.perf_counter() - t1)\n"
    )

    def run() -> Sample:
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if alloc_conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        pin_s, unpin_s = (float(x) for x in out.stdout.split()[-2:])
        return Sample(pin_s, unpin_s, None)

    return run


def stalls(size: int, runtime: str, chunk_sizes: Sequence[int]) -> list[dict[str, Any]]:
    """The longest single registration call, per chunk size, pinning with pinpool's defaults."""
    rows = []
    for chunk_bytes in chunk_sizes:
        if chunk_bytes > size:
            continue
        timed = TimedRuntime(resolve_runtime(runtime))
        pool = pinpool.PinnedPool(size=size, runtime=timed, chunk_bytes=chunk_bytes, registry=None, name="bench")
        with pool:
            pass
        rows.append({
            "chunk_bytes": pool.plan.chunk_bytes,
            "chunks": len(pool.plan.chunks),
            "longest_register_s": max(timed.register_seconds),
            "median_register_s": statistics.median(timed.register_seconds),
            "pin_gbps": size / pool.stats.pin_seconds / 1e9,
        })  # fmt: skip
    return rows


def overhead(nchunks: int, reps: int) -> dict[str, Any]:
    """pinpool's per-chunk cost over a bare loop making the same FakeRuntime calls (zero delay)."""
    page = PAGE_SIZE
    size = nchunks * page

    def bare() -> float:
        fake = FakeRuntime()
        with AnonymousMemory(size) as memory:  # never touched: the fake registers nothing
            base = memory.address
            started = time.perf_counter()
            for offset in range(0, size, page):
                fake.populate(base + offset, page)
                fake.register(base + offset, page)
            for offset in range(size - page, -1, -page):
                fake.unregister(base + offset)
            return time.perf_counter() - started

    def pool_sync() -> float:
        started = time.perf_counter()
        with pinpool.PinnedPool(size=size, chunk_bytes=page, runtime=FakeRuntime(), registry=None):
            pass
        return time.perf_counter() - started

    def pool_async() -> float:
        async def run() -> float:
            started = time.perf_counter()
            async with pinpool.PinnedPool(size=size, chunk_bytes=page, runtime=FakeRuntime(), registry=None):
                pass
            return time.perf_counter() - started

        return anyio.run(run)

    fns: dict[str, Callable[[], float]] = {"bare": bare, "sync": pool_sync, "async": pool_async}
    runs: dict[str, list[float]] = {name: [] for name in fns}
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


_RSS_CHILD = """
import json, sys
import pinpool
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
size, runtime = int(sys.argv[1]), sys.argv[2]
pool = pinpool.PinnedPool(size=size, runtime=runtime, registry=None)
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM: measure the pinning, not the imports
before = status("VmRSS")
with pool:
    pass
print(json.dumps({"rss_before": before, "hwm": status("VmHWM"), "pool": pool.nbytes}))
"""


def peak_rss(size: int, runtime: str) -> dict[str, int]:
    """Peak RSS of a fresh process while it pins, beyond the pool itself and what it had before."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(size), runtime], capture_output=True, text=True, check=True
    )
    data: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    data["beyond_pool"] = data["hwm"] - data["rss_before"] - data["pool"]
    return data


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"] + [f"| {' | '.join(row)} |" for row in rows]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Machine: {result['machine']}. Runtime `{result['runtime']}`, pool {format_bytes(result['size'])}, "
        f"{result['reps']} interleaved repetitions (+1 warm-up discarded), medians. "
        f"Run {result['date']}, {result['seconds']:.0f} s.",
        "",
    ]
    lines += _table(
        ["configuration", "what", "pin GB/s median", "min–max", "pinpool default is × faster", "teardown s",
         "teardown GB/s", "longest call s"],
        [[r["config"], r["what"], f"{r['pin_gbps_median']:.2f}", f"{r['pin_gbps_min']:.2f}–{r['pin_gbps_max']:.2f}",
          f"{r['pinpool_speedup']:.2f}×", _fmt(r["unpin_s_median"], ".3f"), _fmt(r["unpin_gbps_median"], ".1f"),
          _fmt(r["longest_call_s_median"], ".3f")] for r in result["throughput"]],
    )  # fmt: skip
    if result.get("stalls"):
        lines += ["", "Longest single registration call (the stall a serving process sees), pinpool defaults per "
                  "chunk size:", ""]  # fmt: skip
        lines += _table(
            ["chunk size", "chunks", "longest call s", "median call s", "pin GB/s"],
            [[format_bytes(s["chunk_bytes"]), str(s["chunks"]), f"{s['longest_register_s']:.3f}",
              f"{s['median_register_s']:.4f}", f"{s['pin_gbps']:.2f}"] for s in result["stalls"]],
        )  # fmt: skip
    if result.get("overhead"):
        lines += ["", "Orchestration overhead, zero-delay FakeRuntime, default workers, one 4 KiB chunk per call, "
                  "against a bare Python loop making the same populate/register/unregister calls:", ""]  # fmt: skip
        lines += _table(
            ["chunks", "bare loop µs/chunk", "`with` µs/chunk", "`async with` µs/chunk", "overhead `with`",
             "overhead `async with`"],
            [[f"{o['chunks']:,}", f"{o['bare_us_per_chunk']:.2f}", f"{o['sync_us_per_chunk']:.2f}",
              f"{o['async_us_per_chunk']:.2f}", f"{o['sync_overhead_us_per_chunk']:+.2f} µs",
              f"{o['async_overhead_us_per_chunk']:+.2f} µs"] for o in result["overhead"]],
        )  # fmt: skip
    if result.get("rss"):
        rss = result["rss"]
        lines += [
            "",
            f"Peak RSS of a process pinning {format_bytes(rss['pool'])} with the defaults: VmHWM "
            f"{format_bytes(rss['hwm'])}, of which {format_bytes(rss['rss_before'])} before pinning and "
            f"{format_bytes(rss['pool'])} the pool: **{format_bytes(max(0, rss['beyond_pool']))} beyond the pool**.",
        ]
    return "\n".join(lines)


def write_docs(path: str, text: str) -> None:
    with open(path) as f:
        doc = f.read()
    start, end = doc.find(DOCS_START), doc.find(DOCS_END)
    if start < 0 or end < start:
        raise SystemExit(f"{path} has no {DOCS_START} ... {DOCS_END} block to replace")
    doc = doc[: start + len(DOCS_START)] + "\n" + text + "\n" + doc[end:]
    with open(path, "w") as f:
        f.write(doc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="./dev bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="4GiB", help="pool size (default 4GiB)")
    parser.add_argument("--runtime", default="auto", choices=runtime_choices(), help="default: auto")
    parser.add_argument("--reps", type=int, default=5, help="measured repetitions (+1 warm-up, discarded)")
    parser.add_argument("--no-huge-pages", action="store_true", help="skip the huge-page configuration")
    parser.add_argument(
        "--configs", default="", help="only these configurations (comma-separated names; pinpool default always runs)"
    )
    parser.add_argument(
        "--stall-chunk-sizes", default="256MiB,1GiB,4GiB", help="chunk sizes for the longest-call table ('' skips it)"
    )
    parser.add_argument(
        "--overhead-chunks", default="1000,10000,100000", help="chunk counts for the overhead table ('' skips it)"
    )
    parser.add_argument("--overhead-reps", type=int, default=3)
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS measurement")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="write the markdown tables here")
    parser.add_argument("--write-docs", default=None, help="replace the results block of this markdown file")
    parser.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    size = pinpool.parse_size(args.size, what="--size")
    chunk_sizes = [pinpool.parse_size(s, what="--stall-chunk-sizes") for s in args.stall_chunk_sizes.split(",") if s]
    counts = [int(n) for n in args.overhead_chunks.split(",") if n]
    started = time.perf_counter()
    only = [name.strip() for name in args.configs.split(",") if name.strip()]
    bench = Bench(size, args.runtime, max(1, args.reps), huge_pages=not args.no_huge_pages, only=only)

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"bench: {line}", file=sys.stderr, flush=True)

    progress(f"{machine()}; runtime {bench.runtime_kind}; pinpool default: {bench.default_description}")
    bench.run(progress)
    result: dict[str, Any] = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "runtime": bench.runtime_kind,
        "size": size,
        "reps": bench.reps,
        "throughput": bench.rows(),
    }
    progress("longest registration call per chunk size")
    result["stalls"] = stalls(size, args.runtime, chunk_sizes)
    result["overhead"] = []
    for count in counts:
        progress(f"overhead at {count:,} chunks")
        result["overhead"].append(overhead(count, max(1, args.overhead_reps)))
    if not args.no_rss:
        progress("peak RSS")
        result["rss"] = peak_rss(size, args.runtime)
    result["seconds"] = time.perf_counter() - started
    text = markdown(result)
    publish(text, result, json_path=args.json, markdown_path=args.markdown)
    if args.write_docs:
        write_docs(args.write_docs, text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except pinpool.PinpoolError as exc:  # bad options, no CUDA device, a failed pin: one line, not a traceback
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
