"""pinpool._host: the host. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "facts": "HostFacts address_space_bytes",
    "limits": "V1_SOURCE V2_SOURCE CpuQuota MemoryLimits cpu_budget effective_available read_cpu_quota "
              "read_mem_available read_memory_limits",
    "mapping": "HostMapping TensorMemory alias_of populate_range",
})  # fmt: skip
