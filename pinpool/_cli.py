"""The pinpool command line: plan a pool, check the host, pin a pool.

    pinpool plan   --size 1.5TiB --layout mha ...   what a pool would be; nothing is allocated
    pinpool doctor --size 1.5TiB                    is this host ready, and what to change
    pinpool pin    --size 64GiB [--hold forever]    pin it, show progress, report, unpin

Exit status (also in ``pinpool --help``):

    0    success; for ``pin --hold``, also when Ctrl-C or SIGTERM ends the hold (the pool is unpinned first)
    1    doctor: a check failed; pin: unpinning failed (UnpinError)
    2    bad input: a usage error, a ConfigError (size, layout, option, environment variable),
         or a metrics address that cannot be served
    3    pinning failed and was rolled back (PinError), or the memory could not be mapped or is already pinned
    130  interrupted (Ctrl-C or SIGTERM) and rolled back, or interrupted while the pool was unpinned at the
         end (it finishes unpinning first): nothing stays pinned
    141  stdout was closed early (e.g. piped into ``head``): output stops quietly, as for other tools

Only the standard library and pinpool's torch-free modules are imported at the top: torch
(through pinpool.layouts and pinpool._pool) costs about 2 s, so it is imported inside the
subcommands and ``pinpool --help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import signal
import stat
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, dataclass, fields
from decimal import Decimal, InvalidOperation
from types import FrameType
from typing import TYPE_CHECKING, Any

from . import _libc
from ._declared import OPTIONS, PER_BUFFER, Flag, Option, option
from ._errors import ConfigError, PinError, PinpoolError, UnpinError
from ._progress import EventLog, ProgressReporter, format_rate, format_seconds, percentile
from ._units import format_bytes, parse_size
from .runtimes import runtime_choices

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ._plan import PoolPlan
    from ._pool import PinnedPool
    from .layouts import Layout
    from .runtimes import Capabilities

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_PIN_FAILED = 3
EXIT_INTERRUPTED = 130
EXIT_PIPE = 141

EXIT_CODES = """\
exit status:
  0    success; for pin --hold, also when Ctrl-C or SIGTERM ends the hold (the pool is unpinned first)
  1    doctor: a check failed; pin: unpinning failed
  2    bad input: usage error, ConfigError (size, layout, option, environment variable),
       or a metrics address that cannot be served
  3    pinning failed and was rolled back (PinError), or the memory could not be mapped or is already pinned
  130  interrupted (Ctrl-C or SIGTERM) and rolled back, or interrupted while the pool was unpinned
       at the end (it finishes unpinning first): nothing stays pinned
  141  stdout was closed early (e.g. piped into head)"""

DESCRIPTION = "Plan, check and pin page-locked host-memory pools (KV-cache offload) for LLM inference servers."

HUGE_PAGES: dict[str, bool | str] = {"off": False, "thp": True, "hugetlb": "hugetlb"}
CLI_RUNTIMES = tuple(dict.fromkeys((*runtime_choices(), "fake")))
METRICS_PORT = 9464  # the port every pinpool dashboard and doc uses

BENCH_MOVED = (
    "`pinpool bench` is no longer part of the installed package: the benchmark is benchmark code and lives "
    "in the repository's benchmarks/ folder. From a checkout run `./dev bench [options]` "
    "(or `python benchmarks/pin_throughput.py --help` with any Python that has pinpool); "
    "the method and results are in docs/performance.md"
)


# -- sizes -----------------------------------------------------------------------------------------


def cli_size(option: str, text: str) -> int:
    """A size from the command line, stricter than :func:`parse_size`: a number without a unit
    counts bytes, so it must be whole (``1.5`` is a typo for ``1.5GiB``, not one byte)."""
    stripped = text.strip()
    example = f"e.g. {option} 64GiB"
    if stripped.startswith("-"):
        raise ConfigError(f"{option} {text}: a size must be positive; give {example}")
    number = stripped[:-1].rstrip() if stripped[-1:] in ("b", "B") else stripped
    try:
        value = Decimal(number)
    except InvalidOperation:
        return parse_size(text, what=option)  # has a unit (or is not a size): parse_size explains
    if value.is_finite() and value != value.to_integral_value():
        raise ConfigError(
            f"{option} {text} is not a whole number of bytes: a size without a unit counts bytes; "
            f"add a unit, e.g. {option} {number}GiB"
        )
    return parse_size(text, what=option)


# -- layouts ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Field:
    """One layout constructor field: its command-line option and how its text is read."""

    flag: str
    kind: str  # int, bytes, dtype, shape, shapes, choice, flag
    help: str

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


_FIELDS: dict[str, _Field] = {
    "layout": _Field("--kv-layout", "choice", "layout kind: layer_first, page_first, page_first_direct or page_head"),
    "layer_num": _Field("--layer-num", "int", "layers"),
    "page_size": _Field("--page-size", "int", "tokens per page"),
    "head_num": _Field("--head-num", "int", "KV heads (mha)"),
    "head_dim": _Field("--head-dim", "int", "head dimension (mha)"),
    "v_head_dim": _Field("--v-head-dim", "int", "V head dimension when it differs from --head-dim (mha)"),
    "k_only": _Field("--k-only", "flag", "K without V (mha)"),
    "kv_cache_dim": _Field("--kv-cache-dim", "int", "latent dimension per token and layer (mla)"),
    "dtype": _Field("--dtype", "dtype", "element type, e.g. bfloat16, float16, float8_e4m3fn"),
    "temporal_dtype": _Field("--temporal-dtype", "dtype", "temporal state dtype, default --dtype (mamba)"),
    "conv_dtype": _Field("--conv-dtype", "dtype", "conv state dtype, default --dtype (mamba)"),
    "num_mamba_layers": _Field("--num-mamba-layers", "int", "Mamba layers (mamba)"),
    "temporal_shape": _Field("--temporal-shape", "shape", "temporal state shape, e.g. 8,64,128 (mamba)"),
    "conv_shapes": _Field("--conv-shapes", "shapes", "conv state shapes, e.g. '4,8192;4,512' (mamba)"),
    "index_head_dim": _Field("--index-head-dim", "int", "indexer head dimension (indexer)"),
    "quant_block_size": _Field("--quant-block-size", "int", "elements per fp32 scale (indexer)"),
    "item_bytes": _Field("--item-bytes", "bytes", "bytes per page and layer (paged)"),
    "granularity_bytes": _Field("--granularity", "bytes", "copy-page size chunk boundaries align to (raw)"),
}

# family -> (class in pinpool.layouts, its fields)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "raw": ("Raw", ("granularity_bytes",)),
    "mha": ("MHA", ("layout", "layer_num", "page_size", "head_num", "head_dim", "dtype", "k_only", "v_head_dim")),
    "mla": ("MLA", ("layout", "layer_num", "page_size", "kv_cache_dim", "dtype")),
    "mamba": (
        "Mamba",
        ("num_mamba_layers", "temporal_shape", "conv_shapes", "dtype", "layout", "temporal_dtype", "conv_dtype"),
    ),
    "indexer": ("Indexer", ("layout", "layer_num", "page_size", "index_head_dim", "quant_block_size")),
    "paged": ("PagedBytes", ("layout", "layer_num", "item_bytes")),
}


# Short names engines use (SGLang's --kv-cache-dtype, vLLM's) for torch's dtypes.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}  # fmt: skip


def _dtype(where: str, value: object) -> Any:
    import torch

    name = value.removeprefix("torch.") if isinstance(value, str) else value
    name = DTYPE_ALIASES.get(name, name) if isinstance(name, str) else name
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(
            f"{where} {value!r} is not a torch dtype; give one such as bfloat16, float16, float32, float8_e4m3fn, "
            "uint8 (or bf16, fp16, fp8_e4m3)"
        )
    return dtype


def _int_text(where: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{where} {text!r} is not an integer") from None


def _shape_text(where: str, text: str) -> tuple[int, ...]:
    return tuple(_int_text(where, part) for part in text.split(",") if part.strip())


def _field_value(field: _Field, where: str, value: object, *, from_text: bool) -> object:
    """The constructor value of a field given as command-line text or as a JSON value. Range and
    type checks beyond parsing are the layout class's (its ConfigError names the field)."""
    if field.kind == "dtype":
        return _dtype(where, value)
    if field.kind == "bytes":
        return cli_size(field.flag if from_text else where, value) if isinstance(value, str) else value
    if from_text and isinstance(value, str):
        if field.kind == "int":
            return _int_text(where, value)
        if field.kind == "shape":
            return _shape_text(where, value)
        if field.kind == "shapes":
            return tuple(_shape_text(where, shape) for shape in value.split(";") if shape.strip())
        return value
    if field.kind == "shape" and isinstance(value, list):
        return tuple(value)
    if field.kind == "shapes" and isinstance(value, list):
        return tuple(tuple(shape) if isinstance(shape, list) else shape for shape in value)
    return value


