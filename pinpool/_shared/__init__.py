"""pinpool._shared: shared memory. Tests import from here (see pinpool._lazy)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "files": "publish remove_half_made remove_orphans remove_stale_temps",
    "format": "MAGIC TRAILER_BYTES find_half_made find_regions layout_record read_region store",
    "intents": "suspects_in",
    "mapping": "SharedMapping reserve_pages",
    "memory": "SharedMemory",
    "ofd": "ATTACHERS_AT ofd_lock",
})  # fmt: skip
