"""The CPU-budget benchmark (benchmarks/bench_cpu_budget.py) runs end to end, on the host and, where
this process may make a cgroup (root on a host with a cpu controller), in one with a CPU quota.

A small pool and short phases: this checks the harness (the children, the cgroup, the figures),
not the speed. The figures are in docs/performance.md ("Serving under a CPU limit").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pinpool import _probe

from .. import preloaded
from ..conftest import needs_mlock
from ..depth import DEEP, depth

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cpu_budget.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return preloaded.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=600)


@depth
@needs_mlock
def test_bench_measures_both_configurations_with_and_without_a_quota(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    where = "both" if DEEP else "host"  # ./dev test: the host's two children; CI's deep step: the cgroup's too
    result = bench("--size", "256MiB", "--reps", "1", "--idle-seconds", "0.25", "--where", where, "--json", str(out))
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    cpus = len(os.sched_getaffinity(0))
    budget = _probe.probe_host(torch_build=False).cpu_budget
    places = data["places"]
    for where, place in places.items():
        runs = {run["config"]: run for run in place["runs"]}
        assert set(runs) == {"today", "default"}
        for run in runs.values():
            assert run["idle_n"] > 0 and run["pin_n"] >= 0 and run["pin_seconds"] > 0 and run["idle_p99_ms"] > 0
        assert runs["today"]["workers"][0] == min(cpus, 2)  # one per CPU (2 at most: 256 MiB, by size)
        if where == "cgroup":  # a 1-CPU quota: one worker, and the cgroup's counters were read
            assert runs["default"]["workers"][:2] == [1, 1] and runs["default"]["throttled"] is not None
        else:  # the budget less the CPU left to the server
            assert runs["default"]["workers"][0] == max(1, min(2, budget - 1))
        assert "| default |" in result.stdout
    assert "host" in places
    if DEEP:
        assert "cgroup" in places or "cgroup: skipped, cannot make a cgroup" in result.stdout


def test_bench_help() -> None:
    result = bench("--help")
    assert result.returncode == 0 and "--quota-cpus" in result.stdout and "--where" in result.stdout