def build_layout(family: str, given: dict[str, object], *, source: str, from_text: bool) -> Layout:
    """A layout of ``family`` from field values keyed by the constructor's field names.

    ``source`` names where they came from in messages (``--layout mha`` or the file's path).
    Raises ConfigError for an unknown family, a field the family lacks, a missing field, or
    whatever the layout class rejects.
    """
    from . import layouts

    if family not in FAMILIES:
        raise ConfigError(f"{source}: unknown layout family {family!r}; choose one of {', '.join(FAMILIES)}")
    class_name, names = FAMILIES[family]
    cls = getattr(layouts, class_name)
    label = (lambda n: _FIELDS[n].flag) if from_text else (lambda n: n)
    extra = sorted(set(given) - set(names))
    if extra:
        raise ConfigError(
            f"{source} has no {', '.join(map(label, extra))}; its fields are {', '.join(map(label, names))}"
        )
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in given]
    if missing:
        raise ConfigError(f"{source} also needs {', '.join(map(label, missing))}")
    kwargs = {
        name: _field_value(_FIELDS[name], label(name) if from_text else f"{source}: {name}", value, from_text=from_text)
        for name, value in given.items()
    }
    layout: Layout = cls(**kwargs)
    return layout


def layout_from_args(args: argparse.Namespace) -> Layout:
    """The layout the command line asks for: ``--layout-file`` or ``--layout`` with its dims."""
    given = {name: getattr(args, f.dest) for name, f in _FIELDS.items() if getattr(args, f.dest) is not None}
    if args.layout_file is not None:
        if args.layout is not None or given:
            flags = [*(["--layout"] if args.layout is not None else []), *(_FIELDS[n].flag for n in given)]
            raise ConfigError(f"--layout-file {args.layout_file} takes no {', '.join(flags)}: put them in the file")
        return layout_from_file(args.layout_file)
    family = args.layout or "raw"
    return build_layout(family, given, source=f"--layout {family}", from_text=True)


LAYOUT_FILE_MAX_BYTES = 1 << 20  # a layout is a few hundred bytes; more is the wrong file


def _read_layout_file(path: str) -> bytes:
    """The file's bytes, refusing what is not a regular file (a FIFO would block for ever,
    /dev/zero would be read until the OOM killer stops it) and anything over the size limit."""
    try:
        # O_NONBLOCK: opening a FIFO would wait for a writer (a regular file's reads ignore the flag).
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ConfigError(
                    f"--layout-file {path} is {_file_kind(mode)}, not a regular file: give a regular JSON file"
                )
            with open(fd, "rb", closefd=False) as f:
                data = f.read(LAYOUT_FILE_MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"--layout-file {path}: cannot read it ({exc.strerror})") from None
    if len(data) > LAYOUT_FILE_MAX_BYTES:
        raise ConfigError(
            f"--layout-file {path} is larger than {format_bytes(LAYOUT_FILE_MAX_BYTES)}, the limit for a layout "
            "file: give the JSON file that describes the layout"
        )
    return data


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")]  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), "a special file")


