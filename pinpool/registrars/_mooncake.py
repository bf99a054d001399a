"""MooncakeRegistrar: a pool's registrations with Mooncake's Transfer Engine (kvcache-ai/Mooncake), so a peer
engine reads and writes the pool's pages over RDMA, EFA or TCP.

This module imports nothing of Mooncake's: the caller hands over an engine it built and initialized
(``TransferEngine().initialize(host, metadata, protocol, device)``), so ``import pinpool.registrars`` never
loads ``libibverbs`` and an adapter cannot exist without the engine."""

from __future__ import annotations

from typing import Protocol

from .._errors import ConfigError, RuntimeCallError, class_name, foreign_text
from .._types import RegistrarLimits

# Mooncake's return codes (mooncake-transfer-engine/include/error.h). ``registerLocalMemory`` rolls back
# every transport it tried before returning one of them (transfer_engine_impl.cpp, Mooncake#2869), so a
# negative answer means nothing was registered.
_CODES = {
    -1: ("ERR_INVALID_ARGUMENT", "a zero length, or a registration the transport refused (RDMA: longer than the "
         "device's max_mr_size: give MooncakeRegistrar(max_bytes=...) at most that)"),
    -2: ("ERR_TOO_MANY_REQUESTS", "the engine is saturated: retry later or register fewer, larger ranges"),
    -3: ("ERR_ADDRESS_NOT_REGISTERED", "nothing is registered at this address with this engine"),
    -6: ("ERR_DEVICE_NOT_FOUND", "no NIC serves this memory's location: check the engine's device list "
         "(initialize's device_name) and the topology it discovered"),
    -7: ("ERR_ADDRESS_OVERLAPPED", "these bytes overlap a registration this engine already holds (registered by "
         "hand, or by another pool): a range is registered once per engine; unregister the other one first"),
    -202: ("ERR_CONTEXT", "the NIC refused the memory region (ibv_reg_mr): raise `ulimit -l` (RLIMIT_MEMLOCK) "
           "or give CAP_IPC_LOCK, and keep each registration within the device's max_mr_size (max_bytes=)"),
    -302: ("ERR_MEMORY", "the engine ran out of memory for its books"),
}  # fmt: skip
NOT_REGISTERED = -3  # what unregister_memory answers for an address it does not hold (seen on 0.3.13.post1)

# Transports whose registration pins (and faults) every page: ibv_reg_mr (rdma), fi_mr_reg (efa). TCP only
# records the range in the engine's segment table and touches no page.
_PINNING = frozenset({"rdma", "efa"})
_NOT_PINNING = frozenset({"tcp"})


class _Engine(Protocol):
    """The two calls of ``mooncake.engine.TransferEngine`` this adapter makes (its pybind signatures)."""

    def register_memory(self, buffer_addr: int, capacity: int) -> int: ...

    def unregister_memory(self, buffer_addr: int) -> int: ...


def describe(rc: int) -> str:
    """Mooncake's return code as its name and what it means for the caller."""
    name, meaning = _CODES.get(rc, (f"code {rc}", "an error Mooncake's error.h does not list; see the engine's log"))
    return f"Mooncake {name} ({rc}): {meaning}"


class MooncakeRegistrar:
    """Registers a pool's ranges with an initialized Mooncake ``TransferEngine`` (``register_memory`` /
    ``unregister_memory``); the handle is None (Mooncake keys a registration by its base address).

    ``protocol``: the one given to ``engine.initialize`` ("tcp", "rdma", "efa"), which the engine does not
    report back; it decides whether a registration pins pages (``ibv_reg_mr`` does, TCP does not). For another
    transport, give ``pins_pages=`` yourself. ``max_bytes``: the device's ``max_mr_size`` (or EFA's 192 GB);
    ``page_table_entries``: EFA's page-table budget (``MC_EFA_MAX_PTE_ENTRIES``, about 22 M);
    ``preferred_bytes``: join chunks into registrations up to this (few, large ones)."""

    def __init__(
        self,
        engine: object,
        *,
        protocol: str,
        name: str = "mooncake",
        max_bytes: int | None = None,
        preferred_bytes: int | None = None,
        page_table_entries: int | None = None,
        pins_pages: bool | None = None,
    ) -> None:
        for call in ("register_memory", "unregister_memory"):
            if not callable(getattr(engine, call, None)):
                raise ConfigError(
                    f"MooncakeRegistrar(engine={class_name(engine)}): the engine has no {call}(); pass an "
                    "initialized mooncake.engine.TransferEngine"
                )
        if pins_pages is None:
            if not isinstance(protocol, str) or protocol.lower() not in _PINNING | _NOT_PINNING:
                raise ConfigError(
                    f"MooncakeRegistrar(protocol={protocol!r}): pinpool knows whether "
                    f"{sorted(_PINNING | _NOT_PINNING)} pin pages; for another transport give pins_pages=True "
                    "(its registration page-locks memory, RLIMIT_MEMLOCK applies) or pins_pages=False"
                )
            pins_pages = protocol.lower() in _PINNING
        elif not isinstance(pins_pages, bool):
            raise ConfigError(f"MooncakeRegistrar(pins_pages={pins_pages!r}): give True, False or None")
        self.engine: _Engine = engine  # type: ignore[assignment]  # checked above, by its calls
        self.protocol = protocol
        self.name = name
        # Mooncake's engine takes a mutex around its segment table and registers transports in parallel
        # (Mooncake#855): concurrent calls are safe and faster.
        self.limits = RegistrarLimits(
            max_bytes=max_bytes,
            preferred_bytes=preferred_bytes,
            page_table_entries=page_table_entries,
            pins_pages=pins_pages,
            faults_pages=pins_pages,  # ibv_reg_mr faults in every page it pins
            not_registered_codes=frozenset({NOT_REGISTERED}),
            parallel=True,
        )

    def __repr__(self) -> str:
        return f"MooncakeRegistrar(name={self.name!r}, protocol={self.protocol!r})"

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self.engine.register_memory(ptr, nbytes)
        if type(rc) is int and rc == 0:
            return None
        if type(rc) is int and rc < 0:
            raise RuntimeCallError(
                op="register", code=rc, reason="MooncakeError", message=describe(rc), ptr=ptr, nbytes=nbytes
            )
        # Not an answer Mooncake documents: the engine counts a transport's positive answer as success, so
        # this may have registered; a plain exception tells pinpool to undo it.
        raise RuntimeError(
            f"MooncakeRegistrar {self.name!r}: register_memory({ptr:#x}, {nbytes}) returned "
            f"{foreign_text(rc, repr, 100)}, neither 0 nor a negative Mooncake error code"
        )

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        rc = self.engine.unregister_memory(ptr)
        if type(rc) is int and rc == 0:
            return
        if type(rc) is int:
            code, message = rc, describe(rc)
        else:
            code, message = -1, f"unregister_memory returned {foreign_text(rc, repr, 100)}, not a Mooncake code"
        raise RuntimeCallError(
            op="unregister", code=code, reason="MooncakeError", message=message, ptr=ptr, nbytes=nbytes
        )
