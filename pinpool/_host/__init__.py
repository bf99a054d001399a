"""pinpool._host: the host. Tests import from here (see pinpool._types.lazy_exports)."""

from .._types import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "cpulimits": "V1_SOURCE V2_SOURCE CpuQuota cpu_budget read_cpu_quota",
    "facts": "HostFacts address_space_bytes cgroup_memory_limit mem_available",
    "mapping": "HostMapping TensorMemory alias_of populate_range",
    "memlimits": "MemoryLimits effective_available read_mem_available read_memory_limits",
})  # fmt: skip