def layout_from_file(path: str) -> Layout:
    """A layout from a JSON object ``{"family": "mha", "layout": "page_first", "layer_num": 32, ...}``
    in a regular file of at most LAYOUT_FILE_MAX_BYTES."""
    data = _read_layout_file(path)
    try:
        spec = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--layout-file {path}: not JSON ({exc})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("family"), str):
        raise ConfigError(
            f'--layout-file {path}: give a JSON object with a "family" ({", ".join(FAMILIES)}) and the '
            'layout\'s fields, e.g. {"family": "mha", "layout": "page_first", "layer_num": 32, "page_size": 64, '
            '"head_num": 8, "head_dim": 128, "dtype": "bfloat16"}'
        )
    family = spec.pop("family")
    return build_layout(family, spec, source=f"--layout-file {path} ({family})", from_text=False)


# -- pool options shared by plan and pin: pinpool._declared's, flag by flag ---------------------------


def _flags(command: str) -> list[tuple[Option, Flag]]:
    """The declared options ``command`` takes as flags, in the declaration's order."""
    return [(o, o.flag) for o in OPTIONS if o.flag is not None and command in o.flag.commands]


def _seconds_text(flag: str, text: str) -> float | str | None:
    """``--max-call-seconds``: a number (checked by the pool), ``auto`` or ``none``."""
    word = text.strip().lower()
    if word in ("auto", "none"):
        return "auto" if word == "auto" else None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: give a number of seconds (e.g. 0.02), auto or none") from None


def _nice_text(flag: str, text: str) -> int | str:
    """``--pin-nice``: an integer (checked by the pool) or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag} {text}: give an integer from 0 to 19, or auto") from None


def _flag_value(flag: Flag, value: Any) -> Any:
    """The Python value of a flag's argparse value, by its declared kind (pinpool._declared.KINDS)."""
    if flag.kind == "size":
        return cli_size(flag.flag, value)
    if flag.kind == "chunk":
        return PER_BUFFER if value.strip() == PER_BUFFER else cli_size(flag.flag, value)
    if flag.kind == "seconds":
        return _seconds_text(flag.flag, value)
    if flag.kind == "nice":
        return _nice_text(flag.flag, value)
    if flag.kind == "huge_pages":
        return HUGE_PAGES[value]
    return value  # int (argparse's type=int), text, runtime (a name), bool, switch


def pool_options(args: argparse.Namespace, command: str = "pin") -> dict[str, Any]:
    """PinnedPool keyword arguments from the command line, validated as far as text goes: every
    declared option given as a flag, and the command line's own defaults (``--size 4GiB`` unless
    ``--num-pages``, ``--name cli``); what is not given is left to the Python default. The
    layout last: it imports torch, so a typo elsewhere fails before that."""
    given: dict[str, Any] = {}
    for opt, flag in _flags(command):
        if flag.kind == "layout":
            continue
        value = getattr(args, flag.dest)
        if value is None and command != "doctor" and flag.default is not None:
            if opt.name == "size" and getattr(args, "num_pages", None) is not None:
                continue  # --num-pages instead of a size
            value = flag.default
        if value is not None:
            given[opt.name] = _flag_value(flag, value)
    if any(flag.kind == "layout" for _opt, flag in _flags(command)):
        given["layout"] = layout_from_args(args)
    return given


def _runtime_arg(name: str) -> Any:
    """What ``runtime=`` gets: a registered name, or a FakeRuntime for ``--runtime fake``."""
    if name == "fake":
        from .testing import FakeRuntime

        return FakeRuntime()
    return name


def _plan_runtime(name: str) -> tuple[str, Capabilities, bool]:
    """(name, declared capabilities, available here) without building the runtime: a plan for a
    GPU host can be made anywhere, and no GPU driver is started for it."""
    from .runtimes import auto_runtime_name, capabilities_of, runtime_info

    if name == "fake":
        from .testing import FakeRuntime

        return name, FakeRuntime().capabilities, True
    resolved = auto_runtime_name() if name == "auto" else name
    info = runtime_info(resolved)
    # Registered factories are the runtime classes; their capabilities are class attributes.
    return resolved, capabilities_of(info.factory), info.available()  # type: ignore[arg-type]


# -- plan ----------------------------------------------------------------------------------------


def _buffer_of(plan: PoolPlan) -> Callable[[int], str]:
    """The name of the buffer a chunk (by its offset in the pool) belongs to."""
    placed = [(b.offset, b.offset + b.spec.nbytes, b.spec.name) for b in plan.buffers if b.plan is not None]

    def name(offset: int) -> str:
        return next((n for start, end, n in placed if start <= offset < end), "?")

    return name


