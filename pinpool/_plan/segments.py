"""An elastic pool's reservation as values: its page runs' grids, its segments (a floor and growth steps of
whole chunks) and the lookups from a page or a byte to its segment. Apart from the planning (``reservation``),
which needs the plan's Schedule, so that ``PoolPlan.reservation`` can name them without an import cycle."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .._errors import ConfigError
from .chunks import ChunkTable
from .prefix import PageRun


@dataclass(frozen=True)
class RunGrid:
    """One page run of the reservation, and the grid every chunk boundary in it falls on: ``origin + k * unit``
    (``unit``: lcm(granularity, page)), as :func:`plan_chunks` cuts its buffer."""

    run: PageRun
    buffer: str  # its buffer's name, for messages
    origin: int  # bytes from the pool's start
    granularity: int | None
    page_size: int

    @property
    def unit(self) -> int:
        return math.lcm(self.granularity or 1, self.page_size)

    @property
    def page_bytes(self) -> int:
        assert self.run.page_bytes is not None  # plan_reservation refuses runs without page order
        return self.run.page_bytes

    @property
    def quantum(self) -> int:
        """The fewest pages whose slice of this run is a whole number of units."""
        return self.unit // math.gcd(self.unit, self.page_bytes)

    def slice(self, pages: range) -> tuple[int, int]:
        """Bytes ``[start, end)`` of pages ``pages`` in this run."""
        return self.run.start + pages.start * self.page_bytes, self.run.start + pages.stop * self.page_bytes


@dataclass(frozen=True)
class Segment:
    """Pages ``pages`` of the reservation: ``slices`` (one per run, bytes from the pool's start) and their
    ``chunks`` (sorted by offset). ``floor``: the pages entry pins, kept until exit."""

    index: int
    pages: range
    slices: tuple[tuple[int, int], ...]
    chunks: ChunkTable
    floor: bool = False

    @property
    def nbytes(self) -> int:
        return sum(end - start for start, end in self.slices)


@dataclass(frozen=True)
class Reservation:
    """The reservation's ``num_pages`` as a floor (``floor_pages``, segment 0 when there is one) and segments
    of ``step_pages`` (the last maybe shorter); every boundary a multiple of ``quantum`` pages."""

    num_pages: int
    floor_pages: int
    step_pages: int
    quantum: int
    grids: tuple[RunGrid, ...]  # sorted by run start
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)

    def segment_at_page(self, page: int) -> int:
        """The index of the segment holding layout page ``page``."""
        if not 0 <= page < self.num_pages:
            raise ConfigError(
                f"page {page} is outside the reservation (pages [0, {self.num_pages})): address pages of the pool"
            )
        if page < self.floor_pages:
            return 0
        return (1 if self.floor_pages else 0) + (page - self.floor_pages) // self.step_pages

    def segment_of(self, offset: int) -> int:
        """The index of the segment holding byte ``offset`` of the pool; :class:`ConfigError` for a byte no page
        run holds (a gap between buffers, outside the pool)."""
        starts = [grid.run.start for grid in self.grids]
        at = bisect.bisect_right(starts, offset) - 1
        if at < 0 or offset >= self.grids[at].run.end:
            raise ConfigError(
                f"byte {offset} of the pool is in no page run (outside the pool, or a gap between its buffers): "
                "address bytes of the pool's buffers"
            )
        grid = self.grids[at]
        return self.segment_at_page((offset - grid.run.start) // grid.page_bytes)

    def segments_in(self, pages: range) -> range:
        """The indices of the segments holding any of ``pages`` (empty for no page)."""
        if not pages:
            return range(0)
        return range(self.segment_at_page(pages.start), self.segment_at_page(pages.stop - 1) + 1)
