"""End to end: examples/kv_offload_server.py as a real process, on loopback, pinning real mlock pools.

Each test starts the server on a free port and polls it from the moment the port opens. The
503 of ``/readyz`` is observed without faking anything: the lifespan enters the pool with
``background=True`` (startup completes at once) and the server's default stall budget
(``--max-call-seconds 0.05``) keeps pinning from starving the event loop, so the port opens
~0.1 s into a 2 GiB pin that takes 1-4 s here. (Without the budget the port opened only once
the pool was ready, in 3 runs of 3: every mmap of the starting server waited for whole
populate calls holding the process's mmap_lock.) Shutdown is always a real SIGTERM/SIGINT; the
child logs ``kv_offload_server: shutdown VmLck=<bytes>`` after leaving the pool.

The pinning-failure case uses the example's ``--runtime fake-fail`` (a FakeRuntime whose third
registration fails, the last one in a pool of fewer): mlock pinning cannot be made to fail for
real in the background on a host where pinpool's pre-flight accepted the pool.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
import torch

import pinpool
from pinpool import layouts

from .. import preloaded
from ..conftest import needs_mlock

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "kv_offload_server.py"
GiB = 1 << 30
PAGE_BYTES = 512 << 10  # the example's default MHA page: 16 tokens x 8 layers x 8 heads x 128 x bf16 x K,V
START_TIMEOUT = 60.0  # torch's import and a pool on a busy 2-core VM
READY_TIMEOUT = 60.0
EXIT_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """The example server as a child process; its merged output is collected by a thread."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = preloaded.spawn(
            [sys.executable, str(EXAMPLE), "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_port(self) -> float:
        """Wait until the port accepts connections; returns when (monotonic)."""
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode} before listening")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return time.monotonic()
            time.sleep(0.005)
        raise AssertionError(f"the server did not listen within {START_TIMEOUT} s")

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, float]:
        """Send ``sig``; returns the exit status and how long the exit took."""
        self.client.close()
        sent = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=EXIT_TIMEOUT)
        self._reader.join(timeout=5)
        return rc, time.monotonic() - sent

    def logged_vmlck(self) -> int:
        found = [
            int(m.group(1))
            for line in self.lines
            if (m := re.fullmatch(r"kv_offload_server: shutdown VmLck=(\d+)", line))
        ]
        assert len(found) == 1, "no (or several) shutdown VmLck lines logged"
        return found[0]

    def child_vmlck(self) -> int:
        """The child's VmLck now, from /proc."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                if line.startswith("VmLck:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmLck")

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=EXIT_TIMEOUT)
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def server(*args: str) -> Iterator[Server]:
    """A running server, killed at the end if still alive; its output is printed if the test fails."""
    srv = Server(*args)
    try:
        yield srv
    except BaseException:
        with contextlib.suppress(Exception):
            srv.close()
        print(f"--- server output (exit status {srv.proc.returncode}) ---\n{srv.output}", file=sys.stderr)
        raise
    srv.close()


def first_readyz(srv: Server) -> httpx.Response:
    """The first /readyz answer, asked the moment the port opens."""
    srv.wait_port()
    return srv.client.get("/readyz")


def poll_until_not_503(srv: Server, on_pinning: object = None) -> tuple[httpx.Response, int]:
    """Poll /readyz every 10 ms until it stops answering 503; returns that answer and the 503 count."""
    seen_503 = 0
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        response = srv.client.get("/readyz")
        if response.status_code != 503:
            return response, seen_503
        seen_503 += 1
        if callable(on_pinning):
            on_pinning(response.json())
        time.sleep(0.01)
    raise AssertionError(f"/readyz still 503 after {READY_TIMEOUT} s")


def random_page(seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=generator).numpy().tobytes()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of the Prometheus text ``text``."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                return float(value)
    raise AssertionError(f"no sample {name} {labels} in /metrics")


@needs_mlock
def test_pin_serve_round_trip_metrics_then_sigterm_after_ready() -> None:
    with server("--size", "2GiB", "--runtime", "mlock") as srv:
        first = first_readyz(srv)
        assert first.status_code == 503, first.text  # the port opens ~0.1 s into a 1-3 s pin
        body = first.json()
        assert body["state"] == "pinning" and body["num_pages"] == 2 * GiB // PAGE_BYTES
        assert 0 <= body["pinned_pages"] < body["num_pages"] and 0 <= body["pinned_bytes"] < 2 * GiB
        num_pages = body["num_pages"]
        assert srv.client.get("/healthz").status_code == 200  # liveness while pinning

        last = srv.client.put(f"/pages/{num_pages - 1}", content=random_page(0))
        assert last.status_code == 409, last.text  # the last page is pinned last
        assert last.json()["pinned_pages"] < num_pages
        assert srv.client.get(f"/pages/{num_pages}").status_code == 404
        assert srv.client.put(f"/pages/{num_pages}", content=random_page(0)).status_code == 404

        early: list[int] = []  # pages used while the rest of the pool still pins

        def use_pinned_prefix(status: dict[str, int]) -> None:
            if status["pinned_pages"] > 0 and not early:
                data = random_page(1)
                put = srv.client.put("/pages/0", content=data)
                assert put.status_code == 200, put.text  # pages [0, pinned_pages) only grow
                assert srv.client.get("/pages/0").content == data
                early.append(status["pinned_pages"])

        ready, seen_503 = poll_until_not_503(srv, use_pinned_prefix)
        assert ready.status_code == 200, ready.text
        assert ready.json()["state"] == "ready"
        assert ready.json()["pinned_pages"] == num_pages and ready.json()["pinned_bytes"] == 2 * GiB
        print(f"503 x {seen_503 + 1} before 200; page 0 used at pinned_pages={early or 'never seen'}")
        assert srv.child_vmlck() >= 2 * GiB  # really locked

        pages = [0, 1, 1234, num_pages - 1]
        data = {i: random_page(100 + i) for i in pages}
        for i in pages:
            put = srv.client.put(f"/pages/{i}", content=data[i])
            assert put.status_code == 200 and put.json() == {"page": i, "bytes": PAGE_BYTES}, put.text
        for i in pages:
            got = srv.client.get(f"/pages/{i}")
            assert got.status_code == 200 and got.content == data[i], i
        assert srv.client.put("/pages/3", content=b"short").status_code == 400
        assert srv.client.put("/pages/3", content=random_page(3) + b"x").status_code == 400

        text = srv.client.get("/metrics").text
        labels = {"pool": "kv-offload", "runtime": "mlock"}
        assert metric(text, "pinpool_pinned_bytes", **labels) == 2 * GiB
        assert metric(text, "pinpool_pool_bytes", **labels) == 2 * GiB
        assert metric(text, "pinpool_pools_ready", **labels) == 1
        assert metric(text, "pinpool_pools_open", **labels) == 1
        assert metric(text, "pinpool_registered_bytes_total", **labels) == 2 * GiB
        assert metric(text, "pinpool_call_seconds_max", op="populate", **labels) > 0

        rc, took = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.output
        assert any("leaving the pool in state ready" in line for line in srv.lines), srv.output
        assert srv.logged_vmlck() == 0, srv.output
        assert took < 15, f"exit took {took:.1f} s"


@needs_mlock
def test_elastic_grows_for_a_write_past_its_pages_and_shows_it_in_metrics() -> None:
    """--elastic: the pool pins its floor, a write past its pinned pages is refused (409) and asks the policy
    for more; the loop grows a segment (the host is calm) and the write goes through; /metrics says so."""
    mib = 1 << 20
    with server("--size", "64MiB", "--elastic", "256MiB", "--grow-step", "64MiB", "--runtime", "mlock") as srv:
        srv.wait_port()
        ready, _ = poll_until_not_503(srv)
        assert ready.status_code == 200, ready.text
        floor, num_pages = ready.json()["pinned_pages"], ready.json()["num_pages"]
        assert (floor, num_pages) == (64 * mib // PAGE_BYTES, 256 * mib // PAGE_BYTES)
        data = random_page(7)
        first = srv.client.put(f"/pages/{floor + 10}", content=data)
        assert first.status_code == 409, first.text  # not pinned yet: the pool was asked to grow
        deadline = time.monotonic() + READY_TIMEOUT
        while (put := srv.client.put(f"/pages/{floor + 10}", content=data)).status_code == 409:
            assert time.monotonic() < deadline, put.text
            time.sleep(0.05)
        assert put.status_code == 200, put.text
        assert srv.client.get(f"/pages/{floor + 10}").content == data
        assert srv.client.get("/readyz").json()["pinned_pages"] >= floor + 64 * mib // PAGE_BYTES
        text = srv.client.get("/metrics").text
        labels = {"pool": "kv-offload", "runtime": "mlock"}
        assert metric(text, "pinpool_reserved_bytes", **labels) == 256 * mib
        assert metric(text, "pinpool_grows_total", outcome="grown", **labels) >= 1
        assert srv.child_vmlck() >= 128 * mib
        rc, _took = srv.stop(signal.SIGTERM)
        assert rc == 0 and srv.logged_vmlck() == 0, srv.output


@needs_mlock
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_while_pinning_exits_promptly_with_nothing_locked(sig: int) -> None:
    with server("--size", "2GiB", "--runtime", "mlock") as srv:
        first = first_readyz(srv)
        assert first.status_code == 503 and first.json()["state"] == "pinning", first.text
        rc, took = srv.stop(sig)
        assert rc == 0, srv.output
        assert any("leaving the pool in state pinning" in line for line in srv.lines), srv.output
        assert srv.logged_vmlck() == 0, srv.output
        assert took < 10, f"exit took {took:.1f} s"
        print(f"{signal.Signals(sig).name} while pinning: exit 0 after {took:.2f} s")


def test_background_failure_answers_500_keeps_the_pinned_pages_for_reads_and_takes_no_new_data() -> None:
    with server("--size", "2GiB", "--runtime", "fake-fail") as srv:
        first = first_readyz(srv)
        assert first.status_code in (503, 500), first.text  # the third registration fails ~0.4 s in
        failed, _ = poll_until_not_503(srv)
        assert failed.status_code == 500, failed.text
        body = failed.json()
        assert body["state"] == "failed" and body["pinned_bytes"] > 0 and body["pinned_pages"] >= 0
        assert "injected failure (FakeRuntime register call #3)" in body["error"]
        assert "stay pinned" in body["error"] and "rolled back" not in body["error"]
        assert srv.client.get("/healthz").status_code == 200  # alive, not ready
        refused = srv.client.put("/pages/0", content=random_page(0))
        assert refused.status_code == 503 and "pinning failed" in refused.json()["error"]
        last = body["num_pages"] - 1
        assert srv.client.get(f"/pages/{last}").status_code == 503  # never pinned: not served
        if body["pinned_pages"]:
            assert srv.client.get("/pages/0").status_code == 200  # draining: pinned pages are still read
        text = srv.client.get("/metrics").text
        labels = {"pool": "kv-offload", "runtime": "fake"}
        assert metric(text, "pinpool_rollbacks_total", cause="failure", **labels) == 1
        assert metric(text, "pinpool_chunk_failures_total", phase="register", **labels) == 1
        # The failed pool is open until shutdown: what it pinned is still pinned, and counted.
        assert metric(text, "pinpool_pinned_bytes", **labels) == body["pinned_bytes"]
        rc, _ = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.output
        assert any("pinning failed after" in line for line in srv.lines), srv.output
        assert srv.logged_vmlck() == 0, srv.output


@pytest.mark.parametrize("size", ["256MiB", "512MiB"])
def test_fake_fail_fails_a_small_pool_too(size: str) -> None:
    """It failed the third 256 MiB registration, so a pool of 512 MiB or less reported ready."""
    with server("--size", size, "--runtime", "fake-fail") as srv:
        srv.wait_port()
        failed, _ = poll_until_not_503(srv)
        assert failed.status_code == 500, failed.text
        body = failed.json()
        assert body["state"] == "failed" and "injected failure (FakeRuntime register call #" in body["error"]
        assert body["pinned_bytes"] < body["num_pages"] * PAGE_BYTES  # never the whole pool
        rc, _ = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.output
        assert srv.logged_vmlck() == 0, srv.output


# docs/serving.md's lifespan pattern under plain uvicorn.run, with and without handlers of its own.
PLAIN_UVICORN = r"""
import signal, sys
from contextlib import asynccontextmanager
import uvicorn
from starlette.applications import Starlette
import pinpool
from pinpool.testing import FakeRuntime

