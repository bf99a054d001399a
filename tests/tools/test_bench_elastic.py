"""The elastic-pool benchmark (benchmarks/bench_elastic.py) runs end to end: a serving thread while a segment
grows, and the policy loop giving the segment back after a pressure reading. A 64 MiB segment and one rep:
this checks the harness, not the speed. The figures are in docs/performance.md ("Growing while serving")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import preloaded
from ..conftest import needs_mlock

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_elastic.py"


@needs_mlock
def test_bench_measures_the_grow_under_serving_and_the_memory_back(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = ["--floor", "64MiB", "--step", "64MiB", "--reps", "1", "--idle-seconds", "0.2", "--json", str(out)]
    done = preloaded.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    (run,) = data["runs"]
    assert run["vmlck_fell_bytes"] == 64 << 20  # the segment came back, all of it
    assert run["grow_seconds"] > 0 and run["idle_p99_ms"] > 0 and run["grow_p99_ms"] >= 0
    assert run["samples"][0] > 10 and run["pressure_to_back_seconds"] < 30
    assert "median: serving p99 during a 64 MiB grow" in done.stdout
