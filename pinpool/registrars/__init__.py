"""Transfer registrars: register a pool's memory with a transfer engine (Mooncake's Transfer Engine, a NIXL
agent, or your own) from the same aligned plan as the runtime, rolled back and torn down with it.

A registrar is anything with a ``name``, ``limits`` (:class:`RegistrarLimits`) and two thread-safe calls,
``register(ptr, nbytes) -> handle`` and ``unregister(ptr, nbytes, handle)`` (:class:`TransferRegistrar`).
Transfers address a pool through ``pool.transfer_pieces(...)``, which never crosses a registration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .._types import RegistrarLimits as RegistrarLimits
from ._protocol import TransferPiece as TransferPiece
from ._protocol import TransferRegistrar as TransferRegistrar
from ._protocol import TransferRegistration as TransferRegistration
from ._protocol import check_registrars as check_registrars
from ._protocol import limits_of as limits_of

if TYPE_CHECKING:
    from ._mooncake import MooncakeRegistrar as MooncakeRegistrar
    from ._nixl import NixlRegistrar as NixlRegistrar

# The engines' adapters load on first use: they import no engine themselves (the caller passes its engine),
# and a face that loads only what a caller names keeps `import pinpool.registrars` as light as the protocol.
_load, _adapters = lazy_exports(__name__, {"_mooncake": "MooncakeRegistrar", "_nixl": "NixlRegistrar"})


def __getattr__(name: str) -> object:
    obj = _load(name)
    if isinstance(obj, type) and obj.__module__.startswith(f"{__name__}._"):
        obj.__module__ = __name__  # reprs and docs say pinpool.registrars.X, as for the names above
    return obj


__all__ = [
    "RegistrarLimits", "TransferPiece", "TransferRegistrar", "TransferRegistration", "check_registrars", "limits_of",
    *_adapters,
]  # fmt: skip

for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) and _obj.__module__.startswith(("pinpool._types", f"{__name__}._")):
        _obj.__module__ = __name__
del _name, _obj
