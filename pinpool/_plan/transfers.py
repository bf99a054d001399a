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
from .chunks import Chunk
from .options import PoolOptions


@dataclass(frozen=True)
class TransferPlan:
    """One registrar's registration calls: ``registrations`` (offsets from the pool's start, sorted,
    each a run of whole chunks within ``limits.max_bytes``)."""

    name: str
    registrations: tuple[Chunk, ...]
    limits: RegistrarLimits

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
    if options.chunk_limit <= most:
        return options
    if options.max_chunk_bytes is not None:
        return dataclasses.replace(options, max_chunk_bytes=most)
    return dataclasses.replace(options, chunk_limit=most)


def plan_transfer(name: str, limits: RegistrarLimits, chunks: Sequence[Chunk], page_size: int) -> TransferPlan:
    """Join consecutive, back-to-back ``chunks`` (offset order) into registrations of at most
    ``limits.preferred_bytes`` (None: one per chunk) and never more than ``limits.max_bytes``."""
    most = limits.max_bytes or 0
    target = min(limits.preferred_bytes or 0, most) if most else limits.preferred_bytes or 0
    runs: list[Chunk] = []
    start = end = -1
    total = 0
    for chunk in chunks:
        if most and chunk.nbytes > most:  # bound_by_registrars planned within it: a pinpool bug otherwise
            raise ConfigError(
                f"chunk {chunk} is larger than registrar {name!r} accepts ({most} B); report this as a pinpool bug"
            )
        joins = chunk.offset == end and total + chunk.nbytes <= target
        if not joins:
            if start >= 0:
                runs.append(Chunk(start, end - start))
            start, total = chunk.offset, 0
        end = chunk.offset + chunk.nbytes
        total += chunk.nbytes
    if start >= 0:
        runs.append(Chunk(start, end - start))
    budget = limits.page_table_entries
    if budget:
        entries = sum(-(-run.nbytes // page_size) for run in runs)
        if entries > budget:
            raise ConfigError(
                f"registrar {name!r} has a page-table budget of {budget} entries (limits.page_table_entries); "
                f"this pool's {format_bytes(sum(r.nbytes for r in runs))} needs {entries} at its "
                f"{format_bytes(page_size)} pages: use huge_pages=True (2 MiB pages need 512x fewer entries), a "
                "smaller pool, or raise the budget where the hardware allows (Mooncake: MC_EFA_MAX_PTE_ENTRIES)"
            )
    return TransferPlan(name, tuple(runs), limits)


def split_at_registrations(plan: TransferPlan, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
    """``[offset, offset + nbytes)`` cut at ``plan``'s registration boundaries: (offset, nbytes, registration
    index) each; :class:`ConfigError` for bytes no registration holds (a gap between buffers, outside the pool)."""
    pieces: list[tuple[int, int, int]] = []
    end = offset + nbytes
    registrations = plan.registrations
    index = plan.index_of(offset)
    while offset < end:
        if (
            index < 0
            or index >= len(registrations)
            or not registrations[index].offset <= offset < registrations[index].end
        ):
            raise ConfigError(
                f"bytes [{offset}, {end}) of the pool are not all registered with {plan.name!r}: byte {offset} is "
                "in no registration (outside the pool, or a gap between its buffers); address pages or buffers "
                "of the pool"
            )
        piece_end = min(end, registrations[index].end)
        pieces.append((offset, piece_end - offset, index))
        offset = piece_end
        index += 1
    return pieces
