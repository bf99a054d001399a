"""What ``plan`` and ``pin`` print: each report as one JSON-ready dict, and its text rendered
from that dict (so both say the same), in lines of at most :data:`WIDTH` columns."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._units import format_bytes, format_rate
from .progress import EventLog, format_seconds, percentile

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from .._plan.plan import Schedule
    from .._pool.pool import PinnedPool

WIDTH = 120  # a report line fits a terminal, a log viewer and a code review's diff without scrolling

_LABEL = re.compile(r"^( *[a-z]+: +)")  # "  latency:  ", "here:      ": continuation lines align after it


def fit(line: str, width: int = WIDTH) -> list[str]:
    """``line`` as lines of at most ``width`` columns, continuations aligned after its label (else indented
    two more); a word longer than the room (a path) is never cut."""
    if len(line) <= width:
        return [line]
    label = _LABEL.match(line)
    indent = " " * (len(label.group(1)) if label else len(line) - len(line.lstrip()) + 2)
    return textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def _fitted(lines: Sequence[str]) -> list[str]:
    return [part for line in lines for part in fit(line)]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int] = frozenset()) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths,
                         strict=True))).rstrip()  # fmt: skip

    return [line(header), *(line(r) for r in rows)]


def _gran(nbytes: int | None) -> str:
    return "none" if nbytes is None else format_bytes(nbytes)


def _chunk_rows(plan: Schedule, rows: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first and last ``rows`` chunks (all when that covers the table): only these are listed."""
    chunks = plan.chunks
    count = len(chunks)
    placed = [(b.offset, b.offset + b.spec.nbytes, b.spec.name) for b in plan.buffers if b.plan is not None]

    def row(index: int) -> dict[str, Any]:
        chunk = chunks[index]
        buffer = next((name for start, end, name in placed if start <= chunk.offset < end), "?")
        return {"index": index, "buffer": buffer, "offset": chunk.offset, "nbytes": chunk.nbytes}

    if count <= 2 * rows:
        return [row(i) for i in range(count)], []
    return [row(i) for i in range(rows)], [row(i) for i in range(count - rows, count)]


def plan_report(plan: Schedule, *, pool: str, layout: str, size: int, runtime: str, available: bool,
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
        "registrations": len(plan.chunks),
        "registrations_reason": plan.registrations_reason,
        "granularity_bytes": plan.granularity,
        "order": plan.order.value,
        "populate": plan.populate,
        "huge_pages": plan.huge_pages,
        "numa_node": plan.numa_node,
        "workers": {"populate": plan.populate_workers, "register": plan.register_workers,
                    "unpin": plan.unpin_workers, "threads": plan.threads},
        "span_bytes": plan.span_bytes,
        "spans": len(plan.spans),
        "lookahead_bytes": plan.lookahead_bytes,
        "buffers": [
            {"name": b.spec.name, "shape": list(b.spec.shape), "dtype": str(b.spec.dtype).removeprefix("torch."),
             "nbytes": b.spec.nbytes, "granularity_bytes": b.spec.granularity, "offset": b.offset,
             "chunks": len(b.chunks)}
            for b in plan.buffers
        ],
        "transfers": [
            {"name": t.name, "registrations": len(t.registrations), "largest_bytes": t.largest_bytes,
             "max_bytes": t.limits.max_bytes, "preferred_bytes": t.limits.preferred_bytes,
             "page_table_entries": t.limits.page_table_entries, "parallel": t.limits.parallel, "workers": t.workers,
             "pins_pages": t.limits.pins_pages, "faults_pages": t.limits.faults_pages,
             "runs": [{"offset": o, "nbytes": n, "count": c} for o, n, c in t.registrations.runs]}
            for t in plan.transfers
        ],
        "chunks": {"count": len(plan.chunks),
                   "runs": [{"offset": o, "nbytes": n, "count": c} for o, n, c in plan.chunks.runs],
                   "head": head, "tail": tail},
    }  # fmt: skip


