"""pinpool._shared: shared memory. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "files": "publish remove_half_made",
    "format": "MAGIC TRAILER_BYTES find_half_made find_regions layout_record read_region store",
    "mapping": "SharedMapping _reserve",
    "memory": "SharedMemory",
})  # fmt: skip