def _chunk_rows(plan: PoolPlan, rows: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first and last ``rows`` chunks (all of them when that covers the table). Indexing the
    lazy table touches only these: the plan of a 1.5 TiB pool stays a few runs in memory."""
    chunks = plan.chunks
    count = len(chunks)
    buffer = _buffer_of(plan)

    def row(index: int) -> dict[str, Any]:
        chunk = chunks[index]
        return {"index": index, "buffer": buffer(chunk.offset), "offset": chunk.offset, "nbytes": chunk.nbytes}

    if count <= 2 * rows:
        return [row(i) for i in range(count)], []
    return [row(i) for i in range(rows)], [row(i) for i in range(count - rows, count)]


def plan_report(plan: PoolPlan, *, pool: str, layout: str, size: int, runtime: str, available: bool,
                rows: int) -> dict[str, Any]:  # fmt: skip
    """The plan as one JSON-ready dict; the text output is rendered from it, so both say the same."""
    head, tail = _chunk_rows(plan, rows)
    return {
        "pool": pool,
        "layout": layout,
        "runtime": runtime,
        "runtime_available": available,
        "size_bytes": size,
        "nbytes": plan.nbytes,
        "page_bytes": plan.page_bytes,
        "num_pages": plan.num_pages,
        "mapping_bytes": plan.mapping_bytes,
        "align_bytes": plan.align,
        "os_page_bytes": plan.page_size,
        "chunk_limit": plan.chunk_limit,
        "chunk_bytes": plan.chunk_bytes,
        "granularity_bytes": plan.granularity,
        "order": plan.order.value,
        "populate": plan.populate,
        "huge_pages": plan.huge_pages,
        "numa_node": plan.numa_node,
        "workers": {
            "populate": plan.populate_workers,
            "register": plan.register_workers,
            "unpin": plan.unpin_workers,
            "threads": plan.threads,
        },
        "span_bytes": plan.span_bytes,
        "spans": len(plan.spans),
        "lookahead_bytes": plan.lookahead_bytes,
        "buffers": [
            {
                "name": b.spec.name,
                "shape": list(b.spec.shape),
                "dtype": str(b.spec.dtype).removeprefix("torch."),
                "nbytes": b.spec.nbytes,
                "granularity_bytes": b.spec.granularity,
                "offset": b.offset,
                "chunks": len(b.chunks),
            }
            for b in plan.buffers
        ],
        "chunks": {
            "count": len(plan.chunks),
            "runs": [{"offset": o, "nbytes": n, "count": c} for o, n, c in plan.chunks.runs],
            "head": head,
            "tail": tail,
        },
    }


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths,
                         strict=True))).rstrip()  # fmt: skip

    return [line(header), *(line(r) for r in rows)]


def _gran(nbytes: int | None) -> str:
    return "none" if nbytes is None else format_bytes(nbytes)


def plan_text(report: dict[str, Any]) -> list[str]:
    r = report
    runtime = r["runtime"] + ("" if r["runtime_available"] else " (not available on this host)")
    lines = [
        f"plan for pool {r['pool']!r}: {format_bytes(r['nbytes'])} of layout {r['layout']}, runtime {runtime}; "
        "nothing is allocated or pinned",
        f"buffers ({len(r['buffers'])}):",
        *(
            "  " + line
            for line in _table(
                ("name", "shape", "dtype", "bytes", "granularity", "offset", "chunks"),
                [
                    (
                        b["name"],
                        str(tuple(b["shape"])),
                        b["dtype"],
                        f"{format_bytes(b['nbytes'])} ({b['nbytes']} B)",
                        _gran(b["granularity_bytes"]),
                        str(b["offset"]),
                        str(b["chunks"]),
                    )
                    for b in r["buffers"]
                ],
                right=frozenset({5, 6}),
            )
        ),
        f"pages:     {r['num_pages']} of {format_bytes(r['page_bytes'])} ({r['page_bytes']} B)",
        f"mapping:   {format_bytes(r['mapping_bytes'])} ({r['mapping_bytes']} B), buffers aligned to "
        f"{format_bytes(r['align_bytes'])}, OS page {format_bytes(r['os_page_bytes'])}",
        f"chunks:    {r['chunks']['count']} of <= {format_bytes(r['chunk_bytes'])} (chunk limit "
        f"{format_bytes(r['chunk_limit'])}), granularity {_gran(r['granularity_bytes'])}",
        f"order:     {r['order']} (populate={r['populate']}, huge_pages={r['huge_pages']}, numa_node={r['numa_node']})",
        f"workers:   populate {r['workers']['populate']}, register {r['workers']['register']}, "
        f"unpin {r['workers']['unpin']} ({r['workers']['threads']} pinning threads)",
        f"spans:     {r['spans']} of <= {format_bytes(r['span_bytes'])}, lookahead {format_bytes(r['lookahead_bytes'])}"
        if r["populate"]
        else "spans:     none (no pre-faulting: registration faults the pages)",
    ]
    pinning = r.get("pinning")
    if pinning is not None:
        lines.append(f"pinning:   {_pinning_text(pinning)}")
    error = r.get("preflight_error")
    lines.append(f"here:      pinning it on this host would fail: {error}" if error else
                 "here:      this host passes the pool's pre-flight (memory, memlock)")  # fmt: skip
    head, tail = r["chunks"]["head"], r["chunks"]["tail"]
    shown = f"first {len(head)} and last {len(tail)}" if tail else "all"
    lines.append(f"chunk table ({r['chunks']['count']} chunks, {shown}):")

    def cells(c: dict[str, Any]) -> tuple[str, ...]:
        return (str(c["index"]), c["buffer"], str(c["offset"]), format_bytes(c["nbytes"]), str(c["nbytes"]))

    body = [cells(c) for c in head]
    if tail:
        body.append(("...", "", "", "", ""))
        body.extend(cells(c) for c in tail)
    lines.extend("  " + line for line in _table(("#", "buffer", "offset", "size", "bytes"), body,
                                                right=frozenset({0, 2, 4})))  # fmt: skip
    return lines


def _pinning_text(p: dict[str, Any]) -> str:
    budget = p["max_call_seconds"]
    pacing = p["node_pacing"]
    paced = "none" if pacing is None else ", ".join(
        [*([f"{pacing['slots']} slot(s)"] if pacing["slots"] is not None else []),
         *([f"budget {format_bytes(pacing['budget_bytes'])}"] if pacing["budget_bytes"] is not None else []),
         f"in {pacing['dir']}"]
    )  # fmt: skip
    return (
        f"{'in the background' if p['background'] else 'before the body runs'}, "
        + ("one registration per buffer (never cut), " if p["per_buffer"] else "")
        + f"stall budget {'none' if budget is None else format_seconds(budget)}, pin threads nice +{p['pin_nice']}, "
        f"node pacing {paced}"
    )


def run_plan(args: argparse.Namespace) -> int:
    kwargs = pool_options(args, "plan")
    if args.rows < 0:
        raise ConfigError(f"--rows {args.rows}: give a number of chunk table rows >= 0")
    from ._host import HostFacts
    from ._node import NodePacing
    from ._options import PoolOptions
    from ._plan import check_host, plan_pool

    # The same options as pin, checked the same way; pacing is validated, not joined.
    options = PoolOptions.create(**{name: value for name, value in kwargs.items() if option(name).create})
    pacing = NodePacing.from_options(**{name: value for name, value in kwargs.items() if name.startswith("node_")})
    runtime, caps, available = _plan_runtime(args.runtime)
    host = HostFacts.probe()
    plan = plan_pool(options, host, caps)
    report = plan_report(plan, pool=options.name, layout=options.layout.name, size=options.size, runtime=runtime,
                         available=available, rows=args.rows)  # fmt: skip
    report["pinning"] = {
        "background": options.background,
        "max_call_seconds": options.max_call_seconds,
        "pin_nice": options.pin_nice,
        "per_buffer": options.per_buffer,
        "min_chunk_bytes": options.min_chunk_bytes,
        "max_retries": options.max_retries,
        "node_pacing": None
        if pacing is None
        else {"slots": pacing.slots, "budget_bytes": pacing.budget_bytes, "dir": pacing.directory,
              "wait": pacing.wait},
    }  # fmt: skip
    # The plan holds for any host; whether pinning it here would pass the pool's memory and
    # memlock pre-flight is a separate answer, reported rather than raised.
    try:
        check_host(options, host, None if args.runtime == "fake" else args.runtime)
        report["preflight_error"] = None
    except ConfigError as exc:
        report["preflight_error"] = str(exc)
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(plan_text(report)))
    return EXIT_OK


# -- pin -----------------------------------------------------------------------------------------


def hold_seconds(text: str | None) -> float | None:
    """``--hold``: None for no hold, ``math.inf`` for forever, else seconds >= 0."""
    if text is None:
        return None
    if text.strip().lower() == "forever":
        return float("inf")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ConfigError(f"--hold {text}: give a number of seconds >= 0, or 'forever' (until Ctrl-C or SIGTERM)")
    return seconds


def progress_mode(choice: str, stream: Any) -> str:
    """``auto``: a redrawn bar on a terminal, plain lines in a log or a pipe."""
    if choice != "auto":
        return choice
    isatty = getattr(stream, "isatty", None)
    return "bar" if callable(isatty) and isatty() else "lines"


def _say(text: str) -> None:
    """A status line on stderr (progress and notes go there; the report goes to stdout)."""
    print(text, file=sys.stderr, flush=True)


def _serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, str]:
    from prometheus_client import start_http_server

    if not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port {port}: give a TCP port (0-65535; {METRICS_PORT} is pinpool's usual)")
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise ConfigError(
            f"--metrics-host {host} --metrics-port {port}: cannot serve metrics there ({exc.strerror or exc}); "
            "pick a free port, or a host address of this machine"
        ) from None
    shown = f"[{host}]" if ":" in host else host
    return server, f"http://{shown}:{server.server_port}/metrics"


def _hold(seconds: float, pool: PinnedPool, url: str | None) -> str:
    """Keep the pool pinned; 'time' when the hold ran out, 'interrupt' when Ctrl-C or SIGTERM ended it."""
    until = "until Ctrl-C or SIGTERM" if seconds == float("inf") else f"for {seconds:g} s (Ctrl-C or SIGTERM ends it)"
    try:
        _say(f"pinpool: holding {format_bytes(pool.nbytes)} pinned {until}" + (f"; metrics at {url}" if url else ""))
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 3600.0))
    except KeyboardInterrupt:  # the usual way to end a hold: unpin and exit 0
        if _interrupts is not None:
            _interrupts.stopping = True  # a second signal while unpinning asks the same: still exit 0
        return "interrupt"
    return "time"


def _latency(events: EventLog) -> dict[str, Any] | None:
    calls = list(events.register_seconds)
    if not calls:
        return None
    return {
        "calls": len(calls),
        "p50_s": percentile(calls, 50),
        "p99_s": percentile(calls, 99),
        "max_s": max(calls),
    }


_CALL_MEANS = {
    "register_first": "each call locks its chunk on-fault; its pages lock as the populate threads fault them",
    "populate_first": "each call registers pages the populate threads already faulted",
    "register_only": "each call faults and locks its own pages",
}
FIRST_TOUCH = (
    "first touch of fresh memory: includes page-fault cost (the kernel zeroes every page of a new mapping "
    "as it is first faulted); pinning memory that is already resident is faster"
)


def pin_report(pool: PinnedPool, events: EventLog, registry: CollectorRegistry, vm_locked: tuple[int, int, int],
               hold: tuple[float, str] | None) -> dict[str, Any]:  # fmt: skip
    labels = {"pool": pool.name, "runtime": pool.runtime.name}
    spans = registry.get_sample_value("pinpool_chunk_populate_seconds_count", labels) or 0
    span_seconds = registry.get_sample_value("pinpool_chunk_populate_seconds_sum", labels) or 0.0
    gbps = pool.nbytes / pool.pin_seconds / 1e9 if pool.pin_seconds else None
    notes = [FIRST_TOUCH] if pool.runtime.name != "fake" else ["runtime 'fake' registers nothing and faults nothing"]
    return {
        "pool": pool.name,
        "runtime": pool.runtime.name,
        "layout": pool.layout.name,
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
        "pin_seconds": round(pool.pin_seconds, 6),
        "pin_gb_per_s": None if gbps is None else round(gbps, 3),
        "unpin_seconds": round(pool.unpin_seconds, 6),
        "register_latency": _latency(events),
        "retries": pool.retries,
        "populate_spans": int(spans),
        "populate_span_mean_s": span_seconds / spans if spans else None,
        "first_touch": pool.runtime.name != "fake",
        "notes": notes,
        "held_seconds": None if hold is None else round(hold[0], 3),
        "hold_ended_by": None if hold is None else hold[1],
        "vm_locked_bytes": dict(zip(("before", "pinned", "after"), vm_locked, strict=True)),
    }


def pin_text(r: dict[str, Any]) -> list[str]:
    locked = r["vm_locked_bytes"]
    lines = [
        f"pinned {format_bytes(r['bytes'])} with runtime {r['runtime']!r} (pool {r['pool']!r}, layout {r['layout']})",
        f"  how:      {r['chunks']} chunk(s) of <= {format_bytes(r['chunk_bytes'])}, granularity "
        f"{_gran(r['granularity_bytes'])}, {r['populate_workers']} populate + {r['register_workers']} register "
        f"thread(s) ({r['order']}), populate={r['populate']}, huge_pages={r['huge_pages']}",
        f"  fast:     {r['pin_seconds']:.3f} s to pin = {format_rate(r['bytes'], r['pin_seconds'])}; "
        f"unpinned in {r['unpin_seconds']:.3f} s",
    ]
    latency = r["register_latency"]
    if latency is not None:
        calls = f"{latency['calls']} call{'' if latency['calls'] == 1 else 's'}"
        figures = ", ".join(f"{q} {format_seconds(latency[f'{q}_s'])}" for q in ("p50", "p99", "max"))
        retried = f"; {r['retries']} retried as halves" if r["retries"] else ""
        means = f" ({_CALL_MEANS[r['order']]})" if r["first_touch"] and r["order"] in _CALL_MEANS else ""
        lines.append(f"  latency:  per registration call ({calls}): {figures}{means}{retried}")
    if r["populate_spans"]:
        lines.append(
            f"  faulting: {r['populate_spans']} populate span(s), {format_seconds(r['populate_span_mean_s'])} mean"
        )
    lines.extend(f"  note:     {note}" for note in r["notes"])
    lines.append(
        f"  kernel:   VmLck {format_bytes(locked['before'])} before, {format_bytes(locked['pinned'])} while pinned, "
        f"{format_bytes(locked['after'])} after"
        + ("" if r["runtime"] == "mlock" else " (only mlock is counted in VmLck)")
    )
    if r["held_seconds"] is not None:
        ended = "Ctrl-C or SIGTERM" if r["hold_ended_by"] == "interrupt" else "its time running out"
        lines.append(f"  held:     {r['held_seconds']:.1f} s pinned, ended by {ended}")
    return lines


ROLLED_BACK_NOTE = "pinning stopped and was rolled back: nothing is pinned"
PROGRESS_SECONDS = 0.1  # how often a background pool's progress is drawn while pin waits for it


def _wait_ready(pool: PinnedPool, progress: ProgressReporter) -> None:
    """Wait for a background pool, drawing progress: its worker threads report to nobody,
    so the command reads the pool, as a server would. A failure raises its PinError."""
    while True:
        try:
            pool.wait_ready_sync(timeout=PROGRESS_SECONDS)
        except TimeoutError:
            progress(pool.pinned_bytes, pool.nbytes, 0, len(pool.chunks))
            continue
        progress(pool.nbytes, pool.nbytes, len(pool.chunks), len(pool.chunks))
        return


UNPINNED_NOTE = "the pool was unpinned before exit"


def run_pin(args: argparse.Namespace) -> int:
    kwargs = pool_options(args, "pin")
    hold = hold_seconds(args.hold)
    from prometheus_client import CollectorRegistry

    from ._pool import PinnedPool

    registry = CollectorRegistry()  # the pool's own: the summary reads it, --metrics-port serves it
    events = EventLog(sys.stderr)
    progress = ProgressReporter(sys.stderr, progress_mode(args.progress, sys.stderr))
    kwargs["runtime"] = _runtime_arg(kwargs.get("runtime", "auto"))
    pool = PinnedPool(**kwargs, registry=registry, logger=events, on_progress=progress)
    labels = {"pool": pool.name, "runtime": pool.runtime.name}
    # Chunks count as pinned whole; pre-faulted spans (<= 512 MiB) move the display within one.
    progress.faulted = lambda: registry.get_sample_value("pinpool_populated_bytes_total", labels)
    server, url = (None, None) if args.metrics_port is None else _serve_metrics(registry, args.metrics_host,
                                                                                 args.metrics_port)  # fmt: skip
    try:
        return _pin_and_report(args, pool, progress, events, registry, hold, url)
    finally:
        progress.finish()
        if server is not None:
            server.shutdown()
            server.server_close()


def _pin_and_report(args: argparse.Namespace, pool: PinnedPool, progress: ProgressReporter, events: EventLog,
                    registry: CollectorRegistry, hold: float | None, url: str | None) -> int:  # fmt: skip
    if progress.mode != "none":
        _say(
            f"pinpool: pinning {format_bytes(pool.nbytes)} in {len(pool.chunks)} chunk(s) of <= "
            f"{format_bytes(pool.chunk_bytes)} with runtime {pool.runtime.name!r} (pool {pool.name!r})"
        )
    held: tuple[float, str] | None = None
    entered = False
    before = _libc.vm_locked_bytes()
    progress.restart()
    try:
        with pool:
            try:
                entered = True
                if args.background:  # the pool pins while this waits
                    _wait_ready(pool, progress)
                progress.finish()
                during = _libc.vm_locked_bytes()
                if hold is not None:
                    started = time.monotonic()
                    ended_by = _hold(hold, pool, url)
                    held = (time.monotonic() - started, ended_by)
            finally:
                _defer_interrupts()  # the pool unpins and unmaps uninterrupted; a signal now is recorded
        if _interrupts is not None and _interrupts.pending is not None:
            raise KeyboardInterrupt(_interrupts.pending)  # it arrived while the pool was unpinned
    except KeyboardInterrupt as exc:
        exc.add_note(UNPINNED_NOTE if entered else ROLLED_BACK_NOTE)
        raise
    after = _libc.vm_locked_bytes()
    report = pin_report(pool, events, registry, (before, during, after), held)
    print(json.dumps(report) if args.json else "\n".join(pin_text(report)))
    return EXIT_OK


# -- doctor --------------------------------------------------------------------------------------


def run_doctor(args: argparse.Namespace) -> int:
    size = pool_options(args, "doctor").get("size")
    from . import _doctor

    checks = _doctor.run_checks(_doctor.read_facts(cuda=args.cuda), size)
    if args.json:
        print(json.dumps(_doctor.to_json(checks, size, _version())))
    else:
        print(_doctor.render_text(checks, size))
    return _doctor.exit_code(checks)


# -- the parser ----------------------------------------------------------------------------------


def _version() -> str:
    from . import __version__

    return __version__


class _VersionAction(argparse.Action):
    """``--version``, reading the version only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:  # fmt: skip
        print(f"pinpool {_version()}")
        parser.exit()


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=30)


