"""The transfer-registrar benchmark (benchmarks/bench_registrars.py) runs end to end: the timed stand-ins
against pinning, and the real engines (Mooncake, NIXL) reading a pool's pages and a plain buffer.

A 64 MiB pool and one rep: this checks the harness (every case measured, the engines' reads made and
counted), not the speed. The figures are in docs/performance.md ("Transfer engines (issue 35)").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .. import preloaded
from ..conftest import needs_mlock
from ..engines.conftest import MOONCAKE_MISSING, NIXL_MISSING

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_registrars.py"


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return preloaded.run([sys.executable, str(HARNESS), *args], capture_output=True, text=True, timeout=600)


@needs_mlock
@pytest.mark.skipif(bool(MOONCAKE_MISSING or NIXL_MISSING), reason=MOONCAKE_MISSING or NIXL_MISSING or "")
def test_bench_measures_the_overlap_and_both_engines_reads(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    result = bench(
        "--size", "64MiB", "--reps", "1", "--kinds", "device", "--seconds-per-gib", "0.05", "--engines",
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    (overlap,) = data["overlap"]
    assert overlap["kind"] == "device" and overlap["seconds_per_gib"] == 0.05
    assert set(overlap["median_seconds"]) == {
        "pin alone", "register alone", "pin + 1 registrar", "register alone, 2", "pin + 2 registrars"
    }  # fmt: skip
    assert all(seconds > 0 for seconds in overlap["median_seconds"].values())
    # 64 MiB at 0.05 s/GiB: registering alone sleeps about 3 ms in all, so the stand-in did run
    assert overlap["median_seconds"]["register alone"] >= 0.05 * 64 / 1024
    engines = {e["engine"].split()[0]: e for e in data["engines"]}
    assert set(engines) == {"Mooncake", "NIXL"}
    for e in engines.values():
        assert e["transport"] == "tcp"
        cases = {"plain buffer", "plain, the pool's registrations", "pinpool pool"}
        assert {name: len(runs) for name, runs in e["runs"].items()} == dict.fromkeys(cases, 1)
        assert set(e["median_bytes_per_second"]) == cases and min(e["median_bytes_per_second"].values()) > 0
        assert e["pieces"] == dict.fromkeys(cases, 1) and e["pool_registrations"] == 1  # 64 MiB: one chunk
        assert e["ratio"] > 0 and e["ratio_same_registrations"] > 0
    assert "| Mooncake tcp |" in result.stdout and "| NIXL UCX" in result.stdout


@pytest.mark.skipif(os.path.isdir("/sys/class/infiniband"), reason="this host has RDMA devices")
def test_bench_refuses_rdma_without_a_nic() -> None:
    result = bench("--size", "64MiB", "--kinds", "--engines", "mooncake", "--transport", "rdma")
    assert result.returncode != 0
    assert "no RDMA device in /sys/class/infiniband" in result.stderr


def test_bench_refuses_an_unknown_engine() -> None:
    result = bench("--kinds", "--engines", "gloo")
    assert result.returncode != 0 and "invalid choice: 'gloo'" in result.stderr
