"""Runtimes: what "pin this range" means. CUDA or ROCm registration, Linux mlock, or your own.

A runtime is anything with a ``name`` and two thread-safe calls, ``register(ptr, nbytes)`` and
``unregister(ptr)``, raising :class:`pinpool.RuntimeCallError`; what more it can do it declares as
``capabilities`` (:func:`capabilities_of` checks it). Names live in one registry: :data:`RUNTIME_NAMES`.
"""

from __future__ import annotations

from .._lazy import lazy_exports
from .._types import Capabilities as Capabilities
from ._gpu import CudaRuntime as CudaRuntime
from ._gpu import RocmRuntime as RocmRuntime
from ._mlock import MlockRuntime as MlockRuntime
from ._registry import RUNTIME_NAMES as RUNTIME_NAMES
from ._registry import FindsPinned as FindsPinned
from ._registry import LocksOnFault as LocksOnFault
from ._registry import Populates as Populates
from ._registry import Runtime as Runtime
from ._registry import RuntimeInfo as RuntimeInfo
from ._registry import auto_runtime_name as auto_runtime_name
from ._registry import capabilities_of as capabilities_of
from ._registry import resolve_runtime as resolve_runtime
from ._registry import runtime_choices as runtime_choices
from ._registry import runtime_info as runtime_info
from ._registry import runtime_infos as runtime_infos

__all__ = [
    "RUNTIME_NAMES", "Capabilities", "CudaRuntime", "FindsPinned", "LocksOnFault", "MlockRuntime", "Populates",
    "RocmRuntime", "Runtime", "RuntimeInfo", "auto_runtime_name", "capabilities_of", "resolve_runtime",
    "runtime_choices", "runtime_info", "runtime_infos"
]  # fmt: skip

# Names tests read, from the private modules on first use; not public API (not in __all__, nor dir()).
__getattr__ = lazy_exports(__name__, {
    "_gpu": "CudaDevice CudaFacts GpuApi HostRegisterRuntime device_index",
    "_mlock": "OWN_LOCKS SHARED_PAGES",
    "_registry": "pinning_capabilities",
})[0]  # fmt: skip

# Public names report this module, as pinpool's top level does (reprs and docs say pinpool.runtimes.X).
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and _obj.__module__.startswith(f"{__name__}._"):
        _obj.__module__ = __name__
del _name, _obj