fake = FakeRuntime()

@asynccontextmanager
async def lifespan(app):
    async with pinpool.PinnedPool(size="16MiB", runtime=fake, background=True, registry=None) as pool:
        yield
    print(f"left the pool: {pool.state.value}, registered {fake.registered}", file=sys.stderr, flush=True)

if sys.argv[1] == "handlers":
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: print("handled", file=sys.stderr, flush=True))
uvicorn.run(Starlette(lifespan=lifespan), host="127.0.0.1", port=0)
"""


@pytest.mark.parametrize(("handlers", "status"), [("none", -signal.SIGTERM), ("handlers", 0)])
def test_the_lifespan_pattern_under_plain_uvicorn_exits_143_on_sigterm_unless_it_has_handlers(
    handlers: str, status: int
) -> None:
    """What docs/serving.md says: a clean shutdown either way; the status is 143 (killed by the SIGTERM
    uvicorn raises again after it) unless the process installed handlers of its own before uvicorn."""
    with preloaded.spawn(
        [sys.executable, "-c", PLAIN_UVICORN, handlers], stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
    ) as proc:  # fmt: skip
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # until the lifespan has entered the pool: an event, not a delay
            lines.append(line)
            if "Application startup complete" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=EXIT_TIMEOUT) == status, "".join(lines) + rest
    assert "left the pool: closed, registered {}" in rest and "Traceback" not in rest, rest


# The example's app over a shared region that another process truncates while the pool pins (before
# the 5th pre-fault: pages of the first chunks were pinned). Draining used to serve page 0 from
# memory that was gone: SIGBUS, the server died (rc -7).
DRAIN_TRUNCATED = r"""
import importlib.util, json, os, sys, time
import torch
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient
import pinpool
from pinpool import layouts
from pinpool._host import mapping as host_mapping

