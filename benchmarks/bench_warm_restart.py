"""Warm restart: pinning a kept shared region again, against pinning it fresh, each in a new process.

    python benchmarks/bench_warm_restart.py                         # 8 GiB in /dev/shm, 3 runs, PinnedPool
    python benchmarks/bench_warm_restart.py --raw                   # SharedMemory + MlockRuntime directly
    python benchmarks/bench_warm_restart.py --size 1GiB --reps 5 --json out.json --markdown out.md
    python benchmarks/bench_warm_restart.py --crash --size 4GiB    # the first child is SIGKILLed in its body
    python benchmarks/bench_warm_restart.py --help

Each run starts two child processes one after the other, as a server and its restart would be:

- **fresh**: ``pinpool.SharedMemory(path, create=True, keep=True)``; the region's file is created,
  and pinning faults every page in (the kernel zeroes it) and locks it. The child writes marker
  bytes at 16 places and sets the region's generation, then exits, unpinning; ``keep=True``
  leaves the file (and its pages) in ``--dir``.
- **re-attach**: ``pinpool.SharedMemory(path, create=False)``; the pages are resident already,
  so pinning only maps and locks them: no zeroing, no allocation. The child checks the markers
  and the generation (the bytes survived the restart), then exits.

Timed in each child: from just before the pool is entered until it is pinned (``with
pinpool.PinnedPool(..., runtime="mlock", memory=shared)``), or with ``--raw`` from just before
``shared.open_mapping(...)`` until ``MlockRuntime().register`` has locked every 1 GiB chunk of
it (mlock faults what is not resident: one thread, where PinnedPool pre-faults on several).
With ``--crash`` the fresh child makes its region with ``keep=False`` and does not exit: once it
has filled the whole pool with random bytes (after timing) and written the markers, it reports
their SHA-256 and waits in its body, pinned, and is SIGKILLed (a server the OOM killer took);
the re-attach child adopts the dead creator's region (``create=False, adopt=True, keep=True``)
and hashes every byte again. The file is removed after each run, so every fresh run starts
from nothing. Goal: re-attach at least 3× faster than fresh. mlock stands in for CUDA registration (same fault, pin and
accounting path in the kernel; not the driver's own cost). Benchmark code, not part of the
package: pinpool's public API only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench_memory import format_bytes, machine, publish

import pinpool

CHUNK = 1 << 30  # --raw: one register call per GiB, as a pool's chunks would be
MARKERS = 16
RESULT = "RESULT "


def vm_locked() -> int:
    """VmLck of this process, in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmLck:"):
                return int(line.split()[1]) * 1024
    return 0


