"""Each transfer registrar's registrations, planned from the pool's chunks: runs of consecutive chunks,
so every registration boundary is a chunk boundary (a multiple of the copy page and of the OS page) and a
copy page is never split between two registrations of any registrar. Pure: no engine is called here."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .._errors import ConfigError
from .._types import RegistrarLimits
from .._units import format_bytes
from .chunks import ChunkTable
from .options import PoolOptions


@dataclass(frozen=True)
class TransferPlan:
    """One registrar's registration calls: ``registrations`` (offsets from the pool's start, sorted,
    each a run of whole chunks within ``limits.max_bytes``)."""

    name: str
    registrations: ChunkTable
    limits: RegistrarLimits
    workers: int = 1  # threads of its own that make its calls

    @property
    def largest_bytes(self) -> int:
        return max((r.nbytes for r in self.registrations), default=0)

    def index_of(self, offset: int) -> int:
        """The registration holding byte ``offset`` (it must hold it: pool offsets only)."""
        return bisect.bisect_right(self.registrations, offset, key=lambda r: r.offset) - 1


def bound_by_registrars(options: PoolOptions, transfers: Sequence[tuple[str, RegistrarLimits]]) -> PoolOptions:
    """``options`` with chunks no larger than the smallest registrar's ``max_bytes`` (a registration is a run
    of whole chunks); :class:`ConfigError` where ``chunk_bytes=`` asks for more."""
    bounded = [(limits.max_bytes, name) for name, limits in transfers if limits.max_bytes]
    if not bounded:
        return options
    most, name = min(bounded)
    if options.chunk_bytes is not None and options.chunk_bytes > most:
        raise ConfigError(
            f"chunk_bytes={options.chunk_bytes} ({format_bytes(options.chunk_bytes)}) is more than registrar "
            f"{name!r} accepts in one registration (limits.max_bytes={most}, {format_bytes(most)}); give "
            f"chunk_bytes <= {most}, or leave it out and pinpool plans chunks within every registrar's limit"
        )
    largest = max(options.buffers, key=lambda spec: spec.nbytes, default=None)
    if options.per_buffer and largest is not None and largest.nbytes > most:
        raise ConfigError(
            f"chunk_bytes='buffer' registers each buffer in one call, but buffer {largest.name!r} "
            f"({format_bytes(largest.nbytes)}) is more than registrar {name!r} accepts in one registration "
            f"(limits.max_bytes={most}, {format_bytes(most)}); leave chunk_bytes out, or give max_chunk_bytes <= {most}"
        )
    if options.chunk_limit <= most:
        return options
    if options.max_chunk_bytes is not None:
        return dataclasses.replace(options, max_chunk_bytes=most)
    return dataclasses.replace(options, chunk_limit=most)


def plan_transfer(
    name: str, limits: RegistrarLimits, chunks: ChunkTable, page_size: int, *, workers: int = 1
) -> TransferPlan:
    """Join consecutive equal ``chunks`` into registrations of at most ``limits.preferred_bytes`` (None: one per
    chunk), never more than ``limits.max_bytes``: a table of runs, whatever the chunk count."""
    target = limits.preferred_bytes or 0
    runs: list[tuple[int, int, int]] = []
    for offset, nbytes, count in chunks.runs:
        if limits.max_bytes and nbytes > limits.max_bytes:  # bound_by_registrars planned within it
            raise ConfigError(f"chunk of {nbytes} B is larger than registrar {name!r} accepts: a pinpool bug")
        joined = max(1, min(count, target // nbytes))
        whole, rest = divmod(count, joined)
        runs.append((offset, nbytes * joined, whole))
        runs.append((offset + nbytes * joined * whole, nbytes * rest, 1 if rest else 0))
    registrations = ChunkTable(runs)
    budget = limits.page_table_entries
    if budget:
        entries = sum(-(-nbytes // page_size) * count for _offset, nbytes, count in registrations.runs)
        if entries > budget:
            raise ConfigError(
                f"registrar {name!r} has a page-table budget of {budget} entries (limits.page_table_entries); "
                f"this pool's {format_bytes(registrations.nbytes)} needs {entries} at its "
                f'{format_bytes(page_size)} pages: use huge_pages="hugetlb" (2 MiB pages need 512x fewer entries), a '
                "smaller pool, or raise the budget where the hardware allows (Mooncake: MC_EFA_MAX_PTE_ENTRIES)"
            )
    return TransferPlan(name, registrations, limits, max(1, min(workers, len(registrations))))


def split_at_registrations(plan: TransferPlan, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
    """``[offset, offset + nbytes)`` cut at ``plan``'s registration boundaries: (offset, nbytes, registration
    index) each; :class:`ConfigError` for bytes no registration holds (a gap between buffers, outside the pool)."""
    pieces: list[tuple[int, int, int]] = []
    end = offset + nbytes
    registrations = plan.registrations
    index = plan.index_of(offset)
    while offset < end:
        held = 0 <= index < len(registrations) and registrations[index].offset <= offset < registrations[index].end
        if not held:
            raise ConfigError(
                f"bytes [{offset}, {end}) of the pool are not all registered with {plan.name!r}: byte {offset} is "
                "in no registration (outside the pool, or a gap between its buffers); address pages or buffers "
                "of the pool"
            )
        piece_end = min(end, registrations[index].end)  # a gap before the next registration raises above
        pieces.append((offset, piece_end - offset, index))
        offset = piece_end
        index += 1
    return pieces
