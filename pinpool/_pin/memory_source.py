"""Where a pool's memory comes from (:class:`PoolMemory`): a private mapping, a shared file's, or a
caller's tensor (``pin()``), claimed against every other pool of this process; and pin()'s layout."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import cast

import torch

from .. import _probe
from .._errors import AlreadyPinnedError, ConfigError, PoolStateError
from .._host.mapping import HostMapping, TensorMemory
from .._plan.options import PoolOptions
from .._plan.plan import Schedule, SourceRanges
from .._plan.prefix import PageRun
from .._plan.preflight import check_engine_pins, check_huge_pages, check_pinning
from .._ranges import PINNED_RANGES
from .._shared.format import layout_record
from .._shared.mapping import SharedMapping
from .._shared.memory import SharedMemory
from .._types import Capabilities
from .._units import shown
from ..layouts._families import Raw
from ..layouts._spec import BufferSpec
from ..runtimes import FindsPinned, Runtime
from .engine import Memory

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


def claim(
    name: str, memory: _Mapped, spans: Sequence[tuple[int, int]], runtime: Runtime, caps: Capabilities
) -> _Mapped:
    """Claim the memory's ``spans`` (``(offset, nbytes)``: all of it, or each range of pin()'s
    ranges, so the bytes between them stay free) in this process, refusing memory already pinned."""
    nbytes = spans[-1][0] + spans[-1][1]
    overlap = PINNED_RANGES.add_all([(memory.address + offset, max(size, 1)) for offset, size in spans])
    if overlap is not None:
        raise AlreadyPinnedError(
            f"pool {name!r}: [{memory.address:#x}, +{nbytes}) overlaps "
            f"[{overlap[0]:#x}, +{overlap[1]}), which pinpool already pins in this process; "
            "nothing was pinned. Exit the other pool first, or pin a different tensor"
        )
    try:
        if caps.finds_pinned:  # one scan of the whole extent; each range only where it finds something
            find = cast(FindsPinned, runtime).find_pinned
            elsewhere = find(memory.address, nbytes)
            if elsewhere is not None and len(spans) > 1:
                found = (find(memory.address + offset, size) for offset, size in spans)
                elsewhere = next((where for where in found if where is not None), None)
            if elsewhere is not None:
                raise AlreadyPinnedError(
                    f"pool {name!r}: the memory is already pinned outside pinpool ({elsewhere}); "
                    "nothing was pinned. Unpin it first, or pin a different tensor"
                )
    except BaseException:  # memory pinned elsewhere, or an interrupt during the scan: the claim goes
        PINNED_RANGES.pop(memory.address)
        raise
    return memory


class PoolMemory:
    """A pool's memory for its lifecycle; it holds values, never the façade. A caller's tensor is held
    only here, and let go once the pool is closed, so after ``close()`` the caller's mmap can close."""

    def __init__(
        self, plan: Schedule, options: PoolOptions, runtime: Runtime, caps: Capabilities, *,
        shared: SharedMemory | None, tensor: torch.Tensor | None, pinned_first: Schedule | None = None,
    ) -> None:  # fmt: skip
        self._plan, self._options, self._runtime, self._caps = plan, options, runtime, caps
        # What entry pins: an elastic pool's floor (the rest of the mapping is only reserved), else the plan.
        self._pinned_first = pinned_first
        self._shared = shared
        self._record = layout_record(options.layout, plan.num_pages) if shared is not None else {}
        self._own = tensor is None
        self._tensor = tensor

    def acquire(self) -> HostMapping | TensorMemory | SharedMapping:
        plan, name, shared = self._plan, self._options.name, self._shared
        # Figures read right before mapping; pages a shared file already holds are no new memory.
        new_bytes = None if shared is None else shared.new_bytes(plan.mapping_bytes)
        host = _probe.probe_host()
        first = self._pinned_first
        mapping_bytes, buffer_bytes = (
            (plan.mapping_bytes, [b.spec.nbytes for b in plan.buffers]) if first is None
            else (first.nbytes, [run.end - run.start for run in first.page_runs])
        )  # fmt: skip
        check_pinning(
            self._options, host, self._caps, mapping_bytes=mapping_bytes, buffer_bytes=buffer_bytes,
            new_memory=self._own, new_bytes=None if new_bytes is None else min(new_bytes, mapping_bytes),
        )  # fmt: skip
        pinned = plan.nbytes if first is None else first.nbytes
        check_engine_pins([(t.name, t.limits.pins_pages) for t in plan.transfers], pinned, host)
        memory: HostMapping | TensorMemory | SharedMapping
        if shared is not None:  # an elastic pool's file holds its floor's pages; each segment is allocated as it grows
            floor = None if first is None else [(run.start, run.end - run.start) for run in first.page_runs]
            memory = shared.open_mapping(plan.mapping_bytes, self._record, allocate=floor)
        elif self._own:
            check_huge_pages(plan.huge_pages, plan.mapping_bytes, host)
            memory = HostMapping(
                plan.mapping_bytes, huge_pages=plan.huge_pages, numa_node=plan.numa_node,
                reservation=plan.reservation is not None,
            )  # fmt: skip
        elif self._tensor is None:
            raise PoolStateError(f"pool {name!r} was closed: its tensor was let go; call pin() again")
        else:
            ranges = cast(TensorLayout, self._options.layout).ranges
            if ranges is not None:  # the memory is the first range to the last; each range is claimed
                memory = TensorMemory(self._tensor, (ranges.first, ranges.first + ranges.extent))
                spans = [(b.offset, b.spec.nbytes) for b in plan.buffers]
                return claim(name, memory, spans, self._runtime, self._caps)
            memory = TensorMemory(self._tensor)
        return claim(name, memory, [(0, plan.nbytes)], self._runtime, self._caps)

    def views(self, memory: Memory) -> Mapping[str, torch.Tensor]:
        if isinstance(memory, TensorMemory):  # the caller's tensor as given: a strided view stays one
            return MappingProxyType({TENSOR_BUFFER: memory.as_given()})
        assert isinstance(memory, HostMapping | SharedMapping)
        if isinstance(memory, SharedMapping):  # truncated pages are SIGBUS to touch, and mlock skips them
            memory.check_size()
        return MappingProxyType(
            {
                b.spec.name: memory.view(b.offset, b.spec.nbytes).view(b.spec.dtype).view(b.spec.shape)
                for b in self._plan.buffers
            }
        )

    def release(self) -> None:
        self._tensor = None

    @staticmethod
    def gone(memory: Memory | None) -> str | None:
        """Why the memory is gone (another process truncated its shared file), or None."""
        if isinstance(memory, SharedMapping):
            try:
                memory.check_size()
            except ConfigError as exc:
                return str(exc)
        return None