def marker_offsets(nbytes: int) -> list[int]:
    return [(nbytes - 8) * i // (MARKERS - 1) // 8 * 8 for i in range(MARKERS)]


def marker(run: int, i: int) -> bytes:
    return (run * 1000 + i).to_bytes(8, "little")


# -- the child: one server start -------------------------------------------------------------------


def child(kind: str, path: str, size: int, run: int, raw: bool, crash: bool) -> dict[str, Any]:
    fresh = kind == "fresh"
    if crash:  # a creator that does not keep its region dies; its successor adopts the orphan
        shared = pinpool.SharedMemory(path, create=fresh, keep=not fresh, adopt=not fresh)
    else:
        shared = pinpool.SharedMemory(path, create=fresh, keep=True)
    out: dict[str, Any] = {"kind": kind, "run": run}
    if raw:
        runtime = pinpool.runtimes.MlockRuntime()
        started = time.perf_counter()
        mapping = shared.open_mapping(size, {"layout": "raw", "benchmark": "warm-restart"})
        bases = list(range(mapping.address, mapping.address + mapping.length, CHUNK))
        for base in bases:
            runtime.register(base, min(CHUNK, mapping.address + mapping.length - base))
        out["pin_s"] = time.perf_counter() - started
        out["vm_locked"] = vm_locked()
        if crash and fresh:
            _fill(mapping.view(0, size), run)
        out.update(_markers(lambda offset: mapping.view(offset, 8), shared, fresh, size, run))
        if crash:
            out["sha256"] = _digest(mapping.view(0, size))
        if crash and fresh:
            _die_in_body(out)
        started = time.perf_counter()
        for base in bases:
            runtime.unregister(base)
        out["unpin_s"] = time.perf_counter() - started
        return out
    pool = pinpool.PinnedPool(size=size, runtime="mlock", memory=shared, name="warm-restart")
    started = time.perf_counter()
    with pool:
        out["pin_s"] = time.perf_counter() - started
        out["vm_locked"] = vm_locked()
        tensor = pool.tensor
        if crash and fresh:
            _fill(tensor, run)
        out.update(_markers(lambda offset: tensor[offset : offset + 8], shared, fresh, size, run))
        if crash:
            out["sha256"] = _digest(tensor)
        if crash and fresh:
            _die_in_body(out)
        started = time.perf_counter()
    out["unpin_s"] = time.perf_counter() - started
    return out


_FILL_BYTES = 64 << 20


def _fill(tensor: Any, run: int) -> None:
    """--crash: random bytes over the whole pool (after timing), each 64 MiB piece another."""
    import torch

    base = torch.randint(0, 256, (_FILL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(run))
    for i, offset in enumerate(range(0, tensor.numel(), _FILL_BYTES)):
        piece = tensor[offset : offset + _FILL_BYTES]
        piece.copy_(base[: piece.numel()] + (i % 256))


def _digest(tensor: Any) -> str:
    """SHA-256 of the whole pool's bytes (after timing)."""
    digest = hashlib.sha256()
    for offset in range(0, tensor.numel(), _FILL_BYTES):
        digest.update(tensor[offset : offset + _FILL_BYTES].numpy())
    return digest.hexdigest()


def _die_in_body(out: dict[str, Any]) -> None:
    """--crash: report, then wait pinned in the body until the parent SIGKILLs this process."""
    out["unpin_s"] = None
    print(RESULT + json.dumps(out), flush=True)
    while True:
        time.sleep(3600)


def _markers(view: Any, shared: Any, fresh: bool, size: int, run: int) -> dict[str, Any]:
    """Fresh: write the markers and the generation. Re-attach: whether they survived."""
    import torch

    offsets = marker_offsets(size)
    if fresh:
        for i, offset in enumerate(offsets):
            view(offset).copy_(torch.frombuffer(bytearray(marker(run, i)), dtype=torch.uint8))
        shared.set_generation(run)
        return {}
    intact = all(bytes(view(offset).numpy()) == marker(run, i) for i, offset in enumerate(offsets))
    return {"bytes_intact": intact, "generation": shared.generation}


# -- the parent: runs, results ---------------------------------------------------------------------


def run_child(kind: str, path: str, size: int, run: int, raw: bool, crash: bool = False) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--child", kind, "--path", path, "--size", str(size), "--run", str(run)]
    argv += [*(["--raw"] if raw else []), *(["--crash"] if crash else [])]
    if crash and kind == "fresh":
        return _run_and_kill(argv)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise SystemExit(f"bench: the {kind} child failed (exit {result.returncode}):\n{result.stderr}")
    line = next(x for x in result.stdout.splitlines() if x.startswith(RESULT))
    sample: dict[str, Any] = json.loads(line[len(RESULT) :])
    return sample


def _run_and_kill(argv: list[str]) -> dict[str, Any]:
    """Start the fresh child, read its result from its body, SIGKILL it there and reap it."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the child waits in its body after this line
        proc.kill()
        _, err = proc.communicate(timeout=600)
    if not line.startswith(RESULT):
        raise SystemExit(f"bench: the fresh child failed (exit {proc.returncode}):\n{err}")
    if proc.returncode != -signal.SIGKILL:
        raise SystemExit(f"bench: the fresh child was not killed by SIGKILL (exit {proc.returncode})")
    sample: dict[str, Any] = json.loads(line[len(RESULT) :])
    return sample


def markdown(result: dict[str, Any]) -> str:
    size = format_bytes(result["size"])
    how = "SharedMemory.open_mapping + MlockRuntime (--raw)" if result["raw"] else "PinnedPool(memory=SharedMemory)"
    crash = result.get("crash")
    fresh_kind = "fresh (create, fault, lock; then SIGKILLed)" if crash else "fresh (create, fault, lock)"
    title = "Re-attach after SIGKILL" if crash else "Warm restart"
    lines = [
        f"### {title}: {size} region in {result['dir']}, {how}",
        "",
        f"{result['machine']}; {result['date']}. Each pin in its own child process; seconds from entering to pinned."
        + (" Bytes intact: 16 markers and the SHA-256 of the whole pool." if crash else ""),
        "",
        f"| run | {fresh_kind} | re-attach (lock resident pages) | ratio | bytes intact | generation |",
        "|---|---|---|---|---|---|",
    ]
    lines.extend(
        f"| {row['run']} | {row['fresh_s']:.2f} s | {row['reattach_s']:.2f} s | {row['ratio']:.1f}× | "
        f"{'yes' if row['bytes_intact'] else 'NO'} | {row['generation']} |"
        for row in result["runs"]
    )
    lines += [
        f"| median | {result['fresh_median_s']:.2f} s | {result['reattach_median_s']:.2f} s | "
        f"{result['ratio_median']:.1f}× | | |",
        "",
        f"Goal: re-attach ≥ 3× faster than fresh: **{'met' if result['ratio_median'] >= 3 else 'not met'}** "
        f"(median {result['ratio_median']:.1f}×). VmLck of each child: {format_bytes(result['vm_locked'])}.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    size = pinpool.parse_size(args.size, what="--size")
    directory = os.path.abspath(args.dir)
    path = os.path.join(directory, f"pinpool-bench-warm-restart-{os.getpid()}")

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"bench: {line}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "size": size, "dir": directory,
        "raw": args.raw, "crash": args.crash, "runs": [],
    }  # fmt: skip
    progress(result["machine"])
    try:
        for run_number in range(1, max(1, args.reps) + 1):
            fresh = run_child("fresh", path, size, run_number, args.raw, args.crash)
            held = os.stat(path).st_blocks * 512
            again = run_child("reattach", path, size, run_number, args.raw, args.crash)
            os.unlink(path)  # an operator's job for a kept region; here, so the next fresh run starts empty
            # --crash: every byte, by SHA-256 of the whole pool (the dead child's against its successor's)
            identical = not args.crash or (fresh["sha256"] == again["sha256"])
            row = {
                "run": run_number, "fresh_s": fresh["pin_s"], "reattach_s": again["pin_s"],
                "ratio": fresh["pin_s"] / again["pin_s"], "bytes_intact": again["bytes_intact"] and identical,
                "generation": again["generation"], "held_after_fresh": held, "vm_locked": again["vm_locked"],
                "fresh_unpin_s": fresh["unpin_s"], "reattach_unpin_s": again["unpin_s"],
            }  # fmt: skip
            result["runs"].append(row)
            progress(
                f"run {run_number}: fresh {row['fresh_s']:.2f} s, re-attach {row['reattach_s']:.2f} s "
                f"({row['ratio']:.1f}×), bytes intact {row['bytes_intact']}, {format_bytes(held)} held between"
            )
    finally:
        if os.path.exists(path):
            os.unlink(path)
    runs = result["runs"]
    result["fresh_median_s"] = statistics.median(r["fresh_s"] for r in runs)
    result["reattach_median_s"] = statistics.median(r["reattach_s"] for r in runs)
    result["ratio_median"] = statistics.median(r["ratio"] for r in runs)
    result["vm_locked"] = runs[-1]["vm_locked"]
    text = markdown(result)
    publish(text, result, json_path=args.json, markdown_path=args.markdown)
    return 0 if all(r["bytes_intact"] for r in runs) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="8GiB", help="the region's size (default 8GiB)")
    parser.add_argument("--reps", type=int, default=3, help="runs, each a fresh and a re-attach child (default 3)")
    parser.add_argument("--dir", default="/dev/shm", help="where the region's file lives (tmpfs or hugetlbfs)")
    parser.add_argument("--raw", action="store_true", help="SharedMemory.open_mapping + MlockRuntime, no PinnedPool")
    parser.add_argument(
        "--crash", action="store_true", help="SIGKILL the fresh child in its body (region not kept); adopt the orphan"
    )
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as Markdown")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--child", choices=("fresh", "reattach"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--run", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.child:
            sample = child(args.child, args.path, int(args.size), args.run, args.raw, args.crash)
            print(RESULT + json.dumps(sample), flush=True)
            return 0
        return run(args)
    except pinpool.PinpoolError as exc:
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
