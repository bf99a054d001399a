"""pinpool._shared: shared memory. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "files": "publish",
    "mapping": "SharedMapping _reserve",
    "memory": "SharedMemory",
    "regions": "find_half_made find_regions read_region",
    "trailer": "MAGIC TRAILER_BYTES layout_record store",
})  # fmt: skip
