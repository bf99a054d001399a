"""Transfer registrars: is an engine's registration hidden under pinning? And do engines read pinpool's
pages as fast as a plain buffer?

    python benchmarks/bench_registrars.py                      # 2 GiB, 3 reps, stand-ins at 0.1 and 1.0 s/GiB
    python benchmarks/bench_registrars.py --size 4GiB --reps 5 --seconds-per-gib 0.1 0.5
    python benchmarks/bench_registrars.py --engines            # also the real engines' read throughput
    python benchmarks/bench_registrars.py --json out.json --markdown out.md

**Overlap.** A timed stand-in registrar costs what ``ibv_reg_mr`` costs per GiB (the field: 500 GB
registered sequentially in 49.2 s, about 0.1 s/GiB, kvcache-ai/Mooncake#855; with its pages faulted
first, 50 GB in about a minute, about 1.2 s/GB, #1468), of two kinds: ``device`` waits (a NIC's firmware commands) and
``cpu`` burns one CPU (a kernel's page walk: sha256 with the GIL released). Measured in one run,
interleaved rep by rep: **pin alone** (mlock, the default plan), **register alone** (the pool's planned
registrations made by the registrar on its own, with the threads the plan gives it: its
``plan.transfers[i].workers``; in the pool, pinning workers whose chunks are all pinned take registrations
too, so with a slow stand-in pin + 1 can finish before register alone), and
**pin + 1** / **pin + 2** registrars (until the pool is ready: every registrar holds every page).
Goal: pin + registrars <= 1.1x the slower of pin alone and register alone (the registration hidden
under pinning). **Read throughput** (``--engines [mooncake] [nixl]``, ``bench_engines.py``): each
engine (Mooncake's Transfer Engine, NIXL's UCX backend; two peers in this process) reading a pinpool
pool's pages through ``pool.transfer_pieces`` against the same engine reading a plain registered buffer
of the same size (and one registered in the pool's registrations). Goal >= 0.95x. ``--transport rdma``
(a host with a NIC): Mooncake's ``rdma`` protocol and UCX over ``rc``, as ``gpu_h200.sh`` runs it.
Benchmark code: pinpool's public API only.

    python benchmarks/bench_registrars.py --engines --kinds --size 2GiB   # the engines only, both
    python benchmarks/bench_registrars.py --engines nixl --transport rdma --runtime cuda
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import statistics
import sys
import threading
import time
from typing import Any

from bench_engines import ENGINES, TRANSPORTS, read_throughput
from bench_memory import format_bytes, machine, publish

import pinpool
from pinpool.registrars import RegistrarLimits


class TimedRegistrar:
    """A stand-in engine whose register costs ``seconds_per_gib`` per GiB of one CPU (sha256 over a scratch
    buffer, GIL released: CPU work in parallel threads, as a kernel's page walk and DMA mapping are), and
    whose unregister costs about a quarter of that (#855: 11.8 s against 49.2 s for 500 GB, sequential).
    No figure times an unregister: the pin figures stop when the pool is ready."""

    SCRATCH = memoryview(bytes(16 << 20))
    hashed_per_second = 0.0  # calibrated once: sha256 bytes per second on one thread

    def __init__(self, name: str, seconds_per_gib: float, kind: str = "cpu") -> None:
        self.name, self.kind = name, kind
        self.limits = RegistrarLimits()
        self.seconds_per_byte = seconds_per_gib / (1 << 30)
        self.held: dict[int, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def calibrate(cls) -> None:
        started, rounds = time.perf_counter(), 0
        while time.perf_counter() - started < 0.5:
            hashlib.sha256(cls.SCRATCH)
            rounds += 1
        cls.hashed_per_second = rounds * len(cls.SCRATCH) / (time.perf_counter() - started)

    def _spend(self, seconds: float) -> None:
        if self.kind == "device":  # waiting on the NIC's firmware, not on a CPU
            time.sleep(seconds)
            return
        left = int(seconds * self.hashed_per_second)
        while left > 0:
            hashlib.sha256(self.SCRATCH[: min(left, len(self.SCRATCH))])
            left -= len(self.SCRATCH)

    def register(self, ptr: int, nbytes: int) -> object:
        self._spend(nbytes * self.seconds_per_byte)
        with self._lock:
            self.held[ptr] = nbytes
        return ptr

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        self._spend(nbytes * self.seconds_per_byte * 11.8 / 49.2)
        with self._lock:
            del self.held[ptr]


def pin_seconds(size: int, runtime: Any, registrars: list[TimedRegistrar]) -> float:
    """From entry until the pool is ready (every registrar holding every page)."""
    pool = pinpool.PinnedPool(size=size, runtime=runtime, registry=None, registrars=registrars)
    started = time.perf_counter()
    with pool:
        took = time.perf_counter() - started
    assert all(not r.held for r in registrars)
    return took


def register_seconds(size: int, runtime: str, registrars: list[TimedRegistrar]) -> float:
    """The registrars registering the pool's planned registrations on their own (no pinning), each with as
    many threads as the pool gives it (``pool.plan.transfers[i].workers``), all at once."""
    plan = pinpool.PinnedPool(size=size, runtime=runtime, registry=None, registrars=registrars).plan
    started = time.perf_counter()
    pools = [concurrent.futures.ThreadPoolExecutor(t.workers) for t in plan.transfers]
    jobs = [
        pool.submit(registrar.register, r.offset, r.nbytes)
        for pool, registrar, t in zip(pools, registrars, plan.transfers, strict=True)
        for r in t.registrations
    ]
    concurrent.futures.wait(jobs)
    took = time.perf_counter() - started
    for pool in pools:
        pool.shutdown()
    for registrar in registrars:
        registrar.held.clear()
    return took


def overlap(size: int, reps: int, seconds_per_gib: float, kind: str, runtime: str) -> dict[str, Any]:
    def engines(count: int) -> list[TimedRegistrar]:
        return [TimedRegistrar(name, seconds_per_gib, kind) for name in "ab"[:count]]

    cases = {
        "pin alone": lambda: pin_seconds(size, runtime, []),
        "register alone": lambda: register_seconds(size, runtime, engines(1)),
        "pin + 1 registrar": lambda: pin_seconds(size, runtime, engines(1)),
        "register alone, 2": lambda: register_seconds(size, runtime, engines(2)),
        "pin + 2 registrars": lambda: pin_seconds(size, runtime, engines(2)),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(reps):  # interleaved: a noisy moment costs every case alike
        for name, case in cases.items():
            times[name].append(case())
    median = {name: statistics.median(values) for name, values in times.items()}
    one = median["pin + 1 registrar"] / max(median["pin alone"], median["register alone"])
    two = median["pin + 2 registrars"] / max(median["pin alone"], median["register alone, 2"])
    return {"seconds_per_gib": seconds_per_gib, "kind": kind, "median_seconds": median, "runs": times, "ratio_one": one,
            "ratio_two": two}  # fmt: skip


def report(size: int, reps: int, runtime: str, overlaps: list[dict[str, Any]], engines: list[dict[str, Any]]) -> str:
    lines = [f"Transfer registrars, {format_bytes(size)} pool, {runtime}, {reps} reps (medians), {machine()}"]
    if overlaps:
        lines += [
            "",
            "| stand-in cost | pin alone | register alone | pin + 1 | ratio (goal <= 1.1) | register alone (2) "
            "| pin + 2 | ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
    for o in overlaps:
        m = o["median_seconds"]
        lines.append(
            f"| {o['kind']}, {o['seconds_per_gib']} s/GiB | {m['pin alone']:.3f} s | {m['register alone']:.3f} s | "
            f"{m['pin + 1 registrar']:.3f} s | **{o['ratio_one']:.2f}x** | {m['register alone, 2']:.3f} s | "
            f"{m['pin + 2 registrars']:.3f} s | **{o['ratio_two']:.2f}x** |"
        )
    if engines:
        lines += [
            "",
            f"| engine, {format_bytes(size)} read (64 MiB pieces) | plain buffer, one registration | plain buffer, "
            "the pool's registrations | pinpool pool | pool / plain (goal >= 0.95) | pool / plain in the same "
            "registrations |",
            "|---|---|---|---|---|---|",
        ]
    for e in engines:
        m = {name: rate / (1 << 30) for name, rate in e["median_bytes_per_second"].items()}
        same = m["plain, the pool's registrations"]
        locked = "" if e["plain_locked"] else " (plain buffers not locked)"
        lines.append(
            f"| {e['engine']}{locked} | {m['plain buffer']:.2f} GiB/s | {same:.2f} "
            f"GiB/s ({e['pool_registrations']}) | {m['pinpool pool']:.2f} GiB/s | **{e['ratio']:.2f}x** "
            f"| {e['ratio_same_registrations']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2GiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runtime", default="mlock", help="the pools' runtime (cuda on a GPU host)")
    parser.add_argument("--seconds-per-gib", type=float, nargs="+", default=[0.1, 1.0])
    parser.add_argument(
        "--kinds",
        nargs="*",
        default=["device", "cpu"],
        choices=["device", "cpu"],
        help="stand-ins that wait (a NIC's firmware) or burn one CPU per call (a page walk); none: no overlap",
    )
    parser.add_argument(
        "--engines",
        nargs="*",
        choices=ENGINES,
        help="also the real engines' read throughput (alone: every engine; each must load here)",
    )
    parser.add_argument("--transport", choices=TRANSPORTS, default="tcp", help="the engines' (rdma: a NIC)")
    parser.add_argument("--host", default="127.0.0.1", help="Mooncake's local hostname (rdma: the NIC's address)")
    parser.add_argument("--device", default="", help="Mooncake's device_name (rdma NICs; empty: discovered)")
    parser.add_argument("--json")
    parser.add_argument("--markdown")
    args = parser.parse_args(argv)
    size = pinpool.parse_size(args.size)
    TimedRegistrar.calibrate()
    overlaps = [
        overlap(size, args.reps, cost, kind, args.runtime) for kind in args.kinds for cost in args.seconds_per_gib
    ]
    names = [] if args.engines is None else args.engines or list(ENGINES)
    engines = [
        read_throughput(
            name, size, args.reps, runtime=args.runtime, transport=args.transport, host=args.host, device=args.device
        )
        for name in names
    ]
    result = {"size": size, "reps": args.reps, "runtime": args.runtime, "overlap": overlaps, "engines": engines}
    publish(report(size, args.reps, args.runtime, overlaps, engines), result, json_path=args.json,
            markdown_path=args.markdown)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
