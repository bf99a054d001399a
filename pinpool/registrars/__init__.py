"""Transfer registrars: register a pool's memory with a transfer engine (Mooncake's Transfer Engine, a NIXL
agent, or your own) from the same aligned plan as the runtime, rolled back and torn down with it.

A registrar is anything with a ``name``, ``limits`` (:class:`RegistrarLimits`) and two thread-safe calls,
``register(ptr, nbytes) -> handle`` and ``unregister(ptr, nbytes, handle)`` (:class:`TransferRegistrar`).
Transfers address a pool through ``pool.transfer_pieces(...)``, which never crosses a registration.
"""

from __future__ import annotations

from .._types import RegistrarLimits as RegistrarLimits
from ._protocol import TransferPiece as TransferPiece
from ._protocol import TransferRegistrar as TransferRegistrar
from ._protocol import TransferRegistration as TransferRegistration
from ._protocol import check_registrars as check_registrars
from ._protocol import limits_of as limits_of

__all__ = [
    "RegistrarLimits", "TransferPiece", "TransferRegistrar", "TransferRegistration", "check_registrars", "limits_of",
]  # fmt: skip

for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and _obj.__module__.startswith(("pinpool._types", f"{__name__}._")):
        _obj.__module__ = __name__
del _name, _obj
