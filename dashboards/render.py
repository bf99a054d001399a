#!/usr/bin/env python3
"""Draw the pinpool dashboard's panels from a real scrape, as an SVG for the docs (no Grafana needed).

    python dashboards/render.py                  rewrite docs/_static/dashboard.svg
    python dashboards/render.py --out FILE.svg   write elsewhere

What it does, all on this host: serves a fresh metrics registry on a loopback port, starts a real
Prometheus (the ``prometheus`` binary: Debian's ``prometheus`` package) that scrapes it every
200 ms into a temporary directory, pins a real mlock pool of ``--size`` (root, or an
RLIMIT_MEMLOCK above it), registered with a stand-in transfer registrar (``pinpool.testing.FakeRegistrar``),
holds it, unpins it, pins it again, then runs every query of the
stat and time-series panels of ``dashboards/pinpool.json`` (their own PromQL, the dashboard
variables as "all" and ``$__rate_interval`` as 1 s) through Prometheus's HTTP API, and draws
the answers where the dashboard puts the panels. The heatmap is not drawn. Standard library,
pinpool and prometheus_client only; nothing is written outside the temporary directory but the SVG.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "pinpool.json"
OUTPUT = HERE.parent / "docs" / "_static" / "dashboard.svg"
SCRAPE_SECONDS = 0.2
RATE_INTERVAL = "1s"  # $__rate_interval: several scrapes, as Grafana's is
DRAWN = ("stat", "timeseries")

Series = list[tuple[float, float]]  # (unix seconds, value)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def expression(expr: str) -> str:
    """A panel's PromQL with the dashboard's variables as "all"."""
    for name in ("job", "instance", "pool"):
        expr = expr.replace(f'=~"${name}"', '=~".+"')
    return expr.replace("$__rate_interval", RATE_INTERVAL)


def legend(template: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


class Prometheus:
    """A Prometheus scraping ``target`` into ``workdir``, queried over its HTTP API."""

    def __init__(self, workdir: Path, target: str) -> None:
        interval = f"{int(SCRAPE_SECONDS * 1000)}ms"
        config = workdir / "prometheus.yml"
        config.write_text(
            f"global: {{scrape_interval: {interval}, scrape_timeout: {interval}}}\n"
            f"scrape_configs:\n  - job_name: pinpool\n    static_configs: [{{targets: ['{target}']}}]\n"
            # A fixed instance name: the picture does not change with the port this run happened to get.
            "    relabel_configs: [{target_label: instance, replacement: 'host:9464'}]\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        command = [
            shutil.which("prometheus") or "prometheus", f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address={self.url[7:]}", "--log.level=warn",
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def api(self, path: str, **params: Any) -> Any:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
            return json.load(r)["data"]

    def wait_scraping(self, timeout: float = 60.0) -> None:
        """Until the target's first scrape succeeded: an event, polled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}: {self.process.stderr.read()}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                if any(t["health"] == "up" for t in self.api("targets")["activeTargets"]):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"prometheus did not scrape the pool's metrics within {timeout} s")

    def range(self, expr: str, start: float, end: float) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query_range", query=expr, start=start, end=end, step=SCRAPE_SECONDS)[
            "result"
        ]
        return result

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def scrape(size: str) -> tuple[dict[str, Any], float, float, float]:
    """Pin, hold, unpin and pin again a real mlock pool under a real Prometheus; every panel's query
    answers by panel title and target refId, the time range, and the moment the stats are read."""
    from prometheus_client import CollectorRegistry

    import pinpool
    import pinpool.metrics
    from pinpool.testing import FakeRegistrar

    if shutil.which("prometheus") is None:
        raise SystemExit("render.py: needs the prometheus binary on PATH (Debian: apt-get install prometheus)")
    dashboard = json.loads(DASHBOARD.read_text())
    registry, port = CollectorRegistry(), free_port()
    pinpool.metrics.serve(port, registry=registry)
    with tempfile.TemporaryDirectory(prefix="pinpool-render-") as workdir:
        prometheus = Prometheus(Path(workdir), f"127.0.0.1:{port}")
        try:
            prometheus.wait_scraping()
            start = time.time()
            time.sleep(1.0)  # a baseline: nothing open
            options = {"runtime": "mlock", "registry": registry, "name": "kv", "max_call_seconds": 0.05}
            # The transfer engine row: a stand-in registrar (no engine runs here), registering runs of 4 chunks.
            engine = {"registrars": [FakeRegistrar("engine", preferred_bytes=256 << 20, register_delay=0.002)]}
            with pinpool.PinnedPool(size=size, **options, **engine):
                time.sleep(2.0)  # held: what the stat row shows
                held = time.time() - 1.0
            time.sleep(1.0)
            with pinpool.PinnedPool(size=size, **options, **engine):
                time.sleep(1.0)
            # The elastic row: a pool of a quarter reserving the whole, grown by half, then shrunk to its floor.
            quarter = pinpool.parse_size(size) // 4
            with pinpool.PinnedPool(size=quarter, reserve=4 * quarter, grow_step=quarter, **options) as elastic:
                elastic.grow_sync(nbytes=2 * quarter)
                time.sleep(1.0)
                elastic.shrink_sync(to_pages=quarter)
                time.sleep(1.0)
            time.sleep(1.5)  # the last rates fall back to zero
            end = time.time()
            time.sleep(2 * SCRAPE_SECONDS)  # the last scrape is in
            answers = {
                (panel["title"], t["refId"]): prometheus.range(expression(t["expr"]), start, end)
                for panel in dashboard["panels"]
                if panel["type"] in DRAWN
                for t in panel["targets"]
            }
        finally:
            prometheus.close()
    return answers, start, end, held


