"""NixlRegistrar: a pool's registrations with a NIXL agent (ai-dynamo/nixl), so a peer agent reads and writes
the pool's pages through the agent's backends (UCX: ``ucp_mem_map``).

This module imports nothing of NIXL's: the caller hands over an agent it built (``nixl_agent(name, config)``
from ``nixl_cu12._api``, ``nixl_cu13._api`` or ``nixl._api``), and NIXL's exceptions are told apart by their
class names, which every one of those packages shares."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .._errors import ConfigError, RuntimeCallError, class_name, foreign_text
from .._types import RegistrarLimits

# NIXL's exception classes (its _bindings module) and their nixl_status_t (nixl_types.h).
_CODES = {
    "nixlNotPostedError": -1, "nixlInvalidParamError": -2, "nixlBackendError": -3, "nixlNotFoundError": -4,
    "nixlMismatchError": -5, "nixlNotAllowedError": -6, "nixlRepostActiveError": -7, "nixlUnknownError": -8,
    "nixlNotSupportedError": -9,
}  # fmt: skip
NOT_FOUND = -4  # deregister_memory of descriptors the agent does not hold raises nixlNotFoundError

# nixlAgent::registerMem answers an error only when no backend kept the descriptors: each backend's
# addDescList undoes its own partial work, and one success anywhere answers NIXL_SUCCESS. So these mean
# nothing was registered: no backend for the memory type (NOT_FOUND), every backend refused (BACKEND), a bad
# argument checked before any backend ran (INVALID_PARAM).
_REGISTER_NOTHING_DONE = {
    -2: "NIXL rejected the descriptor (NIXL_ERR_INVALID_PARAM)",
    -3: "every backend refused the memory (NIXL_ERR_BACKEND; the agent's log says why, e.g. UCX's ucp_mem_map): "
    "check mem_type and dev_id, and for RDMA `ulimit -l` (RLIMIT_MEMLOCK) and the NIC's largest registration "
    "(give max_bytes=)",
    -4: "no backend of this agent serves this memory type (NIXL_ERR_NOT_FOUND): create the agent with a backend "
    "that does (UCX for DRAM)",
}


def nixl_code(exc: BaseException) -> int | None:
    """The nixl_status_t behind one of NIXL's exceptions (None: not NIXL's)."""
    cls = type(exc)
    if not cls.__module__.endswith("_bindings"):
        return None
    return _CODES.get(cls.__name__)


class NixlRegistrar:
    """Registers a pool's ranges with a NIXL agent: ``register_memory([(ptr, nbytes, dev_id, "")], mem_type)``,
    whose registration descriptor list is the handle, and ``deregister_memory(handle)``.

    ``backends``: the agent's backend names to register with (empty: every backend serving ``mem_type``).
    ``pins_pages``: whether the backends' registration page-locks memory (UCX over an RDMA transport pins, as
    ``ibv_reg_mr`` does; over TCP or shared memory it does not), which NIXL does not report. Calls to one agent
    are serialized here: an agent built without a listen thread defaults to NIXL_THREAD_SYNC_NONE (no lock of
    its own). Transfers your threads run while a background pool registers need an agent with
    ``sync_mode=NIXL_THREAD_SYNC_STRICT`` (or a listen thread)."""

    def __init__(
        self,
        agent: object,
        *,
        name: str = "nixl",
        mem_type: str = "DRAM",
        dev_id: int = 0,
        backends: Sequence[str] = (),
        max_bytes: int | None = None,
        preferred_bytes: int | None = None,
        page_table_entries: int | None = None,
        pins_pages: bool = False,
    ) -> None:
        for call in ("register_memory", "deregister_memory", "get_reg_descs"):
            if not callable(getattr(agent, call, None)):
                raise ConfigError(
                    f"NixlRegistrar(agent={class_name(agent)}): the agent has no {call}(); pass a "
                    "nixl_agent (nixl_cu12._api.nixl_agent)"
                )
        known_types = getattr(agent, "nixl_mems", None)
        if isinstance(known_types, dict) and mem_type not in known_types:
            raise ConfigError(
                f"NixlRegistrar(mem_type={mem_type!r}): NIXL knows {sorted(known_types)}; host pools are 'DRAM'"
            )
        if isinstance(dev_id, bool) or not isinstance(dev_id, int) or dev_id < 0:
            raise ConfigError(f"NixlRegistrar(dev_id={dev_id!r}): give a device index >= 0 (0 for DRAM)")
        if isinstance(backends, str):
            raise ConfigError(f"NixlRegistrar(backends={backends!r}): give a list of backend names, e.g. ['UCX']")
        created = getattr(agent, "backends", None)
        missing = [b for b in backends if isinstance(created, dict) and b not in created]
        if missing:
            raise ConfigError(
                f"NixlRegistrar(backends={list(backends)!r}): the agent has no backend {missing}; it has "
                f"{sorted(created or ())}: create it (nixl_agent_config(backends=[...]) or agent.create_backend)"
            )
        if not isinstance(pins_pages, bool):
            raise ConfigError(f"NixlRegistrar(pins_pages={pins_pages!r}): give True or False")
        self.agent: Any = agent
        self.name = name
        self.mem_type = mem_type
        self.dev_id = dev_id
        self.backends = list(backends)
        self._lock = threading.Lock()
        self.limits = RegistrarLimits(
            max_bytes=max_bytes,
            preferred_bytes=preferred_bytes,
            page_table_entries=page_table_entries,
            pins_pages=pins_pages,
            faults_pages=pins_pages,  # a NIC registration faults in every page it pins
            not_registered_codes=frozenset({NOT_FOUND}),
            parallel=False,  # serialized by self._lock (see the class's doc)
        )

    def __repr__(self) -> str:
        agent = getattr(self.agent, "name", "?")
        return f"NixlRegistrar(name={self.name!r}, mem_type={self.mem_type!r}, agent={agent!r})"

    def _descs(self, ptr: int, nbytes: int) -> object:
        return self.agent.get_reg_descs([(ptr, nbytes, self.dev_id, "")], self.mem_type)

    def register(self, ptr: int, nbytes: int) -> object:
        with self._lock:
            try:
                return self.agent.register_memory(self._descs(ptr, nbytes), self.mem_type, self.backends)
            except Exception as exc:
                code = nixl_code(exc)
                if code not in _REGISTER_NOTHING_DONE:
                    raise  # maybe registered: pinpool undoes it
                raise RuntimeCallError(
                    op="register", code=code, reason=class_name(exc), ptr=ptr, nbytes=nbytes,
                    message=f"{_REGISTER_NOTHING_DONE[code]} ({foreign_text(exc)})",
                ) from exc  # fmt: skip

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None:
        # No handle (a register that raised, undone): NIXL finds a registration by its descriptor, which
        # (ptr, nbytes, dev_id) rebuilds.
        with self._lock:
            descs = handle if handle is not None else self._descs(ptr, nbytes)
            try:
                self.agent.deregister_memory(descs, self.backends)
            except Exception as exc:
                if nixl_code(exc) != NOT_FOUND:
                    raise  # NIXL deregisters best effort per backend: some may have let go
                raise RuntimeCallError(
                    op="unregister", code=NOT_FOUND, reason=class_name(exc), ptr=ptr, nbytes=nbytes,
                    message=f"the agent holds no registration of these bytes ({foreign_text(exc)})",
                ) from exc  # fmt: skip
