"""The cutter: where a chunk may be cut after planning, for a retry's halves and the stall budget's pieces.

A registration that fails with a retryable code is split in two (:meth:`RetrySplitter.split`);
under a stall budget each call takes only the first piece of a chunk that fits the budget
(:meth:`RetrySplitter.first_piece`). Either cut must keep every planning invariant: it falls on
its buffer's grid (``ChunkPlan.origin + k * unit``: a multiple of lcm(granularity, OS page)
from the buffer's first boundary), and a buffer planned with no grid (``origin=None``) is never
cut. :func:`retry_splitter` reads the grids from a pool's plan. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .chunks import Chunk

if TYPE_CHECKING:
    from .plan import PoolPlan

__all__ = ["RetryGrid", "RetrySplitter", "retry_splitter"]


@dataclass(frozen=True)
class RetryGrid:
    """Where chunks of one buffer may be cut: ``origin + k * unit``, within ``[start, end)``."""

    start: int
    end: int
    unit: int
    origin: int


@dataclass(frozen=True)
class RetrySplitter:
    """Halves of a failed chunk for a retry that keep every planning invariant: the cut is on its
    buffer's grid (a multiple of lcm(granularity, OS page) from the buffer's first boundary), and
    neither half is below ``floor_bytes`` (min_chunk_bytes) or one unit. Pure."""

    grids: tuple[RetryGrid, ...]
    floor_bytes: int

    def split(self, chunk: Chunk) -> tuple[Chunk, Chunk] | None:
        grid = next((g for g in self.grids if g.start <= chunk.offset < g.end), None)
        if grid is None:
            return None
        floor = max(self.floor_bytes, grid.unit)
        if chunk.nbytes < 2 * floor:
            return None
        mid = chunk.offset + chunk.nbytes // 2
        cut = grid.origin + (mid - grid.origin) // grid.unit * grid.unit
        if cut - chunk.offset < floor:
            cut += grid.unit
        if cut - chunk.offset < floor or chunk.end - cut < floor:
            return None
        return Chunk(chunk.offset, cut - chunk.offset), Chunk(cut, chunk.end - cut)

    def first_piece(self, chunk: Chunk, at_most: int) -> Chunk:
        """The first piece of ``chunk`` of at most ``at_most`` bytes cut on its buffer's grid (one
        unit when ``at_most`` is less), or the whole chunk where no cut fits (the stall budget)."""
        grid = next((g for g in self.grids if g.start <= chunk.offset < g.end), None)
        if grid is None or chunk.nbytes <= at_most:
            return chunk
        cut = grid.origin + (chunk.offset + at_most - grid.origin) // grid.unit * grid.unit
        if cut <= chunk.offset:
            cut = grid.origin + ((chunk.offset - grid.origin) // grid.unit + 1) * grid.unit
        return chunk if cut >= chunk.end else Chunk(chunk.offset, cut - chunk.offset)

    def unit_of(self, chunk: Chunk) -> int:
        """The cut unit of ``chunk``'s buffer (lcm(granularity, OS page)); its size where it has none."""
        grid = next((g for g in self.grids if g.start <= chunk.offset < g.end), None)
        return chunk.nbytes if grid is None else grid.unit


def retry_splitter(plan: PoolPlan, min_chunk_bytes: int) -> RetrySplitter:
    """The retry cuts allowed in ``plan``'s buffers: each buffer's own grid (``ChunkPlan.origin``),
    so a caller's unaligned tensor keeps its page-aligned boundaries, or its shared-page grid."""
    grids = []
    for buffer in plan.buffers:
        if buffer.plan is None or buffer.plan.origin is None:  # no aligned cut exists: never split
            continue
        grids.append(
            RetryGrid(
                buffer.offset, buffer.offset + buffer.spec.nbytes, buffer.plan.unit, buffer.offset + buffer.plan.origin
            )
        )
    return RetrySplitter(tuple(grids), min_chunk_bytes)