TENSOR_BUFFER = "data"  # pin()'s one buffer: pool.tensors["data"] is pool.tensor


class TensorLayout:
    """The layout of a caller's tensor: one buffer whose pages are its rows along the first dimension
    (a 0-d tensor is one page); ``ranges``: what is registered when not all of it (:func:`source_ranges`)."""

    name = "tensor"

    def __init__(self, tensor: torch.Tensor, granularity_bytes: int | None, ranges: object = None) -> None:
        self._raw = Raw(granularity_bytes=granularity_bytes)
        self._shape, self._dtype = tuple(tensor.shape), tensor.dtype
        self.page_bytes = tensor.numel() * tensor.element_size() // (self._shape[0] if self._shape else 1)  # a row
        self.ranges = source_ranges(tensor, ranges, self.page_bytes)

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        return (BufferSpec(TENSOR_BUFFER, self._shape, self._dtype, self._raw.granularity_bytes, 1),)


def source_ranges(tensor: torch.Tensor, given: object, row_bytes: int) -> SourceRanges | None:
    """The byte ranges pin() registers: ``ranges=`` of a contiguous tensor, else a strided view's
    contiguous rows; None for a contiguous tensor pinned whole. Page *i* lies in ``[i * pitch,
    (i + 1) * pitch)``; a view whose first-dimension slices interleave has no pitch (usable once all pinned)."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    if given is not None:
        if not tensor.is_contiguous():
            raise ConfigError(
                f"pin(tensor of shape {shape}, strides {strides}, ranges=...): ranges= are byte ranges of a "
                "contiguous tensor; give the memory the view is of (e.g. its base, or a flat uint8 view of it)"
            )
        spans = _checked_ranges(given, tensor.numel() * tensor.element_size())
        pitch: int | None = row_bytes
    elif tensor.is_contiguous():
        return None
    else:
        spans, pitch = _view_rows(shape, strides, tensor.element_size())
    first, extent = spans[0][0], spans[-1][0] + spans[-1][1]
    end = extent if pitch is None else max(extent, (shape[0] if shape else 1) * pitch)
    edges = [0, *(x for offset, nbytes in spans for x in (offset, offset + nbytes)), end]  # holes: between ranges
    holes = tuple((lo - first, hi - first) for lo, hi in zip(edges[0::2], edges[1::2], strict=True) if hi > lo)
    return SourceRanges(
        tuple((offset - first, nbytes) for offset, nbytes in spans), extent - first,
        PageRun(-first, end - first, pitch, holes), first,
    )  # fmt: skip


def _view_rows(
    shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int
) -> tuple[list[tuple[int, int]], int | None]:
    """A strided view's contiguous rows as sorted byte ranges (each row: the innermost dimensions
    that are contiguous together), and the pitch of its first-dimension slices (None: they interleave)."""
    what = f"pin(tensor of shape {shape}, strides {strides})"
    k, row = len(shape), 1
    while k and (shape[k - 1] == 1 or strides[k - 1] == row):
        row *= shape[k - 1]
        k -= 1
    if row == 1:
        raise ConfigError(
            f"{what}: its rows are not contiguous (its innermost dimension of size > 1 has stride {strides[k - 1]}, "
            "not 1), so its bytes are not ranges pinpool can register; pin the memory it views (its base tensor), "
            "a view whose last dimension is contiguous, or ranges= of a contiguous tensor"
        )
    offsets = torch.zeros(1, dtype=torch.int64)
    for n, stride in zip(shape[:k], strides[:k], strict=True):  # row-major over the leading dimensions
        offsets = (offsets[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
    ordered = offsets.sort().values
    if len(ordered) > 1 and int((ordered[1:] - ordered[:-1]).min()) < row:
        raise ConfigError(
            f"{what}: its rows of {row * itemsize} B overlap one another (a stride smaller than a row, or 0 from "
            "expand()), and pinpool registers each byte once; pin the memory it views (its base tensor) instead"
        )
    spans = [(offset * itemsize, row * itemsize) for offset in ordered.tolist()]
    # Page i (the first dimension's slice i) starts at i * strides[0]; it is a page run of pitch
    # strides[0] when no slice reaches into the next one.
    reach = row + sum((n - 1) * stride for n, stride in zip(shape[1:k], strides[1:k], strict=True))
    pitch = strides[0] if k and shape[0] > 1 else reach
    return spans, (pitch * itemsize if pitch >= reach else None)


def _checked_ranges(given: object, nbytes: int) -> list[tuple[int, int]]:
    """``ranges=``: ``(offset, nbytes)`` pairs inside the tensor's ``nbytes``, non-empty and not
    overlapping (any order: they are sorted)."""
    fix = "give ranges=[(offset, nbytes), ...]: byte offsets from the tensor's start, each inside it, none overlapping"
    if isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise ConfigError(f"ranges={shown(given)}: not a sequence of (offset, nbytes) pairs; {fix}")
    spans: list[tuple[int, int]] = []
    for item in given:
        pair = tuple(item) if isinstance(item, Sequence) and not isinstance(item, str | bytes) else None
        if pair is None or len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in pair):
            raise ConfigError(f"ranges=: {shown(item)} is not an (offset, nbytes) pair of ints; {fix}")
        offset, size = pair
        if offset < 0 or size <= 0 or offset + size > nbytes:
            raise ConfigError(
                f"ranges=: ({offset}, {size}) is {'empty' if size <= 0 else 'not inside the tensor'}: a range is "
                f"nbytes > 0 bytes from offset >= 0, ending at most at the tensor's {nbytes} B; {fix}"
            )
        spans.append((offset, size))
    if not spans:
        raise ConfigError(f"ranges={shown(given)} holds no range, so there is nothing to pin; {fix}, or drop ranges=")
    spans.sort()
    for (offset, size), (after, after_size) in itertools.pairwise(spans):
        if after < offset + size:
            raise ConfigError(
                f"ranges=: ({offset}, {size}) and ({after}, {after_size}) overlap, and pinpool registers each "
                f"byte once; {fix}"
            )
    return spans