# -- drawing: pure, from the answers -----------------------------------------------------------------

CELL, ROW, PAD = 40, 30, 6  # one of the dashboard's 24 columns, one grid row, in SVG units
COLORS = ("#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0")


def format_value(value: float, unit: str | None) -> str:
    if math.isnan(value):
        return "-"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    if unit in ("bytes", "Bps"):
        scaled, prefix = value, ""
        for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
            if abs(scaled) < 1024 or prefix == "Ti":
                break
            scaled /= 1024
        return f"{scaled:.3g} {prefix}B" + ("/s" if unit == "Bps" else "")
    if unit == "s":
        return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    return f"{value:.3g}"


def points(answer: dict[str, Any]) -> Series:
    return [(float(t), float(v)) for t, v in answer["values"]]


def runs(series: Series) -> list[Series]:
    """``series`` cut where a step is missing or a value is not finite."""
    out: list[Series] = []
    for t, v in series:
        if not math.isfinite(v):
            continue
        if out and out[-1] and t - out[-1][-1][0] < 1.5 * SCRAPE_SECONDS:
            out[-1].append((t, v))
        else:
            out.append([(t, v)])
    return out


def value_at(series: Series, moment: float) -> float:
    before = [v for t, v in series if t <= moment]
    return before[-1] if before else math.nan


def panel_box(panel: dict[str, Any]) -> tuple[float, float, float, float]:
    grid = panel["gridPos"]
    return grid["x"] * CELL + PAD, grid["y"] * ROW + PAD, grid["w"] * CELL - 2 * PAD, grid["h"] * ROW - 2 * PAD


def draw_stat(panel: dict[str, Any], answers: dict[Any, Any], held: float, unit: str | None) -> list[str]:
    x, y, w, h = panel_box(panel)
    values = [value_at(points(a), held) for t in panel["targets"] for a in answers[(panel["title"], t["refId"])]]
    shown = ", ".join(format_value(v, unit) for v in values) if values else "-"
    return [f'<text x="{x + w / 2}" y="{y + h / 2 + 14}" class="stat">{escape(shown)}</text>']


