"""pinpool: pin (page-lock) very large host-memory pools safely and fast.

    async with pinpool.PinnedPool(layout=layouts.Raw(), size="64GiB") as pool:
        pool.tensor  # page-locked torch view

The docs/ folder of the repository covers concepts, metrics and operations.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import registrars, runtimes, testing
from ._errors import AllocationError as AllocationError
from ._errors import AlreadyPinnedError as AlreadyPinnedError
from ._errors import ChunkFailure as ChunkFailure
from ._errors import ConfigError as ConfigError
from ._errors import MemoryGoneError as MemoryGoneError
from ._errors import NodeBusyError as NodeBusyError
from ._errors import PinError as PinError
from ._errors import PinpoolError as PinpoolError
from ._errors import PoolStateError as PoolStateError
from ._errors import RuntimeCallError as RuntimeCallError
from ._errors import UnclosedPoolWarning as UnclosedPoolWarning
from ._errors import UnexpectedReturn as UnexpectedReturn
from ._errors import UnpinError as UnpinError
from ._units import parse_size as parse_size

if TYPE_CHECKING:  # loaded lazily below; imported here for type checkers and IDEs
    from . import layouts
    from ._pin.outcome import PoolState
    from ._plan.chunks import Chunk
    from ._plan.elastic import ElasticPolicy
    from ._plan.plan import PoolPlan
    from ._pool.budget import Shares, host_budget, share
    from ._pool.pin import empty, pin
    from ._pool.pool import PinnedPool, PoolStats
    from ._shared.memory import SharedMemory
    from ._types import MemoryReading

__version__ = "0.1.0"

__all__ = ["AllocationError", "AlreadyPinnedError", "Chunk", "ChunkFailure", "ConfigError", "ElasticPolicy",
    "MemoryGoneError", "MemoryReading",
    "NodeBusyError", "PinError", "PinnedPool", "PinpoolError", "PoolPlan", "PoolState", "PoolStateError", "PoolStats",
    "RuntimeCallError", "SharedMemory", "Shares", "UnclosedPoolWarning", "UnexpectedReturn", "UnpinError",
    "__version__", "empty", "host_budget", "layouts", "parse_size", "pin", "registrars", "runtimes", "share",
    "testing"]  # fmt: skip

# Names from modules that import torch (about 2 s) or anyio load on first use (PEP 562), so
# `pinpool --help`, `pinpool doctor --no-cuda` and `import pinpool.testing` stay fast.
_LAZY = {"empty": "._pool.pin", "Chunk": "._plan.chunks", "PinnedPool": "._pool.pool", "PoolState": "._pin.outcome",
         "PoolPlan": "._plan.plan", "PoolStats": "._pool.pool", "ElasticPolicy": "._plan.elastic",
         "MemoryReading": "._types",
         "layouts": ".layouts", "pin": "._pool.pin", "SharedMemory": "._shared.memory", "Shares": "._pool.budget",
         "host_budget": "._pool.budget", "share": "._pool.budget"}  # fmt: skip


def _public(obj: Any) -> Any:
    """Public names report the public module, as anyio does: reprs and docs say pinpool.X."""
    if isinstance(obj, type) and obj.__module__.startswith("pinpool._"):
        obj.__module__ = __name__
    return obj


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loaded = importlib.import_module(module, __name__)
    value = loaded if name == "layouts" else _public(getattr(loaded, name))
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(__all__)  # not the helpers and private modules the globals also hold


for _name in __all__:
    if _name not in _LAZY:
        _public(globals()[_name])
del _name
