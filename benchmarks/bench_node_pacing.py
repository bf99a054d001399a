"""Node-level pacing: N ranks (processes) each pinning a real mlock pool at once, unpaced vs paced.

    python benchmarks/bench_node_pacing.py                       # 4 ranks x 1 GiB, unpaced vs 2 slots, 3 rounds
    python benchmarks/bench_node_pacing.py --ranks 8 --slots 2 4 --size 2GiB --json out.json

Every rank is its own process: it imports pinpool and plans its pool (``PinnedPool(size=...,
runtime="mlock")``) first, then waits at a start barrier (a go-file). From the go: a paced rank
enters its pool with ``PinnedPool(..., node_slots=N, node_dir=...)``: entering waits for a node
slot, pins, and gives the slot back as soon as the pool is pinned; every rank then keeps its pool pinned until
all have reported, as a server's ranks do. Timestamps are CLOCK_MONOTONIC, shared by every
process on Linux. Configurations run interleaved (unpaced, paced, unpaced, ...) so machine noise
hits all alike; the table gives medians with the spread (min-max) over rounds.

Reported per configuration: wall (first go to last pinned), aggregate throughput (all ranks'
bytes / wall), the slowest rank's time from go to pinned (waiting included), the mean pin time
of one rank once admitted (waiting excluded), and the longest wait for a slot.

The time a rank waited for its slot is read from its pool's ``pinpool_node_wait_seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

GiB = 1 << 30


def now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


# -- one rank (a child process) --------------------------------------------------------------------


def rank_main(spec: dict[str, Any]) -> int:
    from prometheus_client import CollectorRegistry

    import pinpool

    slots = spec["slots"]
    registry = CollectorRegistry()  # the slot wait is read back from pinpool_node_wait_seconds
    pacing = {"node_slots": slots, "node_dir": spec["dir"]} if slots else {}
    pool = pinpool.PinnedPool(size=spec["size"], runtime="mlock", name=spec["name"], registry=registry, **pacing)
    Path(spec["ready"]).touch()
    go, release = Path(spec["go"]), Path(spec["release"])
    while not go.exists():
        time.sleep(0.001)
    started = now()
    with pool:  # waits for a slot when paced; the slot goes back as soon as the pool is pinned
        pinned = now()
        labels = {"pool": spec["name"], "runtime": "mlock", "kind": "slot"}
        waited = registry.get_sample_value("pinpool_node_wait_seconds_sum", labels) or 0.0
        record = {"name": spec["name"], "pid": os.getpid(), "nbytes": pool.nbytes, "go": started,
                  "admitted": started + waited, "pinned": pinned,
                  # The slot goes back when the pinning threads are done, a moment before the
                  # body starts: that moment, not "pinned", bounds the pinning for "at once".
                  "slot_released": started + waited + pool.stats.pin_seconds}  # fmt: skip
        tmp = spec["out"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.rename(tmp, spec["out"])
        while not release.exists():  # stay pinned until every rank has pinned, as a server would
            time.sleep(0.005)
    return 0


# -- the parent ------------------------------------------------------------------------------------


def run_round(*, ranks: int, slots: int | None, size: str, poll: float, work: Path) -> dict[str, Any]:
    """One configuration, once: start the ranks, let them go together, collect their timestamps."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    node_dir = work / "node"
    procs: list[subprocess.Popen[bytes]] = []
    specs: list[dict[str, Any]] = []
    for i in range(ranks):
        spec = {
            "name": f"rank{i}", "slots": slots, "size": size, "poll": poll, "dir": str(node_dir),
            "ready": str(work / f"rank{i}.ready"), "go": str(work / "go"), "release": str(work / "release"),
            "out": str(work / f"rank{i}.json"),
        }  # fmt: skip
        specs.append(spec)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINPOOL_NODE_")}
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank", json.dumps(spec)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    try:
        _wait_all([Path(s["ready"]) for s in specs], procs, "ready")
        (work / "go").touch()
        _wait_all([Path(s["out"]) for s in specs], procs, "pinned")
        (work / "release").touch()
        for p in procs:
            _out, err = p.communicate(timeout=300)
            if p.returncode != 0:
                raise RuntimeError(f"a rank failed (rc {p.returncode}): {err.decode()}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    records = [json.loads(Path(s["out"]).read_text()) for s in specs]
    first = min(r["go"] for r in records)
    last = max(r["pinned"] for r in records)
    wall = last - first
    total = sum(r["nbytes"] for r in records)
    pin_times = [r["pinned"] - r["admitted"] for r in records]
    return {
        "wall_s": wall,
        "aggregate_gb_per_s": total / wall / 1e9,
        "slowest_rank_s": max(r["pinned"] - r["go"] for r in records),
        "mean_pin_s": statistics.fmean(pin_times),
        "max_wait_s": max(r["admitted"] - r["go"] for r in records),
        "max_concurrent": _max_concurrent([(r["admitted"], r["slot_released"]) for r in records]),
        "bytes": total,
    }


def _wait_all(paths: list[Path], procs: list[subprocess.Popen[bytes]], what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        for proc in procs:
            if proc.poll() is not None and proc.returncode != 0:
                raise RuntimeError(f"a rank exited before it was {what}: {proc.communicate()[1].decode()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks were not {what} within {timeout:g} s")
        time.sleep(0.002)


def _max_concurrent(intervals: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals], key=lambda t: (t[0], t[1]))
    best = current = 0
    for _t, delta in events:
        current += delta
        best = max(best, current)
    return best


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": rounds}
    for key in ("wall_s", "aggregate_gb_per_s", "slowest_rank_s", "mean_pin_s", "max_wait_s"):
        values = [r[key] for r in rounds]
        out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["max_concurrent"] = max(r["max_concurrent"] for r in rounds)
    return out


def _markdown(results: dict[str, dict[str, Any]], *, ranks: int, size: str, rounds: int) -> str:
    base = results["unpaced"]["aggregate_gb_per_s"]["median"]

    def cell(stats: dict[str, float], fmt: str) -> str:
        return f"{stats['median']:{fmt}} ({stats['min']:{fmt}}-{stats['max']:{fmt}})"

    lines = [
        f"{ranks} ranks x {size}, runtime mlock, {rounds} round(s) each, median (min-max)",
        "",
        "| configuration | wall s | aggregate GB/s | vs unpaced | slowest rank s | mean pin s (admitted) "
        "| longest slot wait s | most pinning at once |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ratio = r["aggregate_gb_per_s"]["median"] / base
        lines.append(
            f"| {name} | {cell(r['wall_s'], '.2f')} | {cell(r['aggregate_gb_per_s'], '.2f')} | {ratio:.2f}x "
            f"| {cell(r['slowest_rank_s'], '.2f')} | {cell(r['mean_pin_s'], '.2f')} | {cell(r['max_wait_s'], '.2f')} "
            f"| {r['max_concurrent']} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="processes pinning at once (default 4)")
    parser.add_argument("--size", default="1GiB", help="each rank's pool (default 1GiB)")
    parser.add_argument("--slots", type=int, nargs="+", default=[2], help="paced configurations (default: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every configuration (default 3)")
    parser.add_argument(
        "--poll", type=float, default=0.25, help="longest slot polling interval, s (default 0.25, pinpool's default)"
    )
    parser.add_argument("--json", default=None, help="write the results as JSON here (also printed)")
    parser.add_argument("--rank", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rank is not None:
        return rank_main(json.loads(args.rank))
    configs: dict[str, int | None] = {"unpaced": None, **{f"slots={n}": n for n in args.slots}}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="pinpool-bench-node-") as tmp:
        for i in range(args.rounds):
            for name, slots in configs.items():
                result = run_round(ranks=args.ranks, slots=slots, size=args.size, poll=args.poll, work=Path(tmp) / name)
                rounds[name].append(result)
                print(
                    f"round {i + 1}/{args.rounds} {name}: wall {result['wall_s']:.2f} s, "
                    f"{result['aggregate_gb_per_s']:.2f} GB/s, slowest rank {result['slowest_rank_s']:.2f} s, "
                    f"at once {result['max_concurrent']}",
                    file=sys.stderr,
                )
    results = {name: _summary(r) for name, r in rounds.items()}
    report = {
        "ranks": args.ranks, "size": args.size, "rounds": args.rounds, "poll_s": args.poll, "cpus": os.cpu_count(),
        "results": results,
    }  # fmt: skip
    print(_markdown(results, ranks=args.ranks, size=args.size, rounds=args.rounds))
    print()
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