def draw_series(
    panel: dict[str, Any], answers: dict[Any, Any], start: float, end: float, unit: str | None
) -> list[str]:
    x, y, w, h = panel_box(panel)
    left, top, right, bottom = x + 58, y + 26, x + w - 8, y + h - 34
    lines = [
        (legend(t.get("legendFormat", ""), a["metric"]), points(a))
        for t in panel["targets"]
        for a in answers[(panel["title"], t["refId"])]
    ]
    finite = [v for _, series in lines for _, v in series if math.isfinite(v)]
    top_value = max([*finite, 0.0]) or 1.0
    if unit == "percentunit":
        top_value = max(top_value, 1.0)
    out = [f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" class="axis"/>']
    for fraction in (0.0, 0.5, 1.0):
        level = bottom - fraction * (bottom - top)
        out.append(f'<line x1="{left}" y1="{level:.1f}" x2="{right}" y2="{level:.1f}" class="grid"/>')
        out.append(
            f'<text x="{left - 4}" y="{level + 4:.1f}" class="tick">{format_value(fraction * top_value, unit)}</text>'
        )
    out.append(f'<text x="{left}" y="{bottom + 13}" class="time">0 s</text>')
    out.append(f'<text x="{right}" y="{bottom + 13}" class="time end">{end - start:.0f} s</text>')
    at = left
    for index, (name, series) in enumerate(lines):
        color = COLORS[index % len(COLORS)]
        for run in runs(series):  # a series that stops (its pool closed) is a gap, as in Grafana
            xs = (left + (t - start) / (end - start) * (right - left) for t, _ in run)
            ys = (bottom - v / top_value * (bottom - top) for _, v in run)
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in zip(xs, ys, strict=True))
            out.append(f'<polyline points="{path}" stroke="{color}" class="series"/>')
        out.append(f'<rect x="{at}" y="{bottom + 20}" width="10" height="3" fill="{color}"/>')
        out.append(f'<text x="{at + 14}" y="{bottom + 25}" class="legend">{escape(name)}</text>')
        at += 14 + 6 * len(name) + 12  # about 6 units a character at 10px
    if not lines:
        out.append(f'<text x="{(left + right) / 2}" y="{(top + bottom) / 2}" class="empty">No data</text>')
    return out


def render(dashboard: dict[str, Any], answers: dict[Any, Any], start: float, end: float, held: float) -> str:
    """The SVG of the dashboard's stat and time-series panels, laid out by their gridPos."""
    drawn = [p for p in dashboard["panels"] if p["type"] in DRAWN]
    width = 24 * CELL
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in drawn) * ROW
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        'font-family="Helvetica, Arial, sans-serif">',
        "<style>.panel{fill:#181b1f;stroke:#2c3235}.title{fill:#d8d9da;font-size:13px;font-weight:bold}"
        ".stat{fill:#73bf69;font-size:26px;text-anchor:middle}.axis{stroke:#464c54}.grid{stroke:#2c3235}"
        ".tick{fill:#8e8e8e;font-size:10px;text-anchor:end}.time{fill:#8e8e8e;font-size:10px}.end{text-anchor:end}"
        ".series{fill:none;stroke-width:1.6}.legend{fill:#c7d0d9;font-size:10px}"
        ".empty{fill:#8e8e8e;font-size:12px;text-anchor:middle}</style>",
        f'<rect width="{width}" height="{height}" fill="#111217"/>',
    ]
    for panel in drawn:
        x, y, w, h = panel_box(panel)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        out.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" class="panel"/>')
        out.append(f'<text x="{x + 8}" y="{y + 17}" class="title">{escape(panel["title"])}</text>')
        if panel["type"] == "stat":
            out.extend(draw_stat(panel, answers, held, unit))
        else:
            out.extend(draw_series(panel, answers, start, end, unit))
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUTPUT, help=f"the SVG to write (default: {OUTPUT})")
    parser.add_argument("--size", default="1GiB", help="the mlock pool to pin twice (default: 1GiB)")
    args = parser.parse_args(argv)
    answers, start, end, held = scrape(args.size)
    args.out.write_text(render(json.loads(DASHBOARD.read_text()), answers, start, end, held))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