def _wrap(text: str) -> str:
    # Raw descriptions keep the exit-code table's layout, so prose is wrapped here.
    return textwrap.fill(text, width=79)


_METAVARS = {"int": "N", "bytes": "SIZE", "dtype": "DTYPE", "shape": "SHAPE", "shapes": "SHAPES", "choice": "KIND"}


def _flag_help(opt: Option, flag: Flag) -> str:
    """The declared one-line help, with what the command line adds (argparse formats ``%``)."""
    return f"{opt.help} {flag.note}".strip().replace("%", "%%")


def _add_pool_options(parser: argparse.ArgumentParser, command: str) -> None:
    """Every declared option ``command`` takes (pinpool._declared), as a flag of its kind. Each
    defaults to None, "not given": :func:`pool_options` then leaves it to the Python default,
    or to the command line's own (``Flag.default``)."""
    pool = parser.add_argument_group("pool", "the options of PinnedPool(...) of the same names (docs/options.md)")
    layout_flag = False
    for opt, flag in _flags(command):
        help_text = _flag_help(opt, flag)
        if flag.kind == "layout":
            layout_flag = True  # its own group, after this one
        elif flag.kind == "bool":
            pool.add_argument(flag.flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif flag.kind == "switch":
            pool.add_argument(flag.flag, action="store_true", default=None, help=help_text)
        elif flag.kind == "runtime":
            pool.add_argument(flag.flag, default="auto", choices=CLI_RUNTIMES, help=help_text)
        elif flag.kind == "huge_pages":
            pool.add_argument(flag.flag, nargs="?", const="thp", default=None, choices=list(HUGE_PAGES),
                              help=help_text)  # fmt: skip
        else:
            pool.add_argument(flag.flag, type=int if flag.kind == "int" else str, metavar=flag.metavar,
                              help=help_text)  # fmt: skip
    if layout_flag:
        _add_layout_group(parser)


def _add_layout_group(parser: argparse.ArgumentParser) -> None:
    layout = parser.add_argument_group(
        "layout", "what the pool holds: --layout FAMILY with its dimensions, or --layout-file (default: raw bytes)"
    )
    layout.add_argument("--layout", choices=list(FAMILIES), help="layout family (default raw)")
    layout.add_argument(
        "--layout-file",
        metavar="PATH",
        help='a regular file (at most 1 MiB) holding a JSON object: {"family": "mha", "layout": "page_first", '
        '"layer_num": 32, ...}',
    )
    for field in _FIELDS.values():
        if field.kind == "flag":
            layout.add_argument(field.flag, action="store_true", default=None, help=field.help)
        else:
            layout.add_argument(field.flag, metavar=_METAVARS[field.kind], help=field.help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pinpool",
        description=_wrap(DESCRIPTION),
        epilog=EXIT_CODES + "\n\npinpool bench moved: run ./dev bench from a checkout.",
        formatter_class=_formatter,
    )
    parser.add_argument("--version", action=_VersionAction, help="print pinpool's version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{plan,doctor,pin}")

    plan = commands.add_parser(
        "plan", help="show what a pool would be (buffers, chunks, workers); allocates and pins nothing",
        description=_wrap("Plan a pool with the same options as pin: buffers, pages, chunks, workers, spans and "
        "the chunk table. Nothing is allocated or pinned, so a pool larger than this host's memory can be planned "
        "too; the plan says whether this host could pin it."),
        epilog=EXIT_CODES, formatter_class=_formatter,
    )  # fmt: skip
    _add_pool_options(plan, "plan")
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    plan.add_argument("--rows", type=int, default=5, metavar="N",
                      help="chunk table rows shown at each end (default 5)")  # fmt: skip
    plan.set_defaults(run=run_plan)

    doctor = commands.add_parser(
        "doctor", help="check this host for pinning: limits, memory, huge pages, kernel, NUMA, GPU, environment",
        description=_wrap("Check this host for pinning a pool, each check ok / warn / fail / skip with a one-line "
        "fix. Exits 1 when a check fails (warnings do not)."),
        epilog=EXIT_CODES, formatter_class=_formatter,
    )  # fmt: skip
    _add_pool_options(doctor, "doctor")
    doctor.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    doctor.add_argument(
        "--cuda",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask torch and the driver about GPUs (default: yes, when torch sees one)",
    )
    doctor.set_defaults(run=run_doctor)

    pin = commands.add_parser(
        "pin", help="pin a pool with progress, report how and how fast, unpin it",
        description=_wrap("Pin a pool, showing progress on stderr (a bar on a terminal, a line every 2 s "
        "otherwise), then report to stdout how it was pinned, how fast, and the latency of each registration "
        "call, and unpin it. --hold keeps it pinned meanwhile (with --metrics-port for Prometheus)."),
        epilog=EXIT_CODES, formatter_class=_formatter,
    )  # fmt: skip
    _add_pool_options(pin, "pin")
    pin.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    pin.add_argument("--hold", metavar="SECONDS|forever",
                     help="keep the pool pinned this long after pinning; Ctrl-C or SIGTERM ends the hold, the pool "
                     "is unpinned and pinpool exits 0")  # fmt: skip
    pin.add_argument("--metrics-port", type=int, metavar="PORT",
                     help=f"serve the pool's Prometheus metrics on this port while pinning and holding "
                     f"({METRICS_PORT} is pinpool's usual; 0 picks a free one)")  # fmt: skip
    pin.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="ADDR",
        help="address to serve metrics on (default 127.0.0.1, this machine only; 0.0.0.0 for all)",
    )
    pin.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "none"),
        default="auto",
        help="auto (default): a bar on a terminal, a plain line every 2 s otherwise",
    )
    pin.set_defaults(run=run_pin)
    return parser


