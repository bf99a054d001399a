"""pinpool: pin (page-lock) very large host-memory pools safely and fast.

    async with pinpool.PinnedPool(layout=layouts.Raw(), size="64GiB") as pool:
        pool.tensor  # page-locked torch view

The docs/ folder of the repository covers concepts, metrics and operations.
"""

from __future__ import annotations

from . import layouts, runtimes, testing
from ._errors import AlreadyPinnedError as AlreadyPinnedError
from ._errors import ChunkFailure as ChunkFailure
from ._errors import ConfigError as ConfigError
from ._errors import PinError as PinError
from ._errors import PinpoolError as PinpoolError
from ._errors import PoolStateError as PoolStateError
from ._errors import RuntimeCallError as RuntimeCallError
from ._errors import UnclosedPoolWarning as UnclosedPoolWarning
from ._errors import UnpinError as UnpinError
from ._lifecycle import PoolState as PoolState
from ._memory import AllocationError as AllocationError
from ._node import NodeBusyError as NodeBusyError
from ._plan import Chunk as Chunk
from ._pool import PinnedPool as PinnedPool
from ._pool import pin as pin
from ._units import parse_size as parse_size

__version__ = "0.1.0"

__all__ = [
    "AllocationError",
    "AlreadyPinnedError",
    "Chunk",
    "ChunkFailure",
    "ConfigError",
    "NodeBusyError",
    "PinError",
    "PinnedPool",
    "PinpoolError",
    "PoolState",
    "PoolStateError",
    "RuntimeCallError",
    "UnclosedPoolWarning",
    "UnpinError",
    "__version__",
    "layouts",
    "parse_size",
    "pin",
    "runtimes",
    "testing",
]

# Public names report the public module, as anyio does, so reprs and docs say pinpool.X.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and _obj.__module__.startswith("pinpool._"):
        _obj.__module__ = __name__
del _name, _obj