spec = importlib.util.spec_from_file_location("kv_offload_server", sys.argv[1])
example = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = example
spec.loader.exec_module(example)
path = sys.argv[2]
real, calls = host_mapping.populate_range, [0]


def populate_range(ptr, nbytes, advice):
    calls[0] += 1
    if calls[0] == 5:
        os.truncate(path, 0)  # another process
    real(ptr, nbytes, advice)


host_mapping.populate_range = populate_range
registry = CollectorRegistry()
pool = pinpool.PinnedPool(
    layout=layouts.MHA("page_first", 2, 16, 2, 64, torch.bfloat16), size="16MiB", chunk_bytes="1MiB",
    runtime="mlock", memory=pinpool.SharedMemory(path), background=True, populate_workers=1, max_retries=0,
    registry=registry, name="kv-offload",
)
with TestClient(example.create_app(pool, registry, torch.device("cpu"))) as client:
    deadline = time.monotonic() + 60
    while (ready := client.get("/readyz")).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.01)
    page = client.get("/pages/0")
    print(json.dumps({"ready": ready.status_code, "status": ready.json(), "page": page.status_code,
                      "body": page.json()}), flush=True)
"""


@needs_mlock
def test_a_failed_pool_whose_shared_memory_is_gone_serves_no_page_while_draining() -> None:
    """Issue 33, finding 5: the drain path serves pages below pinned_pages; once the memory is gone
    (MemoryGoneError) there are none, so page 0 is refused (503), not read (SIGBUS)."""
    directory = Path("/dev/shm") / f"pinpool-test-kv-{os.getpid()}"
    directory.mkdir(mode=0o700)
    try:
        done = preloaded.run(
            [sys.executable, "-c", DRAIN_TRUNCATED, str(EXAMPLE), str(directory / "kv")],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    finally:
        for leftover in directory.iterdir():
            leftover.unlink()
        directory.rmdir()
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["ready"] == 500 and report["status"]["state"] == "failed"
    assert report["status"]["pinned_pages"] == 0
    assert "no page of the pool may be touched" in report["status"]["error"]
    assert report["page"] == 503
    assert "another process truncated or resized it" in report["body"]["error"]


@needs_mlock
def test_trio_hypercorn_pin_round_trip_sigterm() -> None:
    pytest.importorskip("hypercorn")
    pytest.importorskip("trio")
    with server("--size", "2GiB", "--runtime", "mlock", "--trio") as srv:
        first = first_readyz(srv)
        assert first.status_code == 503, first.text
        ready, _ = poll_until_not_503(srv)
        assert ready.status_code == 200, ready.text
        data = random_page(7)
        assert srv.client.put("/pages/42", content=data).status_code == 200
        assert srv.client.get("/pages/42").content == data
        assert metric(srv.client.get("/metrics").text, "pinpool_pools_ready", pool="kv-offload") == 1
        rc, _ = srv.stop(signal.SIGTERM)
        assert rc == 0, srv.output
        assert srv.logged_vmlck() == 0, srv.output


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    """The example server run to its end (it never gets to serve): exit status and stderr."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return preloaded.run(  # type: ignore[no-any-return]
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, env=env, cwd=ROOT,
        timeout=START_TIMEOUT,
    )  # fmt: skip


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_a_bad_port_is_one_line_and_exit_2(port: str) -> None:
    """Issue 23, finding 13: ``--port 99999`` printed bind()'s OverflowError traceback (exit 1)."""
    done = run_example("--port", port, "--runtime", "mlock", "--size", "8MiB")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [f"kv_offload_server.py: error: argument --port: {port!r} is not a TCP port: give 1-65535 "
                      "(0: any free port)"], done.stderr  # fmt: skip


