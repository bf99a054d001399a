"""Real signals at random moments to a child pinning a real mlock pool; its VmLck must end at 0.

Modes: the sync driver and trio with Ctrl-C (SIGINT once or twice), asyncio.run with Ctrl-C,
and asyncio with the common ``loop.add_signal_handler(SIGTERM, task.cancel)`` recipe (SIGTERM
once or twice). The child reports its VmLck after everything, whatever it caught.
``PINPOOL_SIGNAL_RUNS`` raises the runs per mode (CI runs the default).

Each mode's runs are forked from one process that has already imported what the child imports
before it says "ready" (pinpool, trio, torch: ~2 s of CPU), so a run costs a pin, not an
interpreter start; the child still ends through a normal interpreter exit, which a run must get
through too (a hang there was one of the bugs this test found).
"""

from __future__ import annotations

import json
import random
import signal
import sys
import textwrap

import pytest

from .. import preloaded
from ..conftest import needs_mlock
from ..depth import depth, runs

RUNS = runs(2, 3, "PINPOOL_SIGNAL_RUNS")

CHILD = textwrap.dedent(
    """
    import asyncio, signal, sys, time
    import pinpool, trio
    from pinpool._host import libc as _libc

    mode = sys.argv[1]
    pool = pinpool.PinnedPool(size="256MiB", chunk_bytes="8MiB", runtime="mlock", registry=None, unpin_workers=2)

    async def body_async(sleep):
        async with pool:
            await sleep(0.15)

    def run():
        if mode == "sync":
            with pool:
                time.sleep(0.15)
        elif mode == "trio":
            trio.run(body_async, trio.sleep)
        elif mode == "asyncio":
            asyncio.run(body_async(asyncio.sleep))
        else:  # asyncio-sigterm: the recipe servers use
            async def main():
                task = asyncio.current_task()
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
                await body_async(asyncio.sleep)
            asyncio.run(main())

    def report(caught):
        print("caught", ",".join(caught) or "-", "vmlck", _libc.vm_locked_bytes(), "state",
              pool.state.value, flush=True)

    print("ready", flush=True)
    caught = []
    try:
        try:
            run()
        except BaseException as exc:
            caught.append(type(exc).__name__)
        report(caught)  # at once: once asyncio.run has closed its loop, SIGTERM is deadly again
        time.sleep(0.05)  # a second signal may still arrive
    except BaseException as exc:
        caught.append(type(exc).__name__)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    report(caught)
    """
)


# Runs CHILD once per planned run in a fork of itself, after importing what CHILD imports before
# its "ready" (and building a pool, which imports torch). argv: mode, signal number, the plan
# (JSON: per run, the delay after "ready" and the delay of a second signal or null). The fork
# runs CHILD as __main__ and then exits the interpreter normally (SystemExit from the loop).
# Prints, as JSON, per run: the exit code (as subprocess gives it), stdout, stderr, timed_out.
SWEEP = textwrap.dedent(
    """
    import asyncio, gc, json, os, signal, sys, tempfile, time
    import pinpool, trio, torch
    from pinpool._host import libc as _libc

    mode, signum, plan = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    pinpool.PinnedPool(size="256MiB", chunk_bytes="8MiB", runtime="mlock", registry=None, unpin_workers=2)
    child_code = compile(sys.argv[4], "<child>", "exec")
    gc.freeze()  # the preloaded objects: a fork's collections (and its exit) leave their pages shared

    def exited(pid, flags=0):
        done, status = os.waitpid(pid, flags)
        return os.waitstatus_to_exitcode(status) if done else None

    runs = []
    for first, second in plan:
        out_r, out_w = os.pipe()
        err = tempfile.TemporaryFile("w+")
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(out_r)
            os.dup2(out_w, 1), os.dup2(err.fileno(), 2)
            sys.argv = ["-c", mode]
            exec(child_code, {"__name__": "__main__"})
            raise SystemExit(0)  # out of the loop: the interpreter's own exit, as a fresh child's
        os.close(out_w)
        out = os.fdopen(out_r)
        assert out.readline() == "ready\\n"
        time.sleep(first)
        os.kill(pid, signum)
        code = None
        if second is not None:
            time.sleep(second)
            code = exited(pid, os.WNOHANG)
            if code is None:
                os.kill(pid, signum)
        deadline = time.monotonic() + 60
        while code is None and time.monotonic() < deadline:
            code = exited(pid, os.WNOHANG)
            time.sleep(0.005)
        if code is None:
            os.kill(pid, signal.SIGKILL)
            exited(pid)
        err.seek(0)
        runs.append({"code": code, "out": out.read(), "err": err.read(), "timed_out": code is None})
        out.close(), err.close()
    print(json.dumps(runs))
    """
)


@depth
@needs_mlock
@pytest.mark.parametrize("mode", ["sync", "trio", "asyncio", "asyncio-sigterm"])
def test_real_signals_never_leave_memory_locked(mode: str) -> None:
    rng = random.Random(f"{mode}-signals")
    signum = signal.SIGTERM if mode == "asyncio-sigterm" else signal.SIGINT
    # Per run: when after "ready" (pinning, the body or the teardown) and, every other run, a
    # second signal soon after.
    plan = [(rng.uniform(0.0, 0.35), rng.uniform(0.0, 0.05) if run % 2 else None) for run in range(RUNS)]
    sweep = preloaded.run(
        [sys.executable, "-c", SWEEP, mode, str(int(signum)), json.dumps(plan), CHILD],
        capture_output=True, text=True, timeout=120 + 70 * RUNS,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr
    for run, child in enumerate(json.loads(sweep.stdout)):
        out, err = child["out"], child["err"]
        assert not child["timed_out"], (mode, run, "no exit within 60 s", out, err)
        reports = [line for line in out.splitlines() if line.startswith("caught ")]
        assert reports, (mode, run, child["code"], out, err)
        report = reports[0]
        # A second signal can land after the event loop has put back the default handlers (the
        # recipe's SIGTERM handler is removed when asyncio.run returns): it may then end the
        # child, as it would a server, but only after the report of its locked memory.
        late_kill = child["code"] == -signal.SIGTERM if mode == "asyncio-sigterm" else bool(run % 2)
        assert child["code"] == 0 or late_kill, (mode, run, child["code"], out, err)
        fields = report.split()
        assert fields[0] == "caught" and fields[2] == "vmlck", (report, err)
        assert int(fields[3]) == 0, f"{mode} run {run}: {report}\n{err}"
        assert fields[5] == "closed", report
        assert "LedgerError" not in err and "AssertionError" not in err, err
