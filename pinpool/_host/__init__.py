"""pinpool._host: the host's probes. Tests import from here (see pinpool._lazy).

The one seam: tests that fake the host patch the module object ``pinpool._host.libc`` (``from
pinpool._host import libc``), the only file of a folder a test may import (docs/architecture.md)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "giveback": "GRANULE_WHY checked_range",
    "libc": "address_space_bytes",
    "limits": "V1_SOURCE V2_SOURCE MemoryLimits available_cpus read_cpu_quota read_mem_available read_memory_limits",
    "mapping": "HostMapping TensorMemory alias_of populate_range unmap_in_pieces",
})  # fmt: skip
