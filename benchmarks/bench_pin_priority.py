"""Does background pinning leave serving its CPU? The example server's /healthz while its pool pins.

    python benchmarks/bench_pin_priority.py                        # 4 GiB mlock pool, 3 reps (+1 warm-up)
    python benchmarks/bench_pin_priority.py --reps 5 --json out.json --markdown out.md
    python benchmarks/bench_pin_priority.py --rate 100 --requests 1000 --unloaded   # open loop, 100 req/s
    python benchmarks/bench_pin_priority.py --config "nice 19=--pin-nice 19" --config "one worker=..."
    python benchmarks/bench_pin_priority.py --help

Each run starts ``examples/kv_offload_server.py`` (uvicorn, a ``PinnedPool(..., background=True)``
entered in its lifespan) as a child process on loopback, with a ``--size`` mlock pool, and drives
``GET /healthz`` from this process (httpx, asyncio, keep-alive): closed loop by default
(``--concurrency`` clients, each sending its next request when the last is answered, as fast as
the two processes can go), or open loop with ``--rate`` (requests due on a fixed schedule, at
most ``--concurrency`` connections, each latency counted from when the request was due):

(a) **while the pool pins**: from the moment the port opens until a response says the pool is no
    longer pinning, so the whole pin runs under the same load in every configuration; a request
    counts if the server answered it while pinning (the body says ``state``). Each client's first
    request (its connection set-up) is left out;
(b) **after ready**: once ``/readyz`` answers 200 and a short settle, ``--requests`` requests.

With ``--unloaded``, each configuration also pins once with no load at all (a server nobody
talks to), for the pin throughput of an idle host.

Reported per configuration: /healthz p50 / p99 / max in each phase and the ratio p99 (a) / p99 (b)
of the same server, the pin throughput (pool bytes / ``pinpool_pool_pin_seconds_sum`` from the
server's ``/metrics``), the longest populate / register call (``pinpool_call_seconds_max``), and
the nice values of the server's threads seen while it pinned (from ``/proc/<pid>/task``).

Configurations: ``today`` (``--pin-nice 0``: the pin workers at the server's priority, as
before ``pin_nice`` existed) and ``default`` (no option: ``pin_nice="auto"``); ``--config NAME=ARGS``
adds others (ARGS: extra server arguments). They run interleaved, in alternating order (A B, B A,
...), so machine noise hits them alike; the first repetition warms fresh memory and is discarded.
The closed loop saturates a small host: the client (one Python process, the bottleneck) and the
server keep both CPUs busy, so whatever CPU pinning gets is taken from them, and the priority of
the pin workers decides the split. The open loop at a rate the server can sustain leaves CPU
idle, which pinning may use without taking any from serving. The server runs in this process's
session, so with Linux autogroups (``kernel.sched_autogroup_enabled``) server and client share one
CPU scheduling group, as the serving threads of one process do (``--session new`` separates
them). Benchmark code, not part of the package: pinpool's public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_memory import format_bytes, machine, publish

import pinpool

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "examples" / "kv_offload_server.py"
START_TIMEOUT = 120.0  # torch's import on a busy 2-core VM
READY_TIMEOUT = 300.0
PINNING_TIMEOUT = 300.0  # phase (a) ends when the pool is ready, or after this long
BUILTIN = {
    "today": ("--pin-nice 0", "pin workers at the server's priority (pin_nice=0: as before the option)"),
    "default": ("", 'no option: pin_nice="auto" (background pool: pin workers nicer)'),
}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) by the nearest-rank method."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def med(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(present) if present else None


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "—" if value is None or math.isnan(value) else format(value * scale, spec)


def _range(values: Sequence[float | None], spec: str, scale: float = 1.0) -> str:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return "—" if not present else f"{format(min(present) * scale, spec)}–{format(max(present) * scale, spec)}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric(text: str, name: str, **labels: str) -> float | None:
    """One sample of the Prometheus text ``text`` (None if absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            sample, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in sample for k, v in labels.items()):
                return float(value)
    return None


