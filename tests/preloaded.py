"""Python child processes forked from an interpreter that has imported torch already.

Dozens of tests run a script, an example or ``python -m pinpool`` as a real child process (real
signals, real exit codes, real interpreter exit, VmLck of their own). Each such child used to
spend about 2.5 s of CPU importing torch, most of the suite's time on a 2-core machine. Here
one *zygote* per test process imports torch once and forks a child per request: the child is a
real process whose file descriptors 0, 1 and 2 are the caller's pipes, which sets its own
argv, environment, working directory and session, then runs the script at the top level of
its interpreter, so an uncaught exception, ``sys.exit``, a signal, atexit handlers and
finalizers at interpreter exit behave exactly as in ``python script.py``. The zygote reaps it
and reports its exit status, which :class:`Child` returns like ``Popen``.

What differs from a fresh interpreter: torch (and nothing of pinpool's) is imported already,
and environment variables are set after that import (torch reads none that these tests set).
Commands that run python with options other than ``-u`` (``-X``, ``-W``, ``-I``, ...), and
tests about import time or what is imported, use ``subprocess`` directly. ``spawn`` and
``run`` fall back to ``subprocess`` for an argv that is not ``sys.executable`` + a script,
``-m`` or ``-c``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

ZYGOTE = r"""
import json, os, signal, socket, sys, threading
import torch  # the expensive import, once for every child
import gc
gc.freeze()  # torch's objects: a child's collections skip them (and its pages stay shared)

sock = socket.socket(fileno=int(sys.argv[1]))
send_lock = threading.Lock()


def send(message):
    with send_lock:
        sock.sendall((json.dumps(message) + "\n").encode())


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            if stopping.is_set():
                return
            started.wait(0.05)
            started.clear()
            continue
        send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


stopping, started = threading.Event(), threading.Event()
threading.Thread(target=reap, daemon=True).start()
buffer = b""
request = None
while request is None:
    message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
    if not message:
        stopping.set()
        os._exit(0)
    buffer += message
    while b"\n" in buffer and request is None:
        line, buffer = buffer.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            request = req
            break
        for fd in fds:
            os.close(fd)
        fds = []
        started.set()
        send({"started": req["id"], "pid": pid})

# The child: the caller's pipes as 0, 1, 2, then the command at this interpreter's top level.
sock.close()
for target, fd in enumerate(fds):
    os.dup2(fd, target)
for fd in set(fds):
    if fd > 2:
        os.close(fd)
if request["new_session"]:
    os.setsid()
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
if request["unbuffered"]:
    sys.stdout.reconfigure(write_through=True)
    sys.stderr.reconfigure(write_through=True)
extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
kind, target, args = request["kind"], request["target"], request["args"]
del json, socket, threading, send_lock, reap, stopping, started, buffer, fds, request, req, message, pid
if kind == "script":
    import runpy
    sys.argv = [target, *args]
    sys.path[:1] = [os.path.dirname(os.path.abspath(target)), *extra]
    runpy.run_path(target, run_name="__main__")
elif kind == "module":
    import runpy
    sys.argv = [target, *args]
    sys.path[:1] = [os.getcwd(), *extra]
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    sys.argv = ["-c", *args]
    sys.path[:1] = ["", *extra]
    exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


