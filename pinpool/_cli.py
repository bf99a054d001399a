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


def _pin(args: argparse.Namespace) -> int:
    layout = Raw(granularity_bytes=parse_size(args.granularity, what="--granularity") if args.granularity else None)
    pool = PinnedPool(
        layout=layout,
        size=args.size,
        runtime=args.runtime,
        chunk_bytes=args.chunk_bytes,
        max_workers=args.workers,
        populate=args.populate,
        huge_pages=args.huge_pages,
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
        "workers": pool.workers,
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
        f"{format_bytes(pool.granularity) if pool.granularity else 'none'}, {pool.workers} worker thread(s), "
        f"populate={pool.populate}, huge_pages={pool.huge_pages}"
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
    pin.add_argument("--runtime", default="auto", choices=["auto", "cuda", "mlock"], help="default: auto")
    pin.add_argument("--chunk-bytes", default=None, help="upper bound of one registration (default: env or 256GiB)")
    pin.add_argument("--granularity", default=None, help="copy-page size chunk boundaries align to")
    pin.add_argument("--workers", type=int, default=None, help="worker threads (default: by runtime and CPUs)")
    pin.add_argument("--populate", action="store_true", help="pre-fault each chunk before registering it")
    pin.add_argument("--huge-pages", action="store_true", help="transparent huge pages (2 MiB)")
    pin.add_argument("--name", default="cli", help="pool name in logs and metrics")
    pin.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    pin.set_defaults(run=_pin)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except PinpoolError as exc:
        print(f"pinpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