# -- main ----------------------------------------------------------------------------------------


def _bench_moved() -> int:
    print(f"pinpool: {BENCH_MOVED}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _exit_code_of(error: PinpoolError) -> int:
    if isinstance(error, ConfigError):
        return EXIT_BAD_INPUT
    if isinstance(error, UnpinError):
        return EXIT_FAILED
    # PinError, and the failures that leave nothing pinned as well: AllocationError (mmap refused),
    # AlreadyPinnedError, RuntimeCallError outside a pool.
    return EXIT_PIN_FAILED if isinstance(error, PinError | MemoryError | RuntimeError) else EXIT_FAILED


class Interrupts:
    """How the command takes SIGTERM (and Ctrl-C, while Python's own handler has it).

    The first signal raises KeyboardInterrupt in the main thread, so pinning stops and rolls back
    as for Ctrl-C (a container's stop, systemd, kill). After that, and from the moment the pool
    starts to exit (:meth:`defer`), a signal only is recorded: an exception raised inside the
    pool's teardown would land in whatever runs there, and one raised in the finalizer that
    unmaps the memory is printed as "Exception ignored" and lost (the command then exited 0).
    :func:`main` turns a recorded signal into the interrupted status once the pool is gone.
    """

    def __init__(self) -> None:
        self.armed = True
        self.pending: str | None = None  # the signal that arrived while deferred ("SIGTERM", "Ctrl-C")
        self.stopping = False  # a signal ended a hold: later ones repeat that request

    def handle(self, signum: int, frame: FrameType | None) -> None:
        what = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        if self.armed:
            self.armed = False  # before raising: whatever the exception unwinds through is not interrupted again
            raise KeyboardInterrupt(what)
        if self.pending is None and not self.stopping:
            self.pending = what

    def defer(self) -> None:
        self.armed = False


_interrupts: Interrupts | None = None  # the running command's, while main() runs on the main thread


def _defer_interrupts() -> None:
    if _interrupts is not None:
        _interrupts.defer()


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[Interrupts | None]:
    """Install :class:`Interrupts` for SIGTERM, and for SIGINT unless someone else handles it; the
    previous handlers are restored after. Off the main thread, signals are left alone."""
    global _interrupts
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    interrupts = Interrupts()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupts.handle)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupts.handle)
    outer, _interrupts = _interrupts, interrupts
    try:
        yield interrupts
    finally:
        _interrupts = outer
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stdout_gone() -> int:
    """stdout's reader went away: point stdout at /dev/null so the interpreter's final flush is
    quiet (the Python docs' recipe for SIGPIPE), and exit as a tool killed by SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_PIPE


def _report_interrupt(exc: KeyboardInterrupt) -> None:
    what = str(exc.args[0]) if exc.args and exc.args[0] else "Ctrl-C"
    lines = [f"pinpool: interrupted ({what})"]
    lines.extend(f"pinpool: {note.removeprefix('pinpool: ')}" for note in getattr(exc, "__notes__", ()))
    with contextlib.suppress(Exception, KeyboardInterrupt):  # a second Ctrl-C while saying so: still no traceback
        prefix = "\n" if sys.stderr.isatty() else ""  # past the terminal's ^C
        sys.stderr.write(prefix + "\n".join(lines) + "\n")
        sys.stderr.flush()


def _value_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option, in any subcommand, that takes exactly one value."""
    found: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _value_options(sub)
        elif action.option_strings and action.nargs is None:
            found.update(action.option_strings)
    return found