@pytest.mark.parametrize("serve", ["uvicorn", "trio"])
def test_a_pool_the_pre_flight_refuses_in_the_lifespan_is_one_line_and_exit_3(serve: str) -> None:
    """Issue 23, finding 13: a pre-flight ConfigError on entering the pool (a pool larger than the
    host's memory) printed the lifespan's traceback; now one line naming the value and the fix."""
    if serve == "trio":
        pytest.importorskip("hypercorn")
        pytest.importorskip("trio")
    with open("/proc/meminfo") as meminfo:
        total_kib = int(meminfo.readline().split()[1])
    size = f"{(total_kib >> 20) * 4 + 4}GiB"  # four times the host's memory: refused on entry, not at construction
    done = run_example("--port", "0", "--runtime", "mlock", "--size", size, *(["--trio"] if serve == "trio" else []))
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and "ConfigError" not in done.stderr, done.stderr
    refusals = [line for line in done.stderr.splitlines() if line.startswith("kv_offload_server: cannot start: ")]
    assert len(refusals) == 1, done.stderr
    assert f"size={int(size[:-3]) << 30} B" in refusals[0] and "Give a smaller size" in refusals[0], refusals[0]


@needs_mlock
@pytest.mark.parametrize("serve", ["uvicorn", "trio"])
def test_sigterm_with_a_client_stalled_mid_upload_shuts_down_cleanly(serve: str) -> None:
    # The stalled upload's handler waited for the rest of its body until the graceful timeout (5 s), then
    # uvicorn cancelled it and printed "Exception in ASGI application" with a traceback (hypercorn dropped
    # the connection without an answer); now it answers 503 as soon as the shutdown begins.
    if serve == "trio":
        pytest.importorskip("hypercorn")
        pytest.importorskip("trio")
    with server("--size", "256MiB", "--runtime", "mlock", *(["--trio"] if serve == "trio" else [])) as srv:
        srv.wait_port()
        ready, _ = poll_until_not_503(srv)
        assert ready.status_code == 200, ready.text
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as stalled:
            stalled.sendall(f"PUT /pages/0 HTTP/1.1\r\nHost: x\r\nContent-Length: {PAGE_BYTES}\r\n\r\n".encode()
                            + random_page(0)[:1000])  # fmt: skip
            time.sleep(0.3)  # the handler waits for the rest of the body
            rc, _ = srv.stop(signal.SIGTERM)
            answer = stalled.recv(65536).decode(errors="replace")
        assert rc == 0, srv.output
        assert "Traceback" not in srv.output and "Exception in ASGI" not in srv.output, srv.output
        assert "timeout graceful shutdown exceeded" not in srv.output, srv.output
        assert srv.logged_vmlck() == 0, srv.output
        assert answer.startswith("HTTP/1.1 503") and "the server is shutting down" in answer, answer
        # The graceful timeout (5 s) was not waited out: uvicorn says so when it is (asserted above), where
        # an exit-time bound (took < 4) measured the host's load as much.


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """The example, imported as a module (its dataclasses need it in sys.modules)."""
    spec = importlib.util.spec_from_file_location("kv_offload_server", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize("kv_layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_page_bytes_are_the_layouts_page(example: ModuleType, kv_layout: str) -> None:
    """The server's page i is the layout's page i: K's then V's slice, every layer."""
    L, P, H, D = 3, 4, 2, 8
    layout = layouts.MHA(kv_layout, layer_num=L, page_size=P, head_num=H, head_dim=D, dtype=torch.bfloat16)
    pool = pinpool.PinnedPool(
        layout=layout, size=layout.page_bytes * 5, runtime=pinpool.testing.FakeRuntime(), registry=None
    )
    with pool:
        kv = example.KVOffload(pool, torch.device("cpu"))
        data = {i: bytes((i * 7 + k) % 256 for k in range(pool.plan.page_bytes)) for i in range(pool.num_pages)}
        for i in range(pool.num_pages):
            kv.put(i, bytearray(data[i]))
        t = pool.tensors["kv"]
        for i in range(pool.num_pages):
            if kv_layout == "page_first":  # (2, pages*P, L, H, D)
                page = t[:, i * P : (i + 1) * P]
            elif kv_layout == "layer_first":  # (2, L, pages*P, H, D)
                page = t[:, :, i * P : (i + 1) * P]
            else:  # (2, pages, ...)
                page = t[:, i]
            assert page.contiguous().view(torch.uint8).numpy().tobytes() == data[i]
            assert kv.get(i) == data[i]


def _request(receive: Any) -> Any:
    from starlette.requests import Request

    return Request({"type": "http", "method": "PUT", "path": "/pages/0", "headers": []}, receive)


def test_read_body_answers_a_stalled_upload(example: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """A body that stops coming: 503 once the server is stopping, 408 past BODY_SECONDS; a client that
    goes away gets no answer (499); a body that arrives whole, in parts, is returned."""

    def client(*messages: dict[str, Any]) -> Any:
        sent = list(messages)

        async def receive() -> dict[str, Any]:
            if sent:
                return sent.pop(0)
            await anyio.sleep_forever()  # stalled
            raise AssertionError

        return receive

    part = {"type": "http.request", "body": b"ab", "more_body": True}
    stopping = example.Stopping()

    async def read(receive: Any, limit: int = 4) -> Any:
        return await example.read_body(_request(receive), limit, stopping)

    last = {"type": "http.request", "body": b"cd", "more_body": False}
    assert anyio.run(read, client(part, last)) == bytearray(b"abcd")
    assert anyio.run(read, client(part, part, part), 3) == bytearray(b"abab")  # stops past the limit
    assert anyio.run(read, client(part, {"type": "http.disconnect"})).status_code == 499
    monkeypatch.setattr(example, "BODY_SECONDS", 0.25)
    started = time.monotonic()
    late = anyio.run(read, client(part))
    assert late.status_code == 408 and late.headers["connection"] == "close"
    assert json.loads(late.body) == {"error": "the body did not arrive within 0.25 s", "got": 2}
    assert 0.25 <= time.monotonic() - started < 2
    monkeypatch.setattr(example, "BODY_SECONDS", 60.0)

    async def stop_soon() -> Any:
        results = []

        async def reader() -> None:
            results.append(await read(client(part)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await anyio.sleep(0.15)
            stopping.requested = True  # as the server's signal handler does
        return results[0]

    started = time.monotonic()
    stopped = anyio.run(stop_soon)
    assert stopped.status_code == 503 and stopped.headers["connection"] == "close"
    assert json.loads(stopped.body) == {"error": "the server is shutting down", "got": 2}
    assert time.monotonic() - started < 30  # answered when the stop was seen, not after BODY_SECONDS (60 s)