class Server:
    """The example server as a child process; its merged output is collected by a thread."""

    def __init__(self, script: Path, args: Sequence[str], *, new_session: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
            start_new_session=new_session,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_port(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n" + "\n".join(self.lines))
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            time.sleep(0.002)
        raise RuntimeError(f"the server did not listen within {START_TIMEOUT} s")

    def thread_nices(self) -> set[int]:
        """The nice value of every thread of the server now (field 19 of /proc/<pid>/task/<tid>/stat)."""
        found = set()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{self.proc.pid}/task/{tid}/stat") as stat:
                    found.add(int(stat.read().rsplit(")", 1)[1].split()[16]))
        return found

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._reader.join(timeout=5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return rc


@dataclass
class Config:
    name: str
    args: list[str]
    what: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    unloaded: list[dict[str, Any]] = field(default_factory=list)


async def drive(server: Server, requests: int, concurrency: int, rate: float) -> dict[str, Any]:
    """Phase (a) from the port opening, then phase (b) after ready; latencies in seconds."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    nices: set[int] = set()
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60.0) as client:
        load = Load(client, concurrency, rate)
        a_started = time.perf_counter()

        async def watch_nice() -> None:
            while not load.ready_seen and time.perf_counter() - a_started < PINNING_TIMEOUT:
                nices.update(server.thread_nices())
                await asyncio.sleep(0.05)

        pinning, _ = await asyncio.gather(load.run(until_ready=True), watch_nice())
        a_seconds = time.perf_counter() - a_started
        deadline = time.monotonic() + READY_TIMEOUT
        while (await client.get("/readyz")).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {READY_TIMEOUT} s")
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.5)  # settle: the pin workers are gone
        b_started = time.perf_counter()
        ready = await load.run(count=requests)
        b_seconds = time.perf_counter() - b_started
        text = (await client.get("/metrics")).text
    return {
        "pinning": summary(pinning, a_seconds),
        "ready": summary(ready, b_seconds),
        **pin_figures(text),
        "nices_while_pinning": sorted(nices),
    }


class Load:
    """GET /healthz, closed-loop (``rate`` 0: ``concurrency`` clients, each sending its next request
    when the last is answered) or open-loop (``rate`` requests per second on a fixed schedule, at
    most ``concurrency`` connections; a request's latency counts from when it was due, so waiting
    for a connection or for this process to run is included)."""

    def __init__(self, client: httpx.AsyncClient, concurrency: int, rate: float) -> None:
        self.client, self.concurrency, self.rate = client, concurrency, rate
        self.ready_seen = False

    async def _get(self, due: float, until_ready: bool) -> tuple[float, bool]:
        """Latency from ``due``, and whether the server answered it while pinning."""
        response = await self.client.get("/healthz")
        seconds = time.perf_counter() - due
        response.raise_for_status()
        pinning = response.json()["state"] == "pinning"
        if until_ready and not pinning:
            self.ready_seen = True
        return seconds, pinning

    async def run(self, *, until_ready: bool = False, count: int = 0) -> list[float]:
        """With ``until_ready``, until an answer says the pool no longer pins (latencies of the
        answers given while pinning); else ``count`` requests (every latency)."""
        self.ready_seen = False
        started = time.perf_counter()

        def more(sent: int) -> bool:
            if until_ready:
                return not self.ready_seen and time.perf_counter() - started < PINNING_TIMEOUT
            return sent < count

        kept: list[float] = []
        if self.rate <= 0:
            sent = [0]

            async def client_loop() -> None:
                first = True  # its connection's set-up: left out while pinning (the port just opened)
                while more(sent[0]):
                    sent[0] += 1
                    seconds, pinning = await self._get(time.perf_counter(), until_ready)
                    if (pinning or not until_ready) and not (first and until_ready):
                        kept.append(seconds)
                    first = False

            await asyncio.gather(*(client_loop() for _ in range(self.concurrency)))
            return kept
        tasks: list[asyncio.Task[tuple[float, bool]]] = []
        while more(len(tasks)):
            due = started + len(tasks) / self.rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._get(due, until_ready)))
        for seconds, pinning in await asyncio.gather(*tasks):
            if pinning or not until_ready:
                kept.append(seconds)
        return kept


LABELS = {"pool": "kv-offload", "runtime": "mlock"}


def pin_figures(metrics_text: str) -> dict[str, Any]:
    """The pool's pin time and longest calls, from the server's /metrics."""
    return {
        "pin_s": metric(metrics_text, "pinpool_pool_pin_seconds_sum", **LABELS),
        "call_max": {
            op: metric(metrics_text, "pinpool_call_seconds_max", op=op, **LABELS) for op in ("populate", "register")
        },
    }


async def unloaded(server: Server) -> dict[str, Any]:
    """No load: wait (polling /readyz every 50 ms) until the pool is ready; its pin figures."""
    async with httpx.AsyncClient(base_url=server.url, timeout=60.0) as client:
        deadline = time.monotonic() + READY_TIMEOUT
        while (await client.get("/readyz")).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready after {READY_TIMEOUT} s")
            await asyncio.sleep(0.05)
        return pin_figures((await client.get("/metrics")).text)


def summary(latencies: Sequence[float], seconds: float) -> dict[str, Any]:
    return {
        "n": len(latencies),
        "p50_s": percentile(latencies, 0.50),
        "p99_s": percentile(latencies, 0.99),
        "max_s": max(latencies) if latencies else math.nan,
        "rps": len(latencies) / seconds if seconds > 0 else math.nan,
        "latencies": list(latencies),
    }


def run_one(
    config: Config,
    script: Path,
    size: int,
    requests: int,
    concurrency: int,
    rate: float,
    *,
    loaded: bool = True,
    new_session: bool = False,
) -> dict[str, Any]:
    server = Server(script, ["--size", str(size), "--runtime", "mlock", *config.args], new_session=new_session)
    try:
        server.wait_port()
        result = asyncio.run(drive(server, requests, concurrency, rate) if loaded else unloaded(server))
    except BaseException:
        server.stop()
        print("\n".join(server.lines[-30:]), file=sys.stderr)
        raise
    rc = server.stop()
    locked = [line for line in server.lines if "shutdown VmLck=" in line]
    result["exit_status"] = rc
    result["vm_locked_after_exit"] = int(locked[-1].rsplit("=", 1)[1]) if locked else None
    result["gbps"] = size / result["pin_s"] / 1e9 if result["pin_s"] else None
    if loaded:
        a, b = result["pinning"], result["ready"]
        result["p99_ratio"] = a["p99_s"] / b["p99_s"] if a["n"] and b["p99_s"] > 0 else None
    return result


def rows(configs: Sequence[Config], baseline: str) -> list[dict[str, Any]]:
    base = next((c for c in configs if c.name == baseline), None)
    base_gbps = med([s["gbps"] for s in base.samples]) if base else None
    base_idle = med([s["gbps"] for s in base.unloaded]) if base else None
    out = []
    for config in configs:
        samples = config.samples
        gbps = [s["gbps"] for s in samples]
        row: dict[str, Any] = {"config": config.name, "what": config.what, "args": " ".join(config.args)}
        for phase in ("pinning", "ready"):
            row[phase] = {
                "n_median": med([s[phase]["n"] for s in samples]),
                "p50_s_median": med([s[phase]["p50_s"] for s in samples]),
                "p50_s": [s[phase]["p50_s"] for s in samples],
                "p99_s_median": med([s[phase]["p99_s"] for s in samples]),
                "p99_s": [s[phase]["p99_s"] for s in samples],
                "max_s_median": med([s[phase]["max_s"] for s in samples]),
                "rps_median": med([s[phase]["rps"] for s in samples]),
                "pooled_p99_s": percentile([x for s in samples for x in s[phase]["latencies"]], 0.99),
            }
        row["p99_ratio_median"] = med([s["p99_ratio"] for s in samples])
        # Every repetition's requests together: a p99 of a few hundred requests is their 3rd largest,
        # so the per-repetition ratio swings with single outliers; pooled, the tail is better resolved.
        pooled_ready = row["ready"]["pooled_p99_s"]
        row["pooled_p99_ratio"] = row["pinning"]["pooled_p99_s"] / pooled_ready if pooled_ready > 0 else None
        row["p99_ratio"] = [s["p99_ratio"] for s in samples]
        row["gbps_median"] = med(gbps)
        row["gbps"] = gbps
        row["gbps_vs_baseline"] = med(gbps) / base_gbps if med(gbps) is not None and base_gbps else None  # type: ignore[operator]
        # Paired: each repetition against the baseline's run of the same repetition (next to it in time).
        paired = [
            s["gbps"] / b["gbps"] if s["gbps"] and b["gbps"] else None
            for s, b in zip(samples, base.samples if base else [], strict=False)
        ]
        row["gbps_vs_baseline_paired"] = paired
        row["gbps_vs_baseline_paired_median"] = med(paired)
        row["pin_s_median"] = med([s["pin_s"] for s in samples])
        idle = [s["gbps"] for s in config.unloaded]
        row["unloaded_gbps_median"] = med(idle)
        row["unloaded_gbps"] = idle
        row["unloaded_gbps_vs_baseline"] = med(idle) / base_idle if med(idle) is not None and base_idle else None  # type: ignore[operator]
        row["call_max_s_median"] = {op: med([s["call_max"][op] for s in samples]) for op in ("populate", "register")}
        row["nices_while_pinning"] = sorted({n for s in samples for n in s["nices_while_pinning"]})
        out.append(row)
    return out


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"] + [f"| {' | '.join(r)} |" for r in body]


def load_words(result: dict[str, Any]) -> str:
    if result["rate"] > 0:
        return f"open loop at {result['rate']:g} requests/s (≤ {result['concurrency']} connections)"
    return f"closed loop at concurrency {result['concurrency']}"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Machine: {result['machine']}. Example server (uvicorn), {format_bytes(result['size'])} background mlock "
        f"pool; `GET /healthz` {load_words(result)} from one httpx client process on loopback"
        f"{' (the server in a session of its own)' if result['session'] == 'new' else ''}. "
        f"{result['reps']} interleaved repetitions (+{result.get('warm_up', 1)} warm-up discarded), "
        "medians with (min–max). "
        f"Run {result['date']}, {result['seconds']:.0f} s, pinpool {result['pinpool_version']}.",
        "",
    ]
    lines += _table(
        ["configuration", "/healthz while pinning: n, p50 / p99 ms", "after ready: p50 / p99 ms",
         "p99 pinning / ready (same server)", "pooled p99 ms: pinning / ready", "req/s pinning / ready", "pin GB/s",
         f"GB/s vs {result['baseline']} (paired per rep)",
         "longest call ms: populate / register", "thread nices"],
        [[r["config"],
          f"{_fmt(r['pinning']['n_median'], '.0f')}, {_fmt(r['pinning']['p50_s_median'], '.0f', 1e3)} / "
          f"{_fmt(r['pinning']['p99_s_median'], '.0f', 1e3)} ({_range(r['pinning']['p99_s'], '.0f', 1e3)})",
          f"{_fmt(r['ready']['p50_s_median'], '.0f', 1e3)} / {_fmt(r['ready']['p99_s_median'], '.0f', 1e3)} "
          f"({_range(r['ready']['p99_s'], '.0f', 1e3)})",
          f"{_fmt(r['p99_ratio_median'], '.2f')}× ({_range(r['p99_ratio'], '.2f')})",
          f"{_fmt(r['pinning']['pooled_p99_s'], '.0f', 1e3)} / {_fmt(r['ready']['pooled_p99_s'], '.0f', 1e3)} = "
          f"{_fmt(r['pooled_p99_ratio'], '.2f')}×",
          f"{_fmt(r['pinning']['rps_median'], '.0f')} / {_fmt(r['ready']['rps_median'], '.0f')}",
          f"{_fmt(r['gbps_median'], '.2f')} ({_range(r['gbps'], '.2f')})",
          _fmt(r["gbps_vs_baseline_paired_median"], ".2f")
          + (f"× ({_range(r['gbps_vs_baseline_paired'], '.2f')})" if r["gbps_vs_baseline_paired_median"] else ""),
          " / ".join(_fmt(r["call_max_s_median"][op], ".0f", 1e3) for op in ("populate", "register")),
          ", ".join(map(str, r["nices_while_pinning"]))]
         for r in result["rows"]],
    )  # fmt: skip
    if any(r["unloaded_gbps_median"] is not None for r in result["rows"]):
        lines += [
            "",
            "Pin throughput with no load (nobody talks to the server while it pins): "
            + "; ".join(
                f"{r['config']} {_fmt(r['unloaded_gbps_median'], '.2f')} GB/s ({_range(r['unloaded_gbps'], '.2f')}, "
                f"{_fmt(r['unloaded_gbps_vs_baseline'], '.2f')}× {result['baseline']})"
                for r in result["rows"]
            )
            + ".",
        ]
    if result["failures"]:
        lines += ["", f"**Runs with a non-zero exit or VmLck after exit**: {result['failures']}"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_pin_priority.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="4GiB", help="pool size (default 4GiB)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per phase (default 2000)")
    parser.add_argument(
        "--concurrency", type=int, default=32, help="clients in flight (closed loop) or connections (open loop); 32"
    )
    parser.add_argument(
        "--rate", type=float, default=0.0,
        help="0 (default): closed loop, each client sends its next request when answered; R > 0: open loop, R "
        "requests per second on a fixed schedule, latency counted from when each was due",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions (+ --warm-up, discarded)")
    parser.add_argument(
        "--warm-up", type=int, choices=(0, 1), default=1,
        help="discarded first repetitions: 1 (default) warms fresh memory; 0 for a quick check of the harness",
    )  # fmt: skip
    parser.add_argument("--configs", default="today,default", help=f"built-in configurations: {', '.join(BUILTIN)}")
    parser.add_argument(
        "--config", action="append", default=[], metavar="NAME=ARGS",
        help="another configuration: a name and the extra server arguments (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--unloaded", action="store_true", help="also pin once per configuration and repetition with no load"
    )
    parser.add_argument(
        "--session", choices=["same", "new"], default="same",
        help="same: the server in this process's session, so with Linux autogroups it shares one CPU scheduling "
        "group with the load generator (default); new: the server in a session of its own (setsid), as a service "
        "runs, and the load generator stands for remote clients",
    )  # fmt: skip
    parser.add_argument("--baseline", default="today", help="the configuration GB/s ratios refer to (today)")
    parser.add_argument("--server", default=str(SERVER), help="the server script (default: the example)")
    parser.add_argument("--json", default=None, help="write every sample and the summaries as JSON here")
    parser.add_argument("--markdown", default=None, help="write the markdown table here")
    parser.add_argument("--quiet", action="store_true", help="no per-run progress on stderr")
    parser.add_argument(
        "--report", default=None, metavar="JSON", help="print the tables of a run saved with --json; run nothing"
    )
    return parser


def report(path: str, args: argparse.Namespace) -> int:
    """Render the tables of a run saved with --json again (with this version's columns); nothing runs."""
    with open(path) as saved:
        result = json.load(saved)
    configs = []
    for name, samples in result["samples"].items():
        args_text, what = BUILTIN.get(name, ("", ""))
        configs.append(Config(name, shlex.split(args_text), what or name, samples,
                              result.get("unloaded_samples", {}).get(name, [])))  # fmt: skip
    for row in result["rows"]:  # the args of --config configurations are kept in the rows
        for config in configs:
            if config.name == row["config"]:
                config.args, config.what = shlex.split(row["args"]), row["what"]
    result.setdefault("rate", 0.0)
    result.setdefault("session", "same")
    result["rows"] = rows(configs, result["baseline"])
    text = markdown(result)
    publish(text, result, json_path=None, markdown_path=args.markdown)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.report:
        return report(args.report, args)
    size = pinpool.parse_size(args.size, what="--size")
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in BUILTIN]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; built-in: {list(BUILTIN)}")
    configs = [Config(n, shlex.split(BUILTIN[n][0]), BUILTIN[n][1]) for n in names]
    for spec in args.config:
        name, sep, extra = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--config {spec!r}: give NAME=ARGS")
        configs.append(Config(name.strip(), shlex.split(extra), extra.strip()))
    reps = max(1, args.reps)
    started = time.perf_counter()

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"bench: {line}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "reps": reps, "size": size,
        "requests": args.requests, "concurrency": args.concurrency, "rate": args.rate, "baseline": args.baseline,
        "session": args.session, "warm_up": args.warm_up,
        "pinpool_version": getattr(pinpool, "__version__", "?"), "failures": [],
    }  # fmt: skip
    progress(result["machine"])
    for rep in range(1 - args.warm_up, reps + 1):
        order = configs if rep % 2 == 0 else configs[::-1]
        for config in order:
            sample = run_one(
                config, Path(args.server), size, args.requests, args.concurrency, args.rate,
                new_session=args.session == "new",
            )  # fmt: skip
            if sample["exit_status"] != 0 or sample["vm_locked_after_exit"]:
                result["failures"].append((config.name, rep, sample["exit_status"], sample["vm_locked_after_exit"]))
            a, b = sample["pinning"], sample["ready"]
            progress(
                f"rep {rep}{' (warm-up)' if rep == 0 else ''} {config.name}: pinning n={a['n']} "
                f"p50 {_fmt(a['p50_s'], '.0f', 1e3)} p99 {_fmt(a['p99_s'], '.0f', 1e3)} ms; ready p50 "
                f"{_fmt(b['p50_s'], '.0f', 1e3)} p99 {_fmt(b['p99_s'], '.0f', 1e3)} ms; ratio "
                f"{_fmt(sample['p99_ratio'], '.2f')}; pin {_fmt(sample['pin_s'], '.2f')} s = "
                f"{_fmt(sample['gbps'], '.2f')} GB/s; nices {sample['nices_while_pinning']}"
            )
            if rep:
                config.samples.append(sample)
            if args.unloaded:
                idle = run_one(
                    config, Path(args.server), size, args.requests, args.concurrency, args.rate, loaded=False,
                    new_session=args.session == "new",
                )  # fmt: skip
                if idle["exit_status"] != 0 or idle["vm_locked_after_exit"]:
                    result["failures"].append((config.name, rep, idle["exit_status"], idle["vm_locked_after_exit"]))
                progress(f"rep {rep} {config.name} unloaded: pin {_fmt(idle['gbps'], '.2f')} GB/s")
                if rep:
                    config.unloaded.append(idle)
    result["rows"] = rows(configs, args.baseline)
    result["samples"] = {c.name: c.samples for c in configs}
    result["unloaded_samples"] = {c.name: c.unloaded for c in configs}
    result["seconds"] = time.perf_counter() - started
    text = markdown(result)
    publish(text, result, json_path=args.json, markdown_path=args.markdown)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except pinpool.PinpoolError as exc:
        print(f"bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
