"""The transfer engine of examples/kv_offload_server.py (``--transfer-engine mooncake|nixl``): the server's
pool is registered with it (pinpool's registrar, from the pool's own plan), and a peer reads and writes the
pool's pages with its own engine, addressing them by the pieces ``GET /transfer`` answers.

Loaded by the server only when ``--transfer-engine`` is given, so the server runs without either engine
installed: ``pip install mooncake-transfer-engine-non-cuda`` (it links Debian's ``libibverbs1`` even for TCP)
or ``pip install nixl-cu12``.
"""

from __future__ import annotations

import base64
import os
import threading
import uuid
from typing import Any

import pinpool
from pinpool.registrars import MooncakeRegistrar, NixlRegistrar, TransferPiece, TransferRegistrar


class EngineError(Exception):
    """The transfer engine cannot start here: said in one line, exit 2 (as a bad option)."""


class HeldRegistrar:
    """TESTING AID, not for production (``--transfer-hold-last``): the engine's registration of the pool's last
    bytes waits until the server gets SIGUSR1 or begins to shut down, so a peer sees the pool usable in part
    for as long as a test needs. Only the last: a held call holds its registrar thread, and the last chunk
    is pinned last, so every other registration is made before it."""

    def __init__(self, inner: TransferRegistrar) -> None:
        self.inner, self.name, self.limits = inner, inner.name, inner.limits
        self.hold_from: int | None = None  # the last registration's offset in the pool (from its plan)
        self.base: int | None = None  # the pool's address, once the lifespan has entered it
        self.based, self.released = threading.Event(), threading.Event()

    def opened(self, pool: pinpool.PinnedPool | None) -> None:
        """The lifespan entered ``pool`` (None: it failed to): registrations may go on, all but the held one."""
        if pool is None:
            self.release()
            return
        self.base = pool.data_ptr
        self.based.set()

    def release(self) -> None:
        self.released.set()
        self.based.set()

    def register(self, ptr: int, nbytes: int) -> object:
        self.based.wait()
        if self.base is not None and self.hold_from is not None and ptr - self.base >= self.hold_from:
            self.released.wait()
        return self.inner.register(ptr, nbytes)

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        self.inner.unregister(ptr, nbytes, handle)


class TransferEngine:
    """Mooncake's Transfer Engine (TCP transport, peer-to-peer handshake) or a NIXL agent (UCX), made on
    ``host`` before the pool, whose ``registrar`` it gives, and let go after the pool (``close``)."""

    def __init__(self, kind: str, host: str, *, hold_last: bool = False) -> None:
        self.kind, self.host = kind, host
        self.engine: Any = None
        try:
            if kind == "mooncake":
                # Mooncake 0.3.13's TCP transport keeps a pooled connection to a peer after the peer closed it
                # (a peer that restarted, a transfer refused): a later transfer on it fails. One per transfer.
                os.environ.setdefault("MC_TCP_ENABLE_CONNECTION_POOL", "0")
                from mooncake.engine import TransferEngine as Engine

                self.engine = Engine()
            else:
                from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as error:  # the package, or a library it links (libibverbs.so.1 for Mooncake)
            package = "mooncake-transfer-engine-non-cuda" if kind == "mooncake" else "nixl-cu12"
            raise EngineError(f"--transfer-engine {kind} cannot load here ({error}): pip install {package}") from None
        registrar: TransferRegistrar
        if kind == "mooncake":
            rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
            if rc != 0:
                raise EngineError(f"--transfer-engine mooncake: TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', "
                                  f"'tcp', '') returned {rc}: give a --host address of this host")  # fmt: skip
            registrar = MooncakeRegistrar(self.engine, protocol="tcp")
        else:
            # STRICT: the server's event loop asks the agent for its metadata while pinpool's threads register.
            config = nixl_agent_config(backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
            self.engine = nixl_agent(f"kv-offload-{uuid.uuid4().hex[:8]}", config)
            registrar = NixlRegistrar(self.engine)
        self.held = HeldRegistrar(registrar) if hold_last else None
        self.registrar: TransferRegistrar = registrar if self.held is None else self.held

    def __str__(self) -> str:
        if self.kind == "mooncake":
            return f"mooncake on {self.host}, segment {self.peer()['segment']}"
        return f"nixl on {self.host}, agent {self.engine.name}"

    def planned(self, pool: pinpool.PinnedPool) -> None:
        """``pool`` was made with ``registrars=[self.registrar]``: a held registration is its plan's last."""
        if self.held is not None:
            self.held.hold_from = pool.plan.transfers[0].registrations[-1].offset

    def peer(self) -> dict[str, Any]:
        """Mooncake: the segment name a peer opens ("host:rpc_port"). NIXL: the agent's name and metadata
        (base64), which list what it holds registered *now*: a peer loads them again (remove_remote_agent,
        add_remote_agent) to reach pages registered since it last did."""
        if self.kind == "mooncake":
            return {"engine": "mooncake", "segment": f"{self.host}:{self.engine.get_rpc_port()}"}
        metadata = base64.b64encode(bytes(self.engine.get_agent_metadata())).decode()
        return {"engine": "nixl", "agent": str(self.engine.name), "metadata": metadata}

    def answer(
        self, first: int, count: int, runs: list[dict[str, Any]], pieces: tuple[TransferPiece, ...]
    ) -> dict[str, Any]:
        """``GET /transfer``'s body: the engine, where pages ``[first, first + count)`` lie (``runs``), and the
        pieces a peer addresses, in run order, each inside one registration with the engine. The registration's
        handle is this process's own (Mooncake: None; NIXL: a descriptor list): a peer needs only addresses."""
        return self.peer() | {
            "first": first, "count": count, "runs": runs,
            "pieces": [
                {"offset": p.offset, "address": p.address, "nbytes": p.nbytes, "registration": {
                    "offset": p.registration.offset, "address": p.registration.address,
                    "nbytes": p.registration.nbytes}}
                for p in pieces
            ],
        }  # fmt: skip

    def close(self) -> None:
        """Let go of the engine (its destructor stops its threads) once the pool has unregistered everything.
        nixl-cu12 1.5.1 then crashes the process at its exit (SIGSEGV in the libnl-route-3 its wheel carries,
        from _dl_fini): the caller leaves with os._exit where ``exits_hard``."""
        self.registrar = self.held = self.engine = None  # type: ignore[assignment]

    @property
    def exits_hard(self) -> bool:
        return self.kind == "nixl"