def _glue_negative_values(argv: list[str], options: set[str]) -> list[str]:
    """``--size -5GiB`` as ``--size=-5GiB``: argparse would take ``-5GiB`` for an option and answer
    "expected one argument"; glued, the value reaches pinpool's own check, which says what is wrong."""
    glued: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in options and i + 1 < len(argv) and re.match(r"-[0-9.]", argv[i + 1]):
            glued.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        glued.append(token)
        i += 1
    return glued


def _dispatch(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(_glue_negative_values(argv, _value_options(parser)))
    try:
        return int(args.run(args))
    except PinpoolError as exc:
        print(f"pinpool: {type(exc).__name__}: {exc}", file=sys.stderr)
        return _exit_code_of(exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argparse raises SystemExit for --help,
    --version and usage errors, with status 0 or 2)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["bench"]:  # before parsing: whatever bench options follow, say where it went
        return _bench_moved()
    with sigterm_as_interrupt() as interrupts:
        try:
            try:
                code = _dispatch(args)
            finally:
                sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        except BrokenPipeError:
            return _stdout_gone()
        except KeyboardInterrupt as exc:
            _report_interrupt(exc)
            return EXIT_INTERRUPTED
        finally:
            if interrupts is not None:
                interrupts.defer()
                if args[:1] == ["pin"]:
                    gc.collect()  # whatever of the pool a cycle kept is freed (and unmapped) while signals wait
        if interrupts is not None and interrupts.pending is not None and code == EXIT_OK:
            _report_interrupt(KeyboardInterrupt(interrupts.pending))  # it arrived as the command ended
            return EXIT_INTERRUPTED
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
