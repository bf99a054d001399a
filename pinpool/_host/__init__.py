"""pinpool._host: the host's probes. Tests import from here (see pinpool._lazy).

The one seam: tests that fake the host patch the module object ``pinpool._host.libc`` (``from
pinpool._host import libc``), the only file of a folder a test may import (docs/architecture.md)."""

from .._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "giveback": "GRANULE_WHY checked_range",
    "libc": "address_space_bytes",
    "limits": "V1_SOURCE V2_SOURCE MemoryLimits available_cpus binding_memory_cgroup read_cpu_quota read_mem_available "
              "read_memory_limits v2_cgroup_directories",
    "mapping": "HostMapping TensorMemory alias_of populate_range unmap_in_pieces",
    "pressure": "PROC_PSI MemoryReading PressureError PsiLine PsiReading parse_limit parse_meminfo parse_psi "
                "psi_file read_memory_pressure",
    "watch": "PressureEvent PressureWatch PsiTrigger V1_LEVELS",
})  # fmt: skip
