"""``pinpool`` command line: pin a pool with the best runtime here and report what happened."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import _libc
from ._errors import PinpoolError
from ._pool import PinnedPool
from ._units import format_bytes, parse_size
from .layouts import Raw
from .runtimes import runtime_choices

HUGE_PAGES: dict[str, bool | str] = {"off": False, "thp": True, "hugetlb": "hugetlb"}


def _pin(args: argparse.Namespace) -> int:
    layout = Raw(granularity_bytes=parse_size(args.granularity, what="--granularity") if args.granularity else None)
    pool = PinnedPool(
        layout=layout,
        size=args.size,
        runtime=args.runtime,
        chunk_bytes=args.chunk_bytes,
        populate=args.populate,
        populate_workers=args.populate_workers,
        register_workers=args.register_workers,
        unpin_workers=args.unpin_workers,
        huge_pages=HUGE_PAGES[args.huge_pages],
        numa_node=args.numa_node,
        name=args.name,
    )
    locked_before = _libc.vm_locked_bytes()
    with pool:
        locked_during = _libc.vm_locked_bytes()
        pool.tensor[:: max(1, pool.nbytes // 4096)] = 1  # the view is real memory: touch it
    locked_after = _libc.vm_locked_bytes()
    gbps = pool.nbytes / pool.pin_seconds / 1e9 if pool.pin_seconds else float("inf")
    report = {
        "pool": pool.name,
        "runtime": pool.runtime.name,
        "bytes": pool.nbytes,
        "chunks": len(pool.chunks),
        "chunk_bytes": pool.chunk_bytes,
        "granularity_bytes": pool.granularity,
        "order": pool.order.value,
        "populate_workers": pool.populate_workers,
        "register_workers": pool.register_workers,
        "unpin_workers": pool.unpin_workers,
        "populate": pool.populate,
        "huge_pages": pool.huge_pages,
        "pin_seconds": round(pool.pin_seconds, 4),
        "pin_gb_per_s": round(gbps, 3),
        "unpin_seconds": round(pool.unpin_seconds, 4),
        "vm_locked_bytes": {"before": locked_before, "pinned": locked_during, "after": locked_after},
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"pinned {format_bytes(pool.nbytes)} with runtime {pool.runtime.name!r} ({pool.name!r})")
    print(
        f"  how:  {len(pool.chunks)} chunk(s) of <= {format_bytes(pool.chunk_bytes)}, granularity "
        f"{format_bytes(pool.granularity) if pool.granularity else 'none'}, {pool.populate_workers} populate + "
        f"{pool.register_workers} register thread(s) ({pool.order.value}), populate={pool.populate}, "
        f"huge_pages={pool.huge_pages}"
    )
    print(f"  fast: {pool.pin_seconds:.3f} s to pin = {gbps:.2f} GB/s; unpinned in {pool.unpin_seconds:.3f} s")
    print(
        f"  kernel: VmLck {format_bytes(locked_before)} before, {format_bytes(locked_during)} while pinned, "
        f"{format_bytes(locked_after)} after"
        + ("" if pool.runtime.name == "mlock" else " (CUDA registration is not counted in VmLck)")
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pinpool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    pin = commands.add_parser("pin", help="pin a pool, report how and how fast, unpin it")
    pin.add_argument("--size", default="4GiB", help="pool size, e.g. 4GiB, 512MB (default 4GiB)")
    pin.add_argument("--runtime", default="auto", choices=runtime_choices(), help="default: auto")
    pin.add_argument(
        "--chunk-bytes",
        default=None,
        help="size of one registration (default: PINPOOL_REGISTER_CHUNK_GB or 256GiB, split for the workers)",
    )
    pin.add_argument("--granularity", default=None, help="copy-page size chunk boundaries align to")
    pin.add_argument("--populate-workers", type=int, default=None, help="pre-fault threads (default: CPUs, up to 16)")
    pin.add_argument(
        "--register-workers",
        type=int,
        default=None,
        help="registration threads (default: 1 for CUDA, else CPUs up to 8)",
    )
    pin.add_argument("--unpin-workers", type=int, default=None, help="unregistration threads (default: CPUs, up to 8)")
    pin.add_argument(
        "--populate", action=argparse.BooleanOptionalAction, default=None,
        help="pre-fault on threads, pipelined with registration (default: on where the kernel supports it)",
    )  # fmt: skip
    pin.add_argument(
        "--huge-pages", nargs="?", const="thp", default="off", choices=["off", "thp", "hugetlb"],
        help="2 MiB pages: thp (transparent, the value when none is given) or hugetlb (reserved pool)",
    )  # fmt: skip
    pin.add_argument("--numa-node", type=int, default=None, help="bind the pool's memory to this NUMA node")
    pin.add_argument("--name", default="cli", help="pool name in logs and metrics")
    pin.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    pin.set_defaults(run=_pin)
    bench = commands.add_parser("bench", help="moved: run `./dev bench` from a checkout (docs/performance.md)")
    bench.set_defaults(run=_bench_moved)
    return parser


BENCH_MOVED = (
    "`pinpool bench` is no longer part of the installed package: the benchmark is benchmark code and lives "
    "in the repository's benchmarks/ folder. From a checkout run `./dev bench [options]` "
    "(or `python benchmarks/pin_throughput.py --help` with any Python that has pinpool); "
    "the method and results are in docs/performance.md"
)


def _bench_moved(args: argparse.Namespace) -> int:
    print(f"pinpool: {BENCH_MOVED}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # before parsing: whatever bench options follow, say where it went
        return _bench_moved(argparse.Namespace())
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except PinpoolError as exc:
        print(f"pinpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
