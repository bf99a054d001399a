"""Process A of the two-process tests (test_two_processes.py): a pool registered with a real engine, served to
a peer in another process. Run as ``python serve_pool.py mooncake|nixl foreground|background``.

It prints (after ``A> ``: NIXL logs to stdout too) one JSON line when the pool is open (``peer``: the Mooncake
segment name, or the NIXL agent's metadata in hex) and then answers one JSON line per command line on stdin:

- ``{"op": "ready"}``: ``pages``: ``pool.pinned_pages``; the pages that became usable since the last ask are
  filled with random bytes first (A touches only usable pages, as a server does);
- ``{"op": "pieces", "start": a, "stop": b}``: ``pieces``: ``[offset, address, nbytes, sha256]`` of each piece
  of pages ``[a, b)`` (its bytes' digest now), or ``error``/``message`` (PoolStateError: not usable yet);
- ``{"op": "wait", "fraction": f}``: waits until that share of pages is usable (``wait_ready_sync``);
- ``{"op": "release"}``: in background mode, the registration of the pool's last chunk waits until this command
  (a gate in front of the real registrar), so the peer sees a pool that is usable only in part. Only the last:
  a held call holds its worker (and a serial registrar's every call), and the last chunk is pinned last, so
  the others are registered before it, or at most a worker's few chunks after it;
- ``{"op": "close"}``: closes the pool, then asks the engine to let go of every registration it had:
  ``held`` lists those the engine still held (its answer was not "not registered"); ``peer`` as above;
- ``{"op": "exit"}`` (or the end of stdin): closes the pool if it is open, and exits 0.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import threading
import uuid
from typing import Any

import torch

import pinpool
from pinpool import layouts
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar, TransferRegistrar

MiB = 1 << 20
LAYOUT = layouts.MHA("page_unified", 2, 16, 4, 32, torch.bfloat16, head_group_num=2)  # 16 KiB pages, in order
SIZE, CHUNK = 24 * MiB, MiB


class Gate:
    """The real registrar, with registrations at or past ``hold_from`` held until :meth:`open` (calls wait on
    pinpool's worker threads, as a slow engine's would)."""

    def __init__(self, inner: TransferRegistrar, hold_from: int | None) -> None:
        self.inner, self.name, self.limits = inner, inner.name, inner.limits
        self.hold_from, self.opened = hold_from, threading.Event()
        self.base, self.based = 0, threading.Event()  # the pool's address, known once open() returns

    def register(self, ptr: int, nbytes: int) -> object:
        if self.hold_from is not None:
            self.based.wait()
            if ptr - self.base >= self.hold_from:
                self.opened.wait()
        return self.inner.register(ptr, nbytes)

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        self.inner.unregister(ptr, nbytes, handle)


def main(engine_name: str, mode: str) -> None:
    if engine_name == "mooncake":
        from mooncake.engine import TransferEngine

        engine: Any = TransferEngine()
        assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        inner: TransferRegistrar = MooncakeRegistrar(engine, protocol="tcp")

        def peer() -> str:
            return f"127.0.0.1:{engine.get_rpc_port()}"

        def still_held(address: int, nbytes: int) -> bool:
            return bool(engine.unregister_memory(address) != -3)  # -3: ERR_ADDRESS_NOT_REGISTERED
    else:
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        engine = nixl_agent(f"pinpool-a-{uuid.uuid4().hex[:8]}", nixl_agent_config(backends=["UCX"]))
        inner = NixlRegistrar(engine)

        def peer() -> str:
            return bytes(engine.get_agent_metadata()).hex()

        def still_held(address: int, nbytes: int) -> bool:
            try:
                engine.deregister_memory(engine.get_reg_descs([(address, nbytes, 0, "")], "DRAM"))
            except Exception as exc:
                return type(exc).__name__ != "nixlNotFoundError"
            return True

    gate = Gate(inner, SIZE - CHUNK if mode == "background" else None)
    pool = pinpool.PinnedPool(
        layout=LAYOUT, size=SIZE, runtime="mlock", chunk_bytes=CHUNK, registrars=[gate], registry=None, name="served",
        background=mode == "background",
    )  # fmt: skip
    pool.open()  # background: returns once pinning has started, and registering waits for the gate's base
    gate.base = pool.data_ptr
    gate.based.set()
    filled = 0

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(f"A> {json.dumps(message)}\n")
        sys.stdout.flush()

    def pieces(start: int, stop: int) -> list[list[Any]]:
        return [
            [p.offset, p.address, p.nbytes, hashlib.sha256(ctypes.string_at(p.address, p.nbytes)).hexdigest()]
            for p in pool.transfer_pieces(gate, pages=range(start, stop))
        ]

    say({"event": "open", "peer": peer(), "num_pages": pool.num_pages, "page_bytes": pool.plan.page_bytes})
    held: list[tuple[int, int]] = []
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "ready":
            pages = pool.pinned_pages
            if pages > filled:
                for piece in pool.transfer_pieces(gate, pages=range(filled, pages)):
                    ctypes.memmove(piece.address, os.urandom(piece.nbytes), piece.nbytes)
                filled = pages
            say({"pages": pages, "peer": peer()})
        elif op == "pieces":
            try:
                say({"pieces": pieces(command["start"], command["stop"])})
            except pinpool.PoolStateError as exc:
                say({"error": type(exc).__name__, "message": str(exc)})
        elif op == "wait":
            say({"pages": pool.wait_ready_sync(fraction=command["fraction"], timeout=120)})
        elif op == "release":
            gate.opened.set()
            say({"released": True})
        elif op == "close":
            gate.opened.set()
            held = [(r.address, r.nbytes) for r in pool.transfer_registrations(gate)]
            pool.close()
            say({"state": pool.state.value, "had": len(held), "held": [a for a, n in held if still_held(a, n)],
                 "peer": peer()})  # fmt: skip
        elif op == "exit":
            break
        else:
            say({"error": "unknown", "message": f"unknown op {op!r}"})
    pool.close()  # a second close is a no-op
    # The pool is closed; the engine's own teardown is not under test, and costs: Mooncake's takes about a
    # second, and nixl-cu12 1.5.1 crashes a process that made an agent at exit (SIGSEGV in the libnl-route-3
    # its wheel carries, rtnl_tc_unregister from _dl_fini, unless Mooncake's package was imported first).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