class _Zygote:
    """The preloaded interpreter of this test process, started on first use."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-c", ZYGOTE, str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.next_id = 0
        self.pids: dict[int, int] = {}
        self.codes: dict[int, int] = {}
        self.changed = threading.Condition()
        self.dead = False
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        stream = self.sock.makefile("rb")
        for line in stream:
            message = json.loads(line)
            with self.changed:
                if "started" in message:
                    self.pids[message["started"]] = message["pid"]
                else:
                    self.codes[message["exited"]] = message["code"]
                self.changed.notify_all()
        with self.changed:
            self.dead = True
            self.changed.notify_all()

    def fork(self, request: dict[str, Any], fds: Sequence[int]) -> int:
        with self.lock:
            self.next_id += 1
            request["id"] = ident = self.next_id
            socket.send_fds(self.sock, [(json.dumps(request) + "\n").encode()], list(fds))
        with self.changed:
            if not self.changed.wait_for(lambda: ident in self.pids or self.dead, timeout=60):
                raise RuntimeError("the preloaded interpreter did not fork within 60 s")
            if self.dead:
                raise RuntimeError("the preloaded interpreter is gone")
            return self.pids.pop(ident)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.changed:
            self.changed.wait_for(lambda: pid in self.codes or self.dead, timeout=timeout)
            if pid not in self.codes and self.dead:
                raise RuntimeError(f"the preloaded interpreter is gone; child {pid}'s exit is unknown")
            return self.codes.get(pid)


_zygote: _Zygote | None = None
_zygote_pid = 0  # the test process that started it (a forked test process needs its own)
_zygote_lock = threading.Lock()


def _the_zygote() -> _Zygote:
    global _zygote, _zygote_pid
    with _zygote_lock:
        if _zygote is None or _zygote.dead or _zygote_pid != os.getpid():
            _zygote, _zygote_pid = _Zygote(), os.getpid()
        return _zygote


def _parse(argv: Sequence[str]) -> tuple[str, str, list[str], bool] | None:
    """(kind, target, args, unbuffered) of ``python [-u] script|-m mod|-c code args``, or None."""
    if not argv or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        return None
    rest, unbuffered = list(argv[1:]), False
    while rest and rest[0] == "-u":
        rest.pop(0)
        unbuffered = True
    if not rest:
        return None
    if rest[0] == "-m" and len(rest) > 1:
        return "module", rest[1], rest[2:], unbuffered
    if rest[0] == "-c" and len(rest) > 1:
        return "code", rest[1], rest[2:], unbuffered
    if rest[0].startswith("-"):
        return None
    return "script", str(rest[0]), rest[1:], unbuffered


class Child:
    """A process forked from the zygote, with the part of ``Popen``'s interface tests use."""

    def __init__(
        self, argv: Sequence[str], *, cwd: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
        stdin: int | None = None, stdout: int | None = None, stderr: int | None = None, text: bool = False,
        start_new_session: bool = False,
    ) -> None:  # fmt: skip
        parsed = _parse(argv)
        if parsed is None:
            raise ValueError(f"not a python command the zygote runs: {argv!r}")
        kind, target, args, unbuffered = parsed
        self.args = list(argv)
        self.returncode: int | None = None
        ours: list[int] = []
        theirs: list[int] = []

        def pipe(kind_of: int | None, reading: bool) -> int | None:
            if kind_of == subprocess.PIPE:
                r, w = os.pipe()
                ours.append(w if reading else r)
                theirs.append(r if reading else w)
                return w if reading else r
            if kind_of == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDONLY if reading else os.O_WRONLY)
                theirs.append(fd)
                return None
            if kind_of is None:  # inherited, as Popen does
                theirs.append(os.dup(len(theirs)))
                return None
            raise ValueError(f"unsupported stream {kind_of!r}")

        in_fd = pipe(stdin if stdin is not None else subprocess.DEVNULL, reading=True)
        out_fd = pipe(stdout, reading=False)
        if stderr == subprocess.STDOUT:
            theirs.append(os.dup(theirs[1]))
            err_fd = None
        else:
            err_fd = pipe(stderr, reading=False)
        request = {
            "kind": kind, "target": target, "args": args, "unbuffered": unbuffered,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": dict(os.environ if env is None else env), "new_session": start_new_session,
        }  # fmt: skip
        try:
            self.pid = _the_zygote().fork(request, theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        mode = "" if text else "b"
        self.stdin: IO[Any] | None = open(in_fd, "w" + mode) if in_fd is not None else None
        self.stdout: IO[Any] | None = open(out_fd, "r" + mode) if out_fd is not None else None
        self.stderr: IO[Any] | None = open(err_fd, "r" + mode) if err_fd is not None else None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _the_zygote().exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = _the_zygote().exit_code(self.pid, timeout=timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        results: dict[str, Any] = {}

        def drain(name: str, stream: IO[Any] | None) -> None:
            if stream is not None:
                results[name] = stream.read()
                stream.close()

        threads = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
            if stream is not None and not stream.closed
        ]
        for thread in threads:
            thread.start()
        if self.stdin is not None and not self.stdin.closed:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("out"), results.get("err")

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.returncode is None:
            self.kill()
            self.wait(30)
        for stream in (self.stdin, self.stdout, self.stderr):
            if stream is not None:
                stream.close()


def spawn(argv: Sequence[str], **kwargs: Any) -> Child | subprocess.Popen[Any]:
    """``subprocess.Popen(argv, **kwargs)``, forked from the zygote when ``argv`` runs python."""
    if _parse(argv) is None or set(kwargs) - {"cwd", "env", "stdin", "stdout", "stderr", "text", "start_new_session"}:
        return subprocess.Popen(argv, **kwargs)
    return Child(argv, **kwargs)


def run(
    argv: Sequence[str], *, input: Any = None, capture_output: bool = False, timeout: float | None = None,
    check: bool = False, **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:  # fmt: skip
    """``subprocess.run``, forked from the zygote when ``argv`` runs python."""
    if capture_output:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with spawn(argv, **kwargs) as child:  # leaving reaps it (Popen's exit waits, Child's kills first)
        try:
            out, err = child.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            raise
    result = subprocess.CompletedProcess(list(argv), child.returncode or 0, out, err)
    if check:
        result.check_returncode()
    return result
