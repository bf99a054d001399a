#!/usr/bin/env python3
"""Generate dashboards/pinpool.json, the pinpool Grafana dashboard, from plain dicts.

    python dashboards/generate.py           rewrite dashboards/pinpool.json
    python dashboards/generate.py --check   exit 1 if the committed file differs from what this writes

The JSON is generated, never edited by hand: CI runs ``--check`` so the two cannot drift.
Metric names and labels are pinpool's contract (docs/metrics.md). No dependencies beyond the
standard library.

Time series are per instance and pool (``by (instance, pool)``), never one sum over every
instance: 64 ranks each pinning a pool of the same name are 64 lines, so the one rank that is
stuck stays visible. The stat row sums (that is what "how many pools are open" means) and adds
the least-pinned instance, the one number that shows a stuck rank at a glance.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

OUTPUT = Path(__file__).resolve().parent / "pinpool.json"

Json = dict[str, Any]

# Every panel and every target uses the templated data source, never a fixed one.
DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}
# Every query filters on the dashboard's variables.
SELECTOR = 'job=~"$job", instance=~"$instance", pool=~"$pool"'
RATE = "$__rate_interval"
# Time series group by these: one line per process (instance) and pool.
BY = "instance, pool"
EACH = "{{instance}} {{pool}}"  # their legend


def sel(metric: str, extra: str = "") -> str:
    """``metric{job=~"$job", instance=~"$instance", pool=~"$pool"[, extra]}``."""
    matchers = f"{SELECTOR}, {extra}" if extra else SELECTOR
    return f"{metric}{{{matchers}}}"


def rate(metric: str, extra: str = "") -> str:
    return f"rate({sel(metric, extra)}[{RATE}])"


def increase(metric: str, extra: str = "") -> str:
    return f"increase({sel(metric, extra)}[{RATE}])"


def target(expr: str, legend: str, ref: str, **extra: Any) -> Json:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "range": True, "refId": ref, **extra}


def grid(x: int, y: int, w: int, h: int) -> Json:
    return {"h": h, "w": w, "x": x, "y": y}


def timeseries(title: str, description: str, unit: str, targets: list[Json], pos: Json, **custom: Any) -> Json:
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "palette-classic"},
                "custom": {
                    "drawStyle": "line",
                    "fillOpacity": 10,
                    "lineWidth": 1,
                    "showPoints": "auto",
                    "spanNulls": False,
                    **custom,
                },
                "min": 0,
                "unit": unit,
            },
            "overrides": [],
        },
        "gridPos": pos,
        "options": {
            "legend": {
                "calcs": ["lastNotNull", "max"],
                "displayMode": "table",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": targets,
        "title": title,
        "type": "timeseries",
    }


def stat(title: str, description: str, unit: str, targets: list[Json], pos: Json) -> Json:
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {
            "defaults": {
                "color": {"mode": "thresholds"},
                "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
                "unit": unit,
            },
            "overrides": [],
        },
        "gridPos": pos,
        "options": {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": targets,
        "title": title,
        "type": "stat",
    }


def heatmap(title: str, description: str, targets: list[Json], pos: Json) -> Json:
    return {
        "datasource": DATASOURCE,
        "description": description,
        # Cell values are counts of registrations; the bucket axis is in seconds (yAxis.unit).
        "fieldConfig": {"defaults": {"unit": "short"}, "overrides": []},
        "gridPos": pos,
        "options": {
            "calculate": False,
            "cellGap": 1,
            "cellValues": {"unit": "short"},
            "color": {
                "exponent": 0.5,
                "fill": "dark-orange",
                "mode": "scheme",
                "scale": "exponential",
                "scheme": "Oranges",
                "steps": 64,
            },
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "showValue": "never",
            "tooltip": {"mode": "single", "showColorScale": False, "yHistogram": True},
            "yAxis": {"axisPlacement": "left", "reverse": False, "unit": "s"},
        },
        "targets": targets,
        "title": title,
        "type": "heatmap",
    }


def query_variable(name: str, label: str, query: str) -> Json:
    return {
        "allValue": ".+",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "datasource": DATASOURCE,
        "definition": query,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": query,
        "refresh": 2,  # on time range change
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def variables() -> list[Json]:
    return [
        {
            "current": {},
            "hide": 0,
            "includeAll": False,
            "label": "Data source",
            "multi": False,
            "name": "datasource",
            "options": [],
            "query": "prometheus",
            "refresh": 1,
            "regex": "",
            "skipUrlSync": False,
            "type": "datasource",
        },
        query_variable("job", "Job", "label_values(pinpool_pool_bytes, job)"),
        query_variable("instance", "Instance", 'label_values(pinpool_pool_bytes{job=~"$job"}, instance)'),
        query_variable("pool", "Pool", 'label_values(pinpool_pool_bytes{job=~"$job", instance=~"$instance"}, pool)'),
    ]


def quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by ({BY}, le) ({rate(metric)}))"


def mean(histogram: str) -> str:
    return f"sum by ({BY}) ({rate(histogram + '_sum')}) / sum by ({BY}) ({rate(histogram + '_count')})"


def pinned_fraction() -> str:
    """Pinned over target per instance and pool; closed pools (target 0) are left out."""
    return f"sum by ({BY}) ({sel('pinpool_pinned_bytes')}) / (sum by ({BY}) ({sel('pinpool_pool_bytes')}) > 0)"


def row(title: str, y: int) -> Json:
    """A row header (expanded: the panels below it are the dashboard's own, drawn by render.py too)."""
    return {"collapsed": False, "gridPos": grid(0, y, 24, 1), "panels": [], "title": title, "type": "row"}


def transfer_panels(y: int) -> list[Json]:
    """Transfer registrars (pool registrars=[...]: Mooncake, NIXL): one line per instance, pool and registrar."""
    by = f"{BY}, registrar"
    each = f"{EACH} {{{{registrar}}}}"
    return [
        row("Transfer engines", y),
        timeseries(
            "Transfer registrations by registrar",
            "Live registrations of pool memory with each transfer registrar (pinpool_transfer_registrations): "
            "runs of whole chunks registered with Mooncake's Transfer Engine, a NIXL agent or your own registrar. "
            "A line with no pool open beside it is a registration that failed to unregister (docs/metrics.md).",
            "short",
            [target(f"sum by ({by}) ({sel('pinpool_transfer_registrations')})", each, "A")],
            grid(0, y + 1, 12, 8),
        ),
        timeseries(
            "Bytes registered with transfer engines",
            "Bytes registered with each transfer registrar now (pinpool_transfer_registered_bytes), beside the bytes "
            "pinned (pinpool_pinned_bytes). Registration runs overlapped with pinning: a registrar's line far behind "
            "the pinned line means the engine's registration, not pinning, is the bottleneck, and a background pool "
            "offers only registered pages to the engine.",
            "bytes",
            [
                target(f"sum by ({by}) ({sel('pinpool_transfer_registered_bytes')})", each, "A"),
                target(f"sum by ({BY}) ({sel('pinpool_pinned_bytes')})", f"{EACH} pinned", "B"),
            ],
            grid(12, y + 1, 12, 8),
        ),
        timeseries(
            "Transfer registration latency (p50, p99)",
            "Duration of one registration call of each transfer registrar (pinpool_transfer_register_seconds): "
            "ibv_reg_mr under Mooncake's RDMA transports, ucp_mem_map under NIXL's UCX backend. Long calls are "
            "hidden under pinning while the registrar keeps up; see docs/metrics.md.",
            "s",
            [
                target(
                    f"histogram_quantile(0.5, sum by ({by}, le) ({rate('pinpool_transfer_register_seconds_bucket')}))",
                    f"{each} p50",
                    "A",
                ),
                target(
                    f"histogram_quantile(0.99, sum by ({by}, le) ({rate('pinpool_transfer_register_seconds_bucket')}))",
                    f"{each} p99",
                    "B",
                ),
            ],
            grid(0, y + 9, 12, 8),
        ),
        timeseries(
            "Transfer engine failures by op and reason",
            "Failed calls of transfer registrars per interval (pinpool_transfer_failures_total). op=register: the "
            "pool rolled back every registration of every registrar (alert PinpoolTransferRegistrationFailures); "
            "op=unregister: the registration may still be live with its engine. Check pinpool doctor's mooncake, "
            "nixl and rdma lines.",
            "short",
            [
                target(
                    f"sum by ({by}, op, reason) ({increase('pinpool_transfer_failures_total')})",
                    f"{each} {{{{op}}}} {{{{reason}}}}",
                    "A",
                )
            ],
            grid(12, y + 9, 12, 8),
            drawStyle="bars",
        ),
    ]


def elastic_panels(y: int) -> list[Json]:
    """Elastic pools (reserve=) and their policy loop (elastic=): what they reserve and pin, how they resize."""
    return [
        row("Elastic pool", y),
        timeseries(
            "Elastic pool: reserved and pinned bytes",
            "The most an elastic pool may pin (pinpool_reserved_bytes: its reservation) against what it pins now "
            "(pinpool_pinned_bytes): the gap is memory it gave back to the host, or never grew into. A pinned line "
            "that falls to the floor under pressure and climbs back when calm is the policy loop at work.",
            "bytes",
            [
                target(f"sum by ({BY}) ({sel('pinpool_reserved_bytes')})", f"{EACH} reserved", "A"),
                target(f"sum by ({BY}) ({sel('pinpool_pinned_bytes')})", f"{EACH} pinned", "B"),
            ],
            grid(0, y + 1, 12, 8),
        ),
        timeseries(
            "Elastic grows and shrinks by outcome",
            "Grows and shrinks per interval (pinpool_grows_total, pinpool_shrinks_total) by outcome: grown, shrunk; "
            "kept (nothing named was a whole segment), declined (the server gave nothing up); failed, cancelled, "
            "refused (read the pool.grow / pool.shrink and elastic.failed events). Bars below zero are shrinks.",
            "short",
            [
                target(
                    f"sum by ({BY}, outcome) ({increase('pinpool_grows_total')})", f"{EACH} grow {{{{outcome}}}}", "A"
                ),
                target(
                    f"-sum by ({BY}, outcome) ({increase('pinpool_shrinks_total')})",
                    f"{EACH} shrink {{{{outcome}}}}",
                    "B",
                ),
            ],
            grid(12, y + 1, 12, 8),
            drawStyle="bars",
        ),
        timeseries(
            "Memory pressure seen by the policy",
            "PSI memory 'some' avg10 as each pool's policy loop last read it (pinpool_memory_pressure_psi, percent), "
            "and the times per interval it was under pressure with nothing left to give back "
            "(pinpool_elastic_at_floor_total; alert PinpoolElasticPoolAtFloor).",
            "short",
            [
                target(f"max by ({BY}) ({sel('pinpool_memory_pressure_psi')})", f"{EACH} PSI some avg10 %", "A"),
                target(f"sum by ({BY}) ({increase('pinpool_elastic_at_floor_total')})", f"{EACH} at the floor", "B"),
            ],
            grid(0, y + 9, 12, 8),
        ),
        timeseries(
            "Shrink time, decision to memory back (p50, p99)",
            "From a shrink's decision (the policy's, or the server's call) to its pages given back to the host "
            "(pinpool_shrink_seconds), and the bytes given back per interval (pinpool_released_bytes_total).",
            "s",
            [
                target(quantile(0.5, "pinpool_shrink_seconds_bucket"), f"{EACH} p50", "A"),
                target(quantile(0.99, "pinpool_shrink_seconds_bucket"), f"{EACH} p99", "B"),
            ],
            grid(12, y + 9, 12, 8),
        ),
    ]


def panels() -> list[Json]:
    items = [
        stat(
            "Pools open",
            "Pools pinning or pinned now (pinpool_pools_open), per pool name, summed over the instances.",
            "short",
            [target(f"sum by (pool) ({sel('pinpool_pools_open')})", "{{pool}}", "A")],
            grid(0, 0, 6, 4),
        ),
        stat(
            "Pinned now",
            "Bytes pinned now (pinpool_pinned_bytes), per pool name, summed over the instances. Non-zero with no "
            "pool open means leaked pinned memory (an unregister failed).",
            "bytes",
            [target(f"sum by (pool) ({sel('pinpool_pinned_bytes')})", "{{pool}}", "A")],
            grid(6, 0, 6, 4),
        ),
        stat(
            "Target size of open pools",
            "Target size of the open pools (pinpool_pool_bytes), per pool name, summed over the instances.",
            "bytes",
            [target(f"sum by (pool) ({sel('pinpool_pool_bytes')})", "{{pool}}", "A")],
            grid(12, 0, 6, 4),
        ),
        stat(
            "Least-pinned instance",
            "Per pool name, the lowest pinned/target fraction of any instance's open pool: one rank of 64 that is "
            "stuck shows here (a sum over the ranks would hide it). Below 100% for long: find that instance in "
            "Pinned fraction per instance (alert PinpoolPoolBelowTarget).",
            "percentunit",
            [target(f"min by (pool) ({pinned_fraction()})", "{{pool}}", "A")],
            grid(18, 0, 6, 4),
        ),
        timeseries(
            "Pinned fraction per instance",
            "pinpool_pinned_bytes / pinpool_pool_bytes of each open pool, one line per instance and pool: it climbs "
            "to 100% while a pool pins and stays there while the pool is open. A line below the others for long: "
            "that instance's pinning is stuck (alert PinpoolPoolBelowTarget).",
            "percentunit",
            [target(pinned_fraction(), EACH, "A")],
            grid(0, 4, 12, 8),
        ),
        timeseries(
            "Pin throughput",
            "Bytes registered per second (rate of pinpool_registered_bytes_total) and bytes pre-faulted per second "
            "(rate of pinpool_populated_bytes_total). Faulting runs ahead of registration under CUDA and behind it "
            "under mlock's lock-on-fault; a gap that persists means one stage is the bottleneck "
            "(docs/operations.md#sizing-workers).",
            "Bps",
            [
                target(f"sum by ({BY}) ({rate('pinpool_registered_bytes_total')})", f"{EACH} registered", "A"),
                target(f"sum by ({BY}) ({rate('pinpool_populated_bytes_total')})", f"{EACH} pre-faulted", "B"),
            ],
            grid(12, 4, 12, 8),
        ),
        timeseries(
            "Chunk registration latency (p50, p99)",
            "Duration of one chunk's registration call (pinpool_chunk_register_seconds). Under CUDA it holds the "
            "driver lock: this is the serving stall. p99 above 5 s fires PinpoolSlowChunkRegistration; lower "
            "chunk_bytes= (docs/operations.md#sizing-chunks).",
            "s",
            [
                target(quantile(0.5, "pinpool_chunk_register_seconds_bucket"), f"{EACH} p50", "A"),
                target(quantile(0.99, "pinpool_chunk_register_seconds_bucket"), f"{EACH} p99", "B"),
            ],
            grid(0, 12, 12, 8),
        ),
        heatmap(
            "Chunk registration latency distribution",
            "Registrations per bucket of pinpool_chunk_register_seconds (all selected pools).",
            [
                target(
                    f"sum by (le) ({increase('pinpool_chunk_register_seconds_bucket')})",
                    "{{le}}",
                    "A",
                    format="heatmap",
                )
            ],
            grid(12, 12, 12, 8),
        ),
        timeseries(
            "Chunk failures by phase and reason",
            "Failed runtime calls per interval (pinpool_chunk_failures_total). phase=register/populate: the pinning "
            "rolled back; phase=unregister: memory may stay pinned until the process exits. See the reason in "
            "docs/operations.md#cuda-error-codes.",
            "short",
            [
                target(
                    f"sum by ({BY}, phase, reason) ({increase('pinpool_chunk_failures_total')})",
                    f"{EACH} {{{{phase}}}} {{{{reason}}}}",
                    "A",
                )
            ],
            grid(0, 20, 12, 8),
            drawStyle="bars",
        ),
        timeseries(
            "Rollbacks by cause",
            "Pinnings that ended before the pool was ready, per interval (pinpool_rollbacks_total): "
            "cause=failure after a failed chunk (the only one the alert pages on), cancelled after a cancel or "
            "timeout, exit when the body left or the process exited while a background pool pinned (a normal "
            "shutdown), collected when a pinning pool was dropped without being exited.",
            "short",
            [target(f"sum by ({BY}, cause) ({increase('pinpool_rollbacks_total')})", f"{EACH} {{{{cause}}}}", "A")],
            grid(12, 20, 12, 8),
            drawStyle="bars",
        ),
        timeseries(
            "In-flight runtime calls",
            "Populate, register and unregister calls in progress (pinpool_chunks_in_flight); at most the worker "
            "threads, 0 when idle. Stuck above 0 with no throughput: a call hangs in the driver or the kernel.",
            "short",
            [target(f"sum by ({BY}) ({sel('pinpool_chunks_in_flight')})", EACH, "A")],
            grid(0, 28, 12, 8),
        ),
        timeseries(
            "Pool pin / unpin duration (mean)",
            "Mean wall time of pinning (pinpool_pool_pin_seconds) and of unpinning (pinpool_pool_unpin_seconds) a "
            "whole pool, over the interval. Pools pin rarely: points appear only where one pinned or unpinned.",
            "s",
            [
                target(mean("pinpool_pool_pin_seconds"), f"{EACH} pin", "A"),
                target(mean("pinpool_pool_unpin_seconds"), f"{EACH} unpin", "B"),
            ],
            grid(12, 28, 12, 8),
            showPoints="always",
        ),
        timeseries(
            "Longest runtime call (the serving stall)",
            "Longest single register, populate and unregister call of each pool's pinning or unpinning so far "
            "(pinpool_call_seconds_max). Under CUDA a registration holds the driver lock and under mlock populate "
            "holds mmap_lock: a serving process stalls this long. Bound it with max_call_seconds= "
            "(docs/serving.md#choosing-a-stall-budget).",
            "s",
            [target(f"max by ({BY}, op) ({sel('pinpool_call_seconds_max')})", f"{EACH} {{{{op}}}}", "A")],
            grid(0, 36, 12, 8),
        ),
        timeseries(
            "Ready pools and node-pacing waits",
            "Pools fully pinned (pinpool_pools_ready; a pool pinning in the background is open, not ready), and the "
            "mean time pools waited for node pacing, by kind (pinpool_node_wait_seconds: slot, budget).",
            "short",
            [
                target(f"sum by ({BY}) ({sel('pinpool_pools_ready')})", f"{EACH} ready", "A"),
                target(
                    f"sum by ({BY}, kind) ({rate('pinpool_node_wait_seconds_sum')}) / "
                    f"sum by ({BY}, kind) ({rate('pinpool_node_wait_seconds_count')})",
                    f"{EACH} waited ({{{{kind}}}}), s",
                    "B",
                ),
            ],
            grid(12, 36, 12, 8),
        ),
        *transfer_panels(y=44),
        *elastic_panels(y=61),
    ]
    for number, panel in enumerate(items, start=1):
        panel["id"] = number
    return items


def dashboard() -> Json:
    return {
        "annotations": {"list": []},
        "description": "pinpool: pinned host-memory pools (sizes, pin throughput, registration stall, failures, "
        "rollbacks, transfer engines, elastic pools). Generated by dashboards/generate.py; do not edit by hand.",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [],
        "panels": panels(),
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["pinpool"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": "pinpool",
        "uid": "pinpool",
        "version": 1,
        "weekStart": "",
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is not what this writes")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"file to write or check (default {OUTPUT})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        try:
            current = args.output.read_text(encoding="utf-8")
        except FileNotFoundError:
            print(f"{args.output} does not exist: run python dashboards/generate.py", file=sys.stderr)
            return 1
        if current != text:
            diff = difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True), str(args.output), "generated"
            )
            sys.stderr.writelines(list(diff)[:60])
            print(
                f"\n{args.output} is out of date with dashboards/generate.py: run python dashboards/generate.py "
                "and commit the result (edit generate.py, never the JSON).",
                file=sys.stderr,
            )
            return 1
        print(f"{args.output} is up to date")
        return 0
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
