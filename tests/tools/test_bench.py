"""The benchmark harness (benchmarks/pin_throughput.py, run by ``./dev bench``) runs end to end.

Tiny sizes: this checks the harness, not the speed. It runs as ``./dev bench`` does, as a
script in a fresh process, since it is benchmark code outside the package.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pinpool import _cli

from .. import preloaded
from ..conftest import needs_mlock

MiB = 1 << 20
HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "pin_throughput.py"
DOCS_START, DOCS_END = "<!-- bench:start -->", "<!-- bench:end -->"  # the block docs/performance.md keeps


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return preloaded.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=300)


@needs_mlock
def test_bench_reports_every_configuration_and_writes_json_markdown_and_docs(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Perf\n\nintro\n\n{DOCS_START}\nold results\n{DOCS_END}\n\noutro\n")
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    result = bench(
        "--size", "64MiB", "--runtime", "mlock", "--reps", "1", "--stall-chunk-sizes", "16MiB,64MiB",
        "--overhead-chunks", "100", "--overhead-reps", "1", "--json", str(out_json), "--markdown", str(out_md),
        "--write-docs", str(doc), "--quiet",
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
    assert result.stdout.strip() == markdown.strip()  # the tables also go to stdout
    text = doc.read_text()
    assert "old results" not in text and "| fault-then-register |" in text
    assert text.startswith("# Perf\n\nintro\n") and text.endswith("\n\noutro\n")


def test_bench_rejects_unknown_configurations() -> None:
    result = bench("--size", "64MiB", "--runtime", "mlock", "--configs", "nope", "--quiet")
    assert result.returncode != 0
    assert "--configs: unknown ['nope']" in result.stderr and "'sequential'" in result.stderr


def test_bench_reports_bad_options_in_one_line() -> None:
    result = bench("--size", "lots", "--quiet")
    assert result.returncode == 2
    assert result.stderr.startswith("bench: ConfigError:") and "Traceback" not in result.stderr


def test_bench_help_runs_outside_the_package() -> None:
    result = bench("--help")
    assert result.returncode == 0, result.stderr
    assert "./dev bench" in result.stdout and "--write-docs" in result.stdout


def test_the_package_no_longer_carries_the_benchmark(capsys: pytest.CaptureFixture[str]) -> None:
    import pinpool

    assert not (Path(pinpool.__file__).parent / "_bench.py").exists()
    for argv in (["bench"], ["bench", "--size", "1GiB", "--runtime", "cuda"], ["bench", "--help"]):
        assert _cli.main(argv) == 2
        assert "./dev bench" in capsys.readouterr().err


def test_benchmark_code_uses_only_pinpools_public_api() -> None:
    """No ``pinpool._private`` import in benchmarks/: it must run against any installed pinpool."""
    for script in HARNESS.parent.glob("*.py"):
        source = script.read_text()
        assert not re.search(r"pinpool\._(?!_)", source), script.name  # pinpool.__file__ is public
        assert "from pinpool import _" not in source, script.name
