"""`pinpool bench` runs end to end (tiny sizes: this checks the harness, not the speed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pinpool import _bench

from .conftest import needs_mlock

MiB = 1 << 20


@needs_mlock
def test_bench_reports_every_configuration_and_writes_json_markdown_and_docs(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Perf\n\nintro\n\n{_bench.DOCS_START}\nold results\n{_bench.DOCS_END}\n\noutro\n")
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    result = subprocess.run(
        [sys.executable, "-m", "pinpool", "bench", "--size", "64MiB", "--runtime", "mlock", "--reps", "1",
         "--stall-chunk-sizes", "16MiB,64MiB", "--overhead-chunks", "100", "--overhead-reps", "1",
         "--json", str(out_json), "--markdown", str(out_md), "--write-docs", str(doc), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out_json.read_text())
    names = [row["config"] for row in data["throughput"]]
    assert names[0] == "pinpool default"
    assert {"sequential", "single call", "fault-then-register", "limit"} <= set(names)
    for row in data["throughput"]:
        assert row["pin_gbps_median"] > 0 and row["pin_gbps_min"] <= row["pin_gbps_median"] <= row["pin_gbps_max"]
    assert data["throughput"][0]["pinpool_speedup"] == pytest.approx(1.0)
    limit = next(r for r in data["throughput"] if r["config"] == "limit")
    assert limit["unpin_s_median"] is None  # nothing was locked, so there is no teardown
    assert [s["chunk_bytes"] for s in data["stalls"]] == [16 * MiB, 64 * MiB]  # explicit sizes are exact
    assert all(s["longest_register_s"] >= s["median_register_s"] > 0 for s in data["stalls"])
    assert data["overhead"][0]["chunks"] == 100 and data["overhead"][0]["bare_us_per_chunk"] > 0
    assert data["rss"]["pool"] == 64 * MiB and data["rss"]["hwm"] >= data["rss"]["pool"]
    markdown = out_md.read_text()
    assert "| pinpool default |" in markdown and "beyond the pool" in markdown
    text = doc.read_text()
    assert "old results" not in text and "| fault-then-register |" in text
    assert text.startswith("# Perf\n\nintro\n") and text.endswith("\n\noutro\n")


def test_bench_rejects_unknown_configurations() -> None:
    with pytest.raises(SystemExit, match="unknown"):
        _bench.Bench(64 * MiB, "mlock", 1, huge_pages=False, only=["nope"])
