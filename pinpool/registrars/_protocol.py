"""What a transfer registrar is: a second consumer of a pool's memory (a transfer engine's NIC or TCP path,
GPUDirect Storage), registered from the same aligned plan as the runtime. Limits are declared, not guessed
from attributes, and checked before anything is mapped."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .._errors import ConfigError
from .._types import RegistrarLimits


@runtime_checkable
class TransferRegistrar(Protocol):
    """Registers ranges of a pool with a transfer engine. ``name``: a short label (metrics, logs, errors: low
    cardinality, unique within a pool); ``limits``: a :class:`RegistrarLimits`. ``register(ptr, nbytes)``
    returns a handle (anything, None included) that ``unregister(ptr, nbytes, handle)`` and
    :class:`TransferPiece` carry; both are thread-safe and raise :class:`pinpool.RuntimeCallError` when
    nothing was done (any other exception: pinpool assumes the call may have registered, and undoes it)."""

    name: str
    limits: RegistrarLimits

    def register(self, ptr: int, nbytes: int) -> object: ...

    def unregister(self, ptr: int, nbytes: int, handle: object) -> None: ...


@dataclass(frozen=True)
class TransferRegistration:
    """One live registration with a registrar: bytes ``[offset, offset + nbytes)`` of the pool (``address``
    is the first one's address) and the ``handle`` its register call returned."""

    registrar: str
    offset: int
    nbytes: int
    address: int
    handle: object

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class TransferPiece:
    """A range a transfer may address in one descriptor: inside one ``registration``, never across two.
    ``offset`` from the pool's start, ``address`` = ``pool.data_ptr + offset``."""

    offset: int
    nbytes: int
    address: int
    registration: TransferRegistration

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    @property
    def handle(self) -> object:
        return self.registration.handle


def _positive(value: object, field: str, name: str) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(
            f"registrar {name!r} declares limits.{field}={value!r}: give a positive int number of bytes "
            "(or entries), or None for no limit"
        )


def limits_of(registrar: object) -> RegistrarLimits:
    """The limits ``registrar`` declares, checked (:class:`pinpool.ConfigError` for a false or garbage one)."""
    name = getattr(registrar, "name", None)
    if not isinstance(registrar, TransferRegistrar) or not isinstance(name, str) or not name:
        raise ConfigError(
            f"registrars=[..., {registrar!r}, ...]: a registrar is an object with a non-empty str name, limits "
            "(pinpool.registrars.RegistrarLimits), register(ptr, nbytes) -> handle and unregister(ptr, nbytes, "
            "handle); see pinpool.registrars (MooncakeRegistrar, NixlRegistrar)"
        )
    limits = registrar.limits
    if not isinstance(limits, RegistrarLimits):
        raise ConfigError(
            f"registrar {name!r} declares limits={limits!r}, which is not a pinpool.registrars.RegistrarLimits"
        )
    for field in ("max_bytes", "preferred_bytes", "page_table_entries"):
        _positive(getattr(limits, field), field, name)
    if limits.max_bytes and limits.preferred_bytes and limits.preferred_bytes > limits.max_bytes:
        raise ConfigError(
            f"registrar {name!r}: preferred_bytes={limits.preferred_bytes} exceeds max_bytes={limits.max_bytes}; "
            "a registration is never larger than max_bytes"
        )
    return limits


def check_registrars(registrars: Iterable[object] | None) -> tuple[TransferRegistrar, ...]:
    """``registrars=`` as given (None or an iterable of registrars), each checked, names unique."""
    if registrars is None:
        return ()
    if isinstance(registrars, str | bytes) or not isinstance(registrars, Iterable):
        raise ConfigError(
            f"registrars={registrars!r} must be a list of transfer registrars (pinpool.registrars), or None"
        )
    found: list[TransferRegistrar] = []
    for registrar in registrars:
        limits_of(registrar)
        found.append(registrar)  # type: ignore[arg-type]  # limits_of checked it
    if any(found[i] is found[j] for i in range(len(found)) for j in range(i)):
        raise ConfigError("registrars= holds the same registrar twice: a range is registered once per engine")
    names = [registrar.name for registrar in found]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(
            f"registrars= names {twice} more than once: each registrar's name labels its metrics and its "
            "pieces; give each its own (MooncakeRegistrar(engine, protocol='tcp', name='mooncake-2'))"
        )
    return tuple(found)
