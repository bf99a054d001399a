"""Chunk planning: pure arithmetic that splits a buffer into registration calls.

Nothing here touches memory or a runtime, so every rule is checked before anything is
allocated or pinned, and the whole module is exhaustively property-tested.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from ._errors import ConfigError
from ._units import decimal_to_int, format_bytes, parse_size

CHUNK_ENV = "PINPOOL_REGISTER_CHUNK_GB"
DEFAULT_CHUNK_GIB = 256


@dataclass(frozen=True, order=True)
class Chunk:
    """One registration call's range, relative to the start of its buffer."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class ChunkPlan:
    """How one buffer of ``nbytes`` is registered.

    ``granularity`` is the layout's copy-page size (``None``: no constraint), ``unit`` the
    step every chunk boundary is a multiple of (lcm of granularity and OS page), and
    ``chunk_bytes`` the size of every chunk but possibly the last.
    """

    nbytes: int
    granularity: int | None
    page_size: int
    limit: int
    unit: int
    chunk_bytes: int
    chunks: tuple[Chunk, ...]


def chunk_limit_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """The per-call limit in bytes from ``PINPOOL_REGISTER_CHUNK_GB`` (GiB, fractions allowed)."""
    env = os.environ if environ is None else environ
    raw = env.get(CHUNK_ENV)
    if raw is None:
        return DEFAULT_CHUNK_GIB << 30
    fix = (
        f"set {CHUNK_ENV} to a positive number of GiB (e.g. 64 or 0.5), or unset it for the default {DEFAULT_CHUNK_GIB}"
    )
    try:
        gib = Decimal(raw.strip())
    except InvalidOperation:
        raise ConfigError(f"{CHUNK_ENV}={raw!r} is not a number; {fix}") from None
    if not gib.is_finite() or gib <= 0:
        raise ConfigError(f"{CHUNK_ENV}={raw!r} must be a positive, finite number of GiB; {fix}")
    nbytes = decimal_to_int(gib, 1 << 30)
    if nbytes is None:
        raise ConfigError(f"{CHUNK_ENV}={raw!r} is too large to be a memory size; {fix}")
    if nbytes <= 0:
        raise ConfigError(f"{CHUNK_ENV}={raw!r} is less than one byte; {fix}")
    return nbytes


def resolve_chunk_limit(chunk_bytes: int | str | None) -> int:
    """``chunk_bytes=`` when given (int or size string), else the environment, else 256 GiB."""
    if chunk_bytes is None:
        return chunk_limit_from_env()
    return parse_size(chunk_bytes, what="chunk_bytes")


def plan_chunks(nbytes: int, *, granularity: int | None, limit: int, page_size: int, start: int = 0) -> ChunkPlan:
    """Split ``nbytes`` into registration chunks.

    Rules: boundaries are multiples of ``granularity`` (so no copy page straddles two
    registrations) and of ``page_size`` (so no OS page belongs to two chunks, which would let
    unlocking one chunk unlock its neighbour's page); no chunk exceeds ``limit``; chunks are
    contiguous and cover ``[0, nbytes)`` exactly. Without a granularity, the whole buffer is
    one registration unless it exceeds ``limit``, then it is split at page boundaries.

    ``start`` is the buffer's address modulo ``page_size`` (non-zero only for memory pinpool
    did not allocate): boundaries are then page-aligned in absolute terms, so the first chunk
    ends at the first multiple of the granularity that falls on a page boundary.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"buffer size {nbytes!r} must be a positive integer number of bytes")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        raise ConfigError(f"page_size={page_size!r} must be a positive integer")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ConfigError(f"chunk limit {limit!r} must be a positive integer number of bytes")
    if granularity is not None:
        if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity <= 0:
            raise ConfigError(
                f"registration granularity {granularity!r} must be a positive integer number of bytes "
                "(the byte size of one copy page); use None for no alignment constraint"
            )
        unit = math.lcm(granularity, page_size)
    else:
        unit = page_size
    if granularity is None and nbytes <= limit:
        return ChunkPlan(nbytes, None, page_size, limit, unit, nbytes, (Chunk(0, nbytes),))
    if unit > limit:
        what = (
            f"lcm(granularity {granularity} B, OS page {page_size} B) = {format_bytes(unit)}"
            if granularity is not None
            else f"the OS page ({page_size} B)"
        )
        raise ConfigError(
            f"{what} is larger than the chunk limit {format_bytes(limit)} ({limit} B): no chunk could hold "
            f"one aligned unit; raise chunk_bytes= or {CHUNK_ENV} to at least {unit} bytes ({format_bytes(unit)})"
        )
    chunk_bytes = (limit // unit) * unit
    # A buffer that fits one call needs no boundary at all, aligned or not.
    first = 0 if nbytes <= limit else _first_boundary(granularity or 1, page_size, start % page_size, unit)
    if first:  # an unaligned start: the first chunk is cut short to reach an aligned boundary
        if first > limit:
            raise ConfigError(
                f"a buffer starting {start % page_size} B into an OS page reaches its first page-aligned multiple "
                f"of the granularity only after {first} B, more than the chunk limit {limit} B; raise chunk_bytes= "
                f"or {CHUNK_ENV} to at least {first} bytes, or allocate the buffer page-aligned"
            )
        head = first + (limit - first) // unit * unit
        offsets = [0, *range(head, nbytes, chunk_bytes)]
    else:
        offsets = list(range(0, nbytes, chunk_bytes))
    ends = [*offsets[1:], nbytes]
    chunks = tuple(Chunk(o, e - o) for o, e in zip(offsets, ends, strict=True))
    return ChunkPlan(nbytes, granularity, page_size, limit, unit, min(chunk_bytes, nbytes), chunks)


def _first_boundary(granularity: int, page_size: int, misalignment: int, unit: int) -> int:
    """The smallest B > 0 with B % granularity == 0 and (misalignment + B) % page_size == 0; 0 if aligned."""
    if misalignment == 0:
        return 0
    for boundary in range(granularity, unit + 1, granularity):
        if (misalignment + boundary) % page_size == 0:
            return boundary
    raise ConfigError(
        f"a buffer starting {misalignment} B into an OS page can never be split at a multiple of its "
        f"granularity ({granularity} B) that is also a page boundary; allocate it page-aligned, or give "
        "chunk_bytes >= its size for a single registration"
    )