def plan_text(r: dict[str, Any]) -> list[str]:
    runtime = r["runtime"] + ("" if r["runtime_available"] else " (not available on this host)")
    buffers = _table(
        ("name", "shape", "dtype", "bytes", "granularity", "offset", "chunks"),
        [(b["name"], str(tuple(b["shape"])), b["dtype"], f"{format_bytes(b['nbytes'])} ({b['nbytes']} B)",
          _gran(b["granularity_bytes"]), str(b["offset"]), str(b["chunks"])) for b in r["buffers"]],
        right=frozenset({5, 6}),
    )  # fmt: skip
    lines = [
        *fit(f"plan for pool {r['pool']!r}: {format_bytes(r['nbytes'])} of layout {r['layout']}, runtime {runtime}; "
             "nothing is allocated or pinned"),
        f"buffers ({len(r['buffers'])}):",
        *("  " + line for line in buffers),
    ]  # fmt: skip
    threads = r["workers"]["threads"]
    details = [
        f"pages:     {r['num_pages']} of {format_bytes(r['page_bytes'])} ({r['page_bytes']} B)",
        f"mapping:   {format_bytes(r['mapping_bytes'])} ({r['mapping_bytes']} B), buffers aligned to "
        f"{format_bytes(r['align_bytes'])}, OS page {format_bytes(r['os_page_bytes'])}",
        f"chunks:    {r['chunks']['count']} of <= {format_bytes(r['chunk_bytes'])} (chunk limit "
        f"{format_bytes(r['chunk_limit'])}), granularity {_gran(r['granularity_bytes'])}",
        f"why:       {r['registrations_reason']}",
        f"order:     {r['order']} (populate={r['populate']}, huge_pages={r['huge_pages']}, numa_node={r['numa_node']})",
        f"workers:   populate {r['workers']['populate']}, register {r['workers']['register']}, "
        f"unpin {r['workers']['unpin']} ({threads} pinning thread{'' if threads == 1 else 's'})",
        f"spans:     {r['spans']} of <= {format_bytes(r['span_bytes'])}, lookahead {format_bytes(r['lookahead_bytes'])}"
        if r["populate"]
        else "spans:     none (no pre-faulting: registration faults the pages)",
    ]
    for t in r.get("transfers", ()):
        limit = "no limit" if t["max_bytes"] is None else f"max {format_bytes(t['max_bytes'])}"
        details.append(
            f"registrar: {t['name']}: {t['registrations']} registration(s) of <= {format_bytes(t['largest_bytes'])} "
            f"({limit}), runs of whole chunks, {t['workers']} thread(s) of its own"
            + (", pins the pages itself (RLIMIT_MEMLOCK applies)" if t["pins_pages"] else "")
            + (", touches every page" if t["faults_pages"] else "")
        )
    if (pinning := r.get("pinning")) is not None:
        details.append(f"pinning:   {_pinning_text(pinning)}")
    if (elastic := r.get("reservation")) is not None:
        segments = elastic["segments"]
        details.append(
            f"elastic:   reserves {elastic['reserved_pages']} pages ({format_bytes(elastic['reserved_bytes'])}), entry "
            f"pins the floor, pages [0, {elastic['floor_pages']}); above it {len(segments) - 1} segment(s) of "
            f"<= {elastic['step_pages']} pages grow and shrink whole (multiples of {elastic['quantum_pages']} pages)"
        )
    error = r.get("preflight_error")
    details.append(f"here:      pinning it on this host would fail: {error}" if error else
                   "here:      this host passes the pool's pre-flight (memory, memlock)")  # fmt: skip
    lines.extend(_fitted(details))
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
        f"node pacing {paced}, " + _retry_text(p)
    )


def _retry_text(p: dict[str, Any]) -> str:
    codes = ", ".join(map(str, p["retry_codes"]))
    if not codes or not p["max_retries"]:
        return "no retries" + ("" if codes else " (no retry codes)")
    floor = "one alignment unit" if p["min_chunk_bytes"] is None else format_bytes(p["min_chunk_bytes"])
    return f"retries of codes {codes} as halves down to {floor}, at most {p['max_retries']} levels deep"


def _latency(events: EventLog) -> dict[str, Any] | None:
    calls = list(events.register_seconds)
    if not calls:
        return None
    return {"calls": len(calls), "p50_s": percentile(calls, 50), "p99_s": percentile(calls, 99), "max_s": max(calls)}


_CALL_MEANS = {
    "register_first": "each call locks its chunk on-fault; its pages lock as the populate threads fault them",
    "populate_first": "each call registers pages the populate threads already faulted",
    "register_only": "each call faults and locks its own pages",
}
FIRST_TOUCH = (
    "first touch of fresh memory: includes page-fault cost (the kernel zeroes every page of a new mapping "
    "as it is first faulted); pinning memory that is already resident is faster"
)
HOLD_ENDINGS = {"time": "its time running out", "SIGINT": "SIGINT (Ctrl-C)", "SIGTERM": "SIGTERM"}


def pin_report(pool: PinnedPool, events: EventLog, registry: CollectorRegistry, vm_locked: tuple[int, int, int],
               hold: tuple[float, str] | None) -> dict[str, Any]:  # fmt: skip
    """``hold``: (seconds held, how it ended: a key of :data:`HOLD_ENDINGS`), or None without ``--hold``."""
    labels = {"pool": pool.name, "runtime": pool.runtime.name}
    plan = pool.plan
    spans = registry.get_sample_value("pinpool_chunk_populate_seconds_count", labels) or 0
    span_seconds = registry.get_sample_value("pinpool_chunk_populate_seconds_sum", labels) or 0.0
    gbps = pool.nbytes / pool.stats.pin_seconds / 1e9 if pool.stats.pin_seconds else None
    notes = [FIRST_TOUCH] if pool.runtime.name != "fake" else ["runtime 'fake' registers nothing and faults nothing"]
    return {
        "pool": pool.name,
        "runtime": pool.runtime.name,
        "layout": pool.layout.name,
        "bytes": pool.nbytes,
        "chunks": len(plan.chunks),
        "chunk_bytes": plan.chunk_bytes,
        "granularity_bytes": plan.granularity,
        "order": plan.order.value,
        "populate_workers": plan.populate_workers,
        "register_workers": plan.register_workers,
        "unpin_workers": plan.unpin_workers,
        "populate": plan.populate,
        "huge_pages": plan.huge_pages,
        "pin_seconds": round(pool.stats.pin_seconds, 6),
        "pin_gb_per_s": None if gbps is None else round(gbps, 3),
        "unpin_seconds": round(pool.stats.unpin_seconds, 6),
        "register_latency": _latency(events),
        "retries": pool.stats.retries,
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
        f"  fast:     {r['pin_seconds']:.3f} s to pin = {format_rate(r['bytes'], r['pin_seconds'])} over the "
        f"whole pin; unpinned in {r['unpin_seconds']:.3f} s",
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
        ended = HOLD_ENDINGS.get(r["hold_ended_by"], r["hold_ended_by"])
        lines.append(f"  held:     {r['held_seconds']:.1f} s pinned, ended by {ended}")
    return _fitted(lines)
