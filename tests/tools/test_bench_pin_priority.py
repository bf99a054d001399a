"""The pin-priority benchmark (benchmarks/bench_pin_priority.py) runs end to end.

Tiny sizes and few requests: this checks the harness (the example server as a child, the
load, the figures it reads back), not the speed. The figures are in docs/performance.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .. import preloaded
from ..conftest import needs_mlock
from ..depth import deep_only, depth

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_pin_priority.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return preloaded.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=600)


@needs_mlock
@depth
@pytest.mark.parametrize(
    "load",
    [pytest.param((), id="closed-loop"), pytest.param(("--rate", "200"), id="open-loop", marks=deep_only)],
)
def test_bench_reports_both_phases_and_the_pin_throughput(tmp_path: Path, load: tuple[str, ...]) -> None:
    out = tmp_path / "r.json"
    result = bench(
        "--size", "256MiB", "--reps", "1", "--warm-up", "0", "--requests", "40", "--concurrency", "4", *load,
        "--json", str(out), "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert [row["config"] for row in data["rows"]] == ["today", "default"]
    today, default = data["rows"]
    assert today["nices_while_pinning"] == [0] or today["pinning"]["n_median"] == 0  # seen only while pinning
    assert set(default["nices_while_pinning"]) <= {0, 10}
    for row in data["rows"]:
        assert row["ready"]["n_median"] == 40 and row["ready"]["p99_s_median"] > 0
        assert row["gbps_median"] > 0
    assert not data["failures"], data["failures"]  # every server exited 0 with VmLck 0
    assert "| today |" in result.stdout and "| default |" in result.stdout


def test_bench_help_and_bad_configurations() -> None:
    result = bench("--help")
    assert result.returncode == 0 and "--rate" in result.stdout and "--pin-nice" in result.stdout
    bad = bench("--configs", "nope", "--quiet")
    assert bad.returncode != 0 and "--configs: unknown ['nope']" in bad.stderr
