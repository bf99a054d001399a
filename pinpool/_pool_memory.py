"""Where a pool's memory comes from, for its lifecycle: a new private mapping, a shared file's
mapping, or a caller's tensor (``pin()``), claimed against every other pool of this process
and checked against the host right before mapping; and the layout's tensors over it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import cast

import torch

from ._errors import AlreadyPinnedError, ConfigError, PoolStateError
from ._host import HostFacts
from ._lifecycle import Memory
from ._memory import HostMapping, TensorMemory
from ._options import PoolOptions
from ._plan import PoolPlan
from ._preflight import check_pinning
from ._ranges import PINNED_RANGES
from ._shared import SharedMapping, SharedMemory, layout_record
from ._types import Capabilities
from .layouts import BufferSpec, Raw
from .runtimes import FindsPinned, Runtime

_Mapped = HostMapping | TensorMemory | SharedMapping


def check_memory_source(memory: object, options: PoolOptions) -> None:
    """``memory=`` is a :class:`SharedMemory`; the file system decides its page size, not huge_pages=."""
    if memory is None:
        return
    if not isinstance(memory, SharedMemory):
        raise ConfigError(
            f"memory={memory!r} must be a pinpool.SharedMemory (or None for the pool's own private memory); "
            "to pin a tensor you allocated, use pinpool.pin(tensor)"
        )
    if options.huge_pages:
        raise ConfigError(
            f"huge_pages={options.huge_pages!r} with memory=SharedMemory(...): a shared region's page size is its "
            "file system's (a file on hugetlbfs has huge pages, one on /dev/shm has 4 KiB pages); drop huge_pages="
        )
    if options.numa_node is not None:
        raise ConfigError(
            f"numa_node={options.numa_node} with memory=SharedMemory(...) is not supported: a shared file's pages "
            "follow the policy of the process that faults them first; bind that process instead (numactl "
            "--membind), or drop numa_node="
        )


def claim(name: str, memory: _Mapped, nbytes: int, runtime: Runtime, caps: Capabilities) -> _Mapped:
    """Claim the memory's address range in this process, refusing memory that is already pinned."""
    overlap = PINNED_RANGES.add(memory.address, max(nbytes, 1))
    if overlap is not None:
        raise AlreadyPinnedError(
            f"pool {name!r}: [{memory.address:#x}, +{nbytes}) overlaps "
            f"[{overlap[0]:#x}, +{overlap[1]}), which pinpool already pins in this process; "
            "nothing was pinned. Exit the other pool first, or pin a different tensor"
        )
    try:
        elsewhere = cast(FindsPinned, runtime).find_pinned(memory.address, nbytes) if caps.finds_pinned else None
    except BaseException:  # an interrupt during the scan (it reads /proc/self/smaps) must not keep the claim
        PINNED_RANGES.pop(memory.address)
        raise
    if elsewhere is not None:
        PINNED_RANGES.pop(memory.address)
        raise AlreadyPinnedError(
            f"pool {name!r}: the memory is already pinned outside pinpool ({elsewhere}); "
            "nothing was pinned. Unpin it first, or pin a different tensor"
        )
    return memory


class PoolMemory:
    """Where a pool's memory comes from, for its lifecycle: a new private mapping, a shared
    file's mapping, or a caller's tensor (pin()); and the layout's tensors over it.

    Holds values, never the façade. A caller's tensor is held only here, and let go once the
    pool is closed: after ``close()`` nothing of the caller's is referenced (their mmap can close)."""

    def __init__(
        self, plan: PoolPlan, options: PoolOptions, runtime: Runtime, caps: Capabilities, *,
        shared: SharedMemory | None, tensor: torch.Tensor | None,
    ) -> None:  # fmt: skip
        self._plan, self._options, self._runtime, self._caps = plan, options, runtime, caps
        self._shared = shared
        self._record = layout_record(options.layout, plan.num_pages) if shared is not None else {}
        self._own = tensor is None
        self._tensor = tensor

    def acquire(self) -> HostMapping | TensorMemory | SharedMapping:
        plan, name, shared = self._plan, self._options.name, self._shared
        # The memory pre-flight (memory cgroup, MemAvailable, RLIMIT_MEMLOCK) against figures read
        # now, right before mapping: they change between construction and entry. Pages a shared
        # file already holds are memory in use, not new memory.
        new_bytes = None if shared is None else shared.new_bytes(plan.mapping_bytes)
        check_pinning(
            self._options, HostFacts.probe(), self._caps, mapping_bytes=plan.mapping_bytes,
            buffer_bytes=[b.spec.nbytes for b in plan.buffers], new_memory=self._own, new_bytes=new_bytes,
        )  # fmt: skip
        memory: HostMapping | TensorMemory | SharedMapping
        if shared is not None:
            memory = shared.open_mapping(plan.mapping_bytes, self._record)
        elif self._own:
            memory = HostMapping(plan.mapping_bytes, huge_pages=plan.huge_pages, numa_node=plan.numa_node)
        elif self._tensor is None:
            raise PoolStateError(f"pool {name!r} was closed: its tensor was let go; call pin() again")
        else:
            memory = TensorMemory(self._tensor)
        return claim(name, memory, plan.nbytes, self._runtime, self._caps)

    def views(self, memory: Memory) -> Mapping[str, torch.Tensor]:
        assert isinstance(memory, HostMapping | TensorMemory | SharedMapping)
        return MappingProxyType(
            {
                b.spec.name: memory.view(b.offset, b.spec.nbytes).view(b.spec.dtype).view(b.spec.shape)
                for b in self._plan.buffers
            }
        )

    def release(self) -> None:
        self._tensor = None


class TensorLayout:
    """The layout of a caller's tensor: one buffer of exactly its bytes, whose pages are its
    rows along the first dimension (row-major: page *i* is row *i*), so a background pool can
    say which leading rows are pinned. A 0-d tensor is one page."""

    def __init__(self, tensor: torch.Tensor, granularity_bytes: int | None) -> None:
        self._raw = Raw(granularity_bytes=granularity_bytes)
        self._shape = tuple(tensor.shape)
        self._dtype = tensor.dtype
        self._nbytes = tensor.numel() * tensor.element_size()
        self._rows = self._shape[0] if self._shape else 1

    @property
    def name(self) -> str:
        return "tensor"

    @property
    def page_bytes(self) -> int:
        return self._nbytes // self._rows  # one row

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        return (BufferSpec("data", self._shape, self._dtype, self._raw.granularity_bytes, 1),)
