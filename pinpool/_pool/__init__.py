"""pinpool._pool: the façade. Tests import from here (see pinpool._lazy)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "pin": "empty",
    "pool": "PinnedPool",
    "request": "PinArguments PoolArguments PoolRequest pool_request",
})  # fmt: skip
