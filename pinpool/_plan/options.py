"""A pool's options, validated once: the one spelling PinnedPool and pin() share.

:class:`PoolOptions` holds what a user chose about a pool (not the host's facts, nor the
runtime object): :meth:`PoolOptions.create` takes the user's spellings (``size="64GiB"``,
``chunk_bytes=None`` meaning the environment's limit, ``layout=None``) and normalises them;
the constructor itself checks every field, so no invalid options value exists. Both raise
:class:`ConfigError` naming the value and the fix. The chunk limit a user's ``chunk_bytes=None``
means (``PINPOOL_REGISTER_CHUNK_GB``, else 256 GiB) is resolved here too. :func:`pinpool._plan.plan.plan_pool`
turns options plus host facts into a plan.
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from dataclasses import InitVar, dataclass, field

from .._errors import ConfigError
from .._layouts.spec import is_layout, layout_buffers, layout_page_bytes, positive_int
from .._units import HUGETLB_PAGE_SIZES, format_bytes, parse_env_gib, parse_size, shown
from ..layouts import BufferSpec, Layout, Raw
from .declared import DEFAULT_MAX_RETRIES, PER_BUFFER

__all__ = [
    "BACKGROUND_MAX_CALL_SECONDS",
    "CHUNK_ENV",
    "DEFAULT_CHUNK_GIB",
    "DEFAULT_MAX_RETRIES",
    "PoolOptions",
    "chunk_limit_from_env",
    "min_num_pages",
    "resolve_chunk_limit",
    "resolve_max_call_seconds",
    "resolve_pin_nice",
]

# ``pin_nice="auto"``: a background pool's pin workers run this much nicer than the process.
# Measured in docs/performance.md ("Serving: pinning leaves serving its CPU (pin_nice)"): the
# /healthz tail moved most at 10; 3-5 left it in place, 19 and SCHED_IDLE held locks 0.7-2.2 s.
BACKGROUND_PIN_NICE = 10
MAX_NICE = 19  # Linux's lowest priority

HUGE_PAGES = (False, True, *HUGETLB_PAGE_SIZES)


# The per-call limit when chunk_bytes= and max_chunk_bytes= are not given: the environment's, else 256 GiB.
CHUNK_ENV = "PINPOOL_REGISTER_CHUNK_GB"
DEFAULT_CHUNK_GIB = 256


def chunk_limit_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """The per-call limit in bytes from ``PINPOOL_REGISTER_CHUNK_GB`` (GiB, fractions allowed)."""
    env = os.environ if environ is None else environ
    raw = env.get(CHUNK_ENV)
    if raw is None:
        return DEFAULT_CHUNK_GIB << 30
    return parse_env_gib(CHUNK_ENV, raw, default_gib=DEFAULT_CHUNK_GIB)


def resolve_chunk_limit(chunk_bytes: int | str | None) -> int:
    """``chunk_bytes=`` when given (int or size string), else the environment, else 256 GiB."""
    if chunk_bytes is None:
        return chunk_limit_from_env()
    return parse_size(chunk_bytes, what="chunk_bytes")


# The most threads of one role a pool may start: far more than any host has cores for (the
# defaults are CPUs, up to 16 or 8), few enough that a typo (10**6) fails here, not in thread starts.
MAX_WORKERS = 1024
# The longest stall budget: one call may hold the driver or mmap lock at most an hour. A budget
# is meant to be tens of milliseconds; beyond this it bounds nothing, and the sizer's arithmetic
# (bytes = seconds / seconds-per-byte) would leave the numbers a call size can be.
MAX_CALL_SECONDS = 3600.0
# Linux numbers NUMA nodes below MAX_NUMNODES, at most 1 << 10 (CONFIG_NODES_SHIFT <= 10).
MAX_NUMA_NODES = 1024


def _check_workers(option: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{option}={shown(value)} must be a positive int (or None for the default)")
    if value is not None and value > MAX_WORKERS:
        raise ConfigError(
            f"{option}={shown(value)} is more than {MAX_WORKERS} threads; give at most {MAX_WORKERS} "
            "(a few per core is plenty), or None for the default (sized from the CPUs)"
        )


def _check_fits_a_page(
    layout: Layout, budget: int, given: object, *, num_pages: int | None = None
) -> tuple[BufferSpec, ...]:
    """A pool must hold at least one page, and one copy page of every buffer; returns the buffers
    it holds, checked (a pool's one ``layout.buffers(num_pages)`` call: the placement reads them).

    ``num_pages``: the pool was asked for by page count (``budget`` is that many pages), so the
    message names it. The layout is checked on the way (:func:`layout_page_bytes`,
    :func:`layout_buffers`): a custom layout's mistakes are ConfigErrors here, before anything
    is mapped, not a ZeroDivisionError in the plan."""
    page_bytes, one_page, smallest = _smallest_pool(layout)
    if budget < smallest and num_pages is not None:
        pages = -(-smallest // page_bytes)
        raise ConfigError(
            f"num_pages={shown(num_pages)} ({shown(budget)} B) is smaller than one copy page of a buffer of layout "
            f"{layout.name!r} ({shown(smallest)} B = {format_bytes(smallest)}); give num_pages={shown(pages)} or more"
        )
    if budget < smallest:
        raise ConfigError(
            f"size={shown(given)} ({shown(budget)} B) is smaller than one page of layout {layout.name!r} "
            f"({shown(smallest)} B = {format_bytes(smallest)}); give a size of at least {shown(smallest)} bytes"
        )
    pages = budget // page_bytes
    return one_page if pages == 1 else layout_buffers(layout, pages)  # the buffers this pool will have


def _smallest_pool(layout: Layout) -> tuple[int, tuple[BufferSpec, ...], int]:
    """The layout's page_bytes, its buffers for one page, and the fewest bytes a pool of it holds:
    one page, and one copy page of every buffer (the layout checked on the way)."""
    page_bytes = layout_page_bytes(layout)
    one_page = layout_buffers(layout, 1)  # how small is too small, and a custom layout's mistakes, named for 1 page
    return page_bytes, one_page, max([page_bytes, *(s.granularity or 0 for s in one_page)])


def min_num_pages(layout: Layout) -> int:
    """The fewest pages a pool of ``layout`` may hold (``num_pages=`` below it is refused)."""
    page_bytes, _, smallest = _smallest_pool(layout)
    return -(-smallest // page_bytes)


# max_call_seconds="auto" for a background pool: its body is serving while it pins; under mlock
# each populate call holds mmap_lock, which the event loop's own allocations wait behind
# (measured: the loop stalled for the whole pin without a budget).
BACKGROUND_MAX_CALL_SECONDS = 0.05

_SIZE_OR_PAGES_FIX = (
    'give exactly one of size= (a byte budget such as "64GiB": the pool holds the whole pages that fit) or '
    "num_pages= (a page count: the pool holds exactly that many pages, e.g. to pair an MLA pool with its "
    "Indexer pool)"
)


def _check_num_pages(num_pages: object) -> int:
    """``num_pages=``: a positive int (never a bool, a float or a string)."""
    if not positive_int(num_pages):
        raise ConfigError(
            f"num_pages={shown(num_pages)} must be a positive int number of layout pages (pool.num_pages of a pool "
            "to pair with), or None to size the pool by size= instead"
        )
    return num_pages


def _budget_of(layout: Layout, size: int | str | None, num_pages: object) -> tuple[int, int | None]:
    """The byte budget and page count that ``size=`` or ``num_pages=`` asks for: exactly one of them."""
    if (size is None) == (num_pages is None):
        both = f"both were given (size={shown(size)}, num_pages={shown(num_pages)})"
        given = "neither was given" if size is None else both
        raise ConfigError(f"size= or num_pages=: {given}; {_SIZE_OR_PAGES_FIX}")
    if size is not None:
        return parse_size(size, what="size"), None
    pages = _check_num_pages(num_pages)
    return pages * layout_page_bytes(layout), pages


@dataclass(frozen=True)
class PoolOptions:
    """What a pool is asked to be. Sizes are bytes.

    layout: what the memory holds. size: the byte budget (the pool holds the largest whole
    number of layout pages that fits). num_pages: set when the pool was asked for by page count
    (:meth:`create` with ``num_pages=``): then ``size`` is exactly ``num_pages *
    layout.page_bytes``, so the pool holds exactly that many pages. chunk_bytes: an explicit
    chunk size (None: the limit is ``chunk_limit`` and chunks may be split further for the
    workers). max_chunk_bytes: an upper bound given as a keyword (``chunk_bytes``, if also
    given, must not exceed it). chunk_limit: the per-call limit: ``chunk_bytes`` when given,
    else ``max_chunk_bytes``, else ``PINPOOL_REGISTER_CHUNK_GB`` as :meth:`create` read it
    (default 256 GiB). per_buffer: one registration per buffer (``chunk_bytes="buffer"``),
    never cut (no split for workers, no stall-budget pieces, no retry halves). populate:
    pre-fault (None: where supported). *_workers: threads per role (None: the default).
    huge_pages: False, True (THP), "hugetlb" (or "hugetlb:2MiB") or "hugetlb:1GiB". numa_node: bind the
    memory to this node.
    name: the pool's name in logs, metrics and errors.
    min_chunk_bytes / max_retries / retry_codes: the retry policy: a registration failing with
    one of ``retry_codes`` (None: its runtime's retryable codes) is retried as aligned halves,
    down to ``min_chunk_bytes`` (None: one alignment unit), at most ``max_retries`` halvings
    below its planned chunk (per chunk lineage, not per pool; 0: never retry).
    max_call_seconds: the stall budget: every registration and populate call is sized from
    the rate of the previous ones so it should not take longer (None: no budget).
    budget_yields_to: the explicit chunk option (``"chunk_bytes"``, ``"max_chunk_bytes"``) an
    ``"auto"`` budget yields to for registrations (populate calls still fit it), else None.
    pin_nice: how much nicer than the process the pin worker threads run (0: as nice as it;
    :func:`resolve_pin_nice` turns the user's ``"auto"`` / None into this number).
    background: the pool pins in the background (:meth:`create` resolves ``"auto"`` budgets
    and niceness from it).
    """

    size: int
    layout: Layout = field(default_factory=Raw)
    chunk_bytes: int | None = None
    chunk_limit: int = DEFAULT_CHUNK_GIB << 30
    populate: bool | None = None
    populate_workers: int | None = None
    register_workers: int | None = None
    unpin_workers: int | None = None
    huge_pages: bool | str = False
    numa_node: int | None = None
    name: str = "default"
    min_chunk_bytes: int | None = None
    max_retries: int = DEFAULT_MAX_RETRIES
    max_call_seconds: float | None = None
    num_pages: int | None = None
    pin_nice: int = 0
    max_chunk_bytes: int | None = None
    per_buffer: bool = False
    background: bool = False
    retry_codes: frozenset[int] | None = None
    budget_yields_to: str | None = None
    # The layout's buffers for this size, checked: computed once, here; the placement reads them.
    buffers: tuple[BufferSpec, ...] = field(init=False, repr=False, compare=False)
    # create() checked the buffers already (before the options it parses after them, so errors
    # come in the order users have always seen them): they are handed over, not read again.
    checked_buffers: InitVar[tuple[BufferSpec, ...] | None] = None

    @classmethod
    def create(
        cls,
        *,
        layout: Layout | None = None,
        size: int | str | None = None,
        num_pages: int | None = None,
        chunk_bytes: int | str | None = None,
        max_chunk_bytes: int | str | None = None,
        populate: bool | None = None,
        populate_workers: int | None = None,
        register_workers: int | None = None,
        unpin_workers: int | None = None,
        huge_pages: bool | str = False,
        numa_node: int | None = None,
        name: str = "default",
        min_chunk_bytes: int | str | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        retry_codes: Collection[int] | None = None,
        max_call_seconds: float | str | None = "auto",
        background: bool = False,
        pin_nice: int | str | None = "auto",
    ) -> PoolOptions:
        """Options from a user's spellings (the parameters are pinpool._plan.declared's, with the same
        defaults as PinnedPool's): sizes as ints or strings (``"64GiB"``), ``layout=None`` for
        :class:`Raw`, ``chunk_bytes=None`` for the limit of ``max_chunk_bytes``, else
        ``PINPOOL_REGISTER_CHUNK_GB`` (read now), ``chunk_bytes="buffer"`` for one registration
        per buffer, ``"auto"`` budgets and niceness resolved for ``background``. Exactly one of
        ``size`` (a byte budget) and ``num_pages`` (a page count: ``size`` becomes ``num_pages *
        layout.page_bytes``)."""
        if not isinstance(background, bool):
            raise ConfigError(f"background={background!r} must be True or False")
        resolved = Raw() if layout is None else layout
        _check_plain(resolved, layout, populate, populate_workers, register_workers, unpin_workers, huge_pages,
                     numa_node, name)  # fmt: skip
        budget, pages = _budget_of(resolved, size, num_pages)
        per_buffer = isinstance(chunk_bytes, str) and chunk_bytes == PER_BUFFER
        bound = None if max_chunk_bytes is None else parse_size(max_chunk_bytes, what="max_chunk_bytes")
        if per_buffer:
            exact, limit = None, budget if bound is None else bound
        elif chunk_bytes is not None:
            exact = limit = resolve_chunk_limit(chunk_bytes)
        else:
            exact, limit = None, resolve_chunk_limit(None) if bound is None else bound
        specs = _check_fits_a_page(resolved, budget, size, num_pages=pages)
        stall = resolve_max_call_seconds(max_call_seconds, background=background, per_buffer=per_buffer)
        # An "auto" budget yields to an explicit chunk option for registrations (the user said how
        # to chunk; "auto" is only a default); a number given with exact chunks is refused below.
        yields_to = None
        if stall is not None and isinstance(max_call_seconds, str):
            yields_to = "chunk_bytes" if exact is not None else "max_chunk_bytes" if bound is not None else None
        floor = None if min_chunk_bytes is None else parse_size(min_chunk_bytes, what="min_chunk_bytes")
        return cls(
            size=budget, layout=resolved, chunk_bytes=exact, chunk_limit=limit,
            populate=populate, populate_workers=populate_workers, register_workers=register_workers,
            unpin_workers=unpin_workers, huge_pages=huge_pages, numa_node=numa_node, name=name,
            min_chunk_bytes=floor, max_retries=max_retries, max_call_seconds=stall,
            num_pages=pages, pin_nice=resolve_pin_nice(pin_nice, background=background), max_chunk_bytes=bound,
            per_buffer=per_buffer, background=background, retry_codes=_retry_codes(retry_codes),
            budget_yields_to=yields_to, checked_buffers=specs,
        )  # fmt: skip

    def __post_init__(self, checked_buffers: tuple[BufferSpec, ...] | None) -> None:
        _check_plain(self.layout, self.layout, self.populate, self.populate_workers, self.register_workers,
                     self.unpin_workers, self.huge_pages, self.numa_node, self.name)  # fmt: skip
        if isinstance(self.size, str):
            raise ConfigError(f"size={self.size!r}: PoolOptions takes bytes; use PoolOptions.create for size strings")
        parse_size(self.size, what="size")
        if self.chunk_bytes is not None:
            if isinstance(self.chunk_bytes, str):
                raise ConfigError(
                    f"chunk_bytes={self.chunk_bytes!r}: PoolOptions takes bytes; use PoolOptions.create for strings"
                )
            parse_size(self.chunk_bytes, what="chunk_bytes")
        self._check_chunk_options()
        limit = self.chunk_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ConfigError(f"chunk_limit={limit!r} must be a positive int number of bytes")
        if self.num_pages is not None:
            pages, page_bytes = _check_num_pages(self.num_pages), layout_page_bytes(self.layout)
            if self.size != pages * page_bytes:
                raise ConfigError(
                    f"PoolOptions(size={self.size!r}, num_pages={pages}): size must be num_pages * layout.page_bytes "
                    f"({pages} * {page_bytes}); give one of them (PoolOptions.create computes the size)"
                )
        if checked_buffers is None:
            checked_buffers = _check_fits_a_page(self.layout, self.size, self.size, num_pages=self.num_pages)
        object.__setattr__(self, "buffers", checked_buffers)
        self._check_retry_policy()
        _check_max_call_seconds(self.max_call_seconds)
        if self.per_buffer and self.max_call_seconds is not None:
            raise ConfigError(_per_buffer_budget(self.max_call_seconds))
        self._check_budget_yields()
        _check_pin_nice(self.pin_nice)
        if not isinstance(self.background, bool):
            raise ConfigError(f"background={self.background!r} must be True or False")

    def _check_retry_policy(self) -> None:
        """min_chunk_bytes, max_retries, retry_codes: each valid (retry_codes normalised to a frozenset)."""
        if isinstance(self.min_chunk_bytes, str):
            raise ConfigError(
                f"min_chunk_bytes={self.min_chunk_bytes!r}: PoolOptions takes bytes; use PoolOptions.create for strings"
            )
        if self.min_chunk_bytes is not None:
            parse_size(self.min_chunk_bytes, what="min_chunk_bytes")
        retries = self.max_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise ConfigError(
                f"max_retries={shown(retries)} must be an int from 0 to {MAX_RETRIES}: how many times one planned "
                "registration may be halved, level after level (0 never retries; the default "
                f"{DEFAULT_MAX_RETRIES} lets halving reach one 4 KiB page from 16 TiB; {MAX_RETRIES} halvings "
                "already reach one byte from any size an address space holds)"
            )
        object.__setattr__(self, "retry_codes", _retry_codes(self.retry_codes))

    def _check_budget_yields(self) -> None:
        """chunk_bytes is exact: a stall budget may not cut it, unless the budget was "auto" and yields."""
        yields = self.budget_yields_to
        if yields not in (None, "chunk_bytes", "max_chunk_bytes") or (yields and getattr(self, yields) is None):
            raise ConfigError(
                f"budget_yields_to={yields!r}: None, or the chunk option given; PoolOptions.create sets it"
            )
        if self.chunk_bytes is not None and self.max_call_seconds is not None and yields is None:
            raise ConfigError(
                f"chunk_bytes={shown(self.chunk_bytes)} ({format_bytes(self.chunk_bytes)}) makes every registration "
                f"exactly that size, and max_call_seconds={shown(self.max_call_seconds)} would cut them into pieces "
                "that fit the stall budget; give max_chunk_bytes= instead of chunk_bytes= (an upper bound the budget "
                'may cut further), or max_call_seconds=None (or "auto": the budget then yields to chunk_bytes for '
                "registrations)"
            )

    def _check_chunk_options(self) -> None:
        """chunk_bytes, max_chunk_bytes, per_buffer: each valid, and not contradicting each
        other; the chunk limit follows from them (an explicit chunk size is the limit)."""
        bound = self.max_chunk_bytes
        if bound is not None:
            if isinstance(bound, str):
                raise ConfigError(
                    f"max_chunk_bytes={bound!r}: PoolOptions takes bytes; use PoolOptions.create for strings"
                )
            parse_size(bound, what="max_chunk_bytes")
        if not isinstance(self.per_buffer, bool):
            raise ConfigError(f"per_buffer={self.per_buffer!r} must be True or False")
        if self.per_buffer and self.chunk_bytes is not None:
            raise ConfigError(
                f"per_buffer=True with chunk_bytes={self.chunk_bytes!r}: one registration per buffer has no chunk "
                "size; give one of them"
            )
        if self.chunk_bytes is not None:
            if bound is not None and self.chunk_bytes > bound:
                raise ConfigError(
                    f"chunk_bytes={shown(self.chunk_bytes)} ({format_bytes(self.chunk_bytes)}) is more than "
                    f"max_chunk_bytes={shown(bound)} ({format_bytes(bound)}): chunk_bytes is the exact size of every "
                    "registration call and max_chunk_bytes its upper bound; give chunk_bytes <= max_chunk_bytes, or "
                    "only one of them"
                )
            object.__setattr__(self, "chunk_limit", self.chunk_bytes)
        elif bound is not None:
            object.__setattr__(self, "chunk_limit", bound)


# max_retries above this is meaningless: 64 halvings reach one byte from 2**64 bytes.
MAX_RETRIES = 64
# A runtime's error codes (cudaError_t, hipError_t) are positive C ints; 0 is success.
MAX_ERROR_CODE = 2**31 - 1


def _retry_codes(codes: object) -> frozenset[int] | None:
    """``retry_codes=``: None (the runtime's own), or a collection of positive int error codes."""
    if codes is None:
        return None
    fix = (
        f"retry_codes={shown(codes)} must be a collection of the runtime's error codes, positive ints such as "
        "(1, 2) for CUDA (invalid value, out of memory); () never retries; None (the default) takes the "
        "runtime's own (Capabilities.retryable_codes)"
    )
    if isinstance(codes, str | bytes) or not isinstance(codes, Collection):
        raise ConfigError(fix)
    for code in codes:
        if isinstance(code, bool) or not isinstance(code, int) or not 0 < code <= MAX_ERROR_CODE:
            raise ConfigError(f"{fix}; {shown(code)} is not one")
    return frozenset(codes)


_PIN_NICE_FIX = (
    f"give an int from 0 to {MAX_NICE} (how much nicer than the process the pin worker threads run; "
    f'0 keeps the process\'s priority), None (the same as 0), or "auto" (the default: {BACKGROUND_PIN_NICE} '
    "for a background pool, 0 otherwise)"
)


def _check_pin_nice(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NICE:
        raise ConfigError(f"pin_nice={shown(value)}: {_PIN_NICE_FIX}")
    return value


def resolve_pin_nice(value: object, *, background: bool) -> int:
    """``pin_nice=`` as the user spells it (``"auto"``, None or an int) → the nice increment of
    the pin worker threads: ``"auto"`` lowers a background pool's pin workers (its body serves
    while it pins), and leaves a foreground pool's alone (nothing else runs while it pins)."""
    if value is None:
        return 0
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"pin_nice={shown(value)}: {_PIN_NICE_FIX}")
        return BACKGROUND_PIN_NICE if background else 0
    return _check_pin_nice(value)


def resolve_max_call_seconds(value: object, *, background: bool, per_buffer: bool = False) -> float | None:
    """``max_call_seconds=`` as the user spells it → the stall budget: ``"auto"`` is
    :data:`BACKGROUND_MAX_CALL_SECONDS` for a background pool (its body serves while it pins)
    and none for a pool entered before its body runs, or whose registrations cannot be cut
    (``per_buffer``); a number is checked (and refused for ``per_buffer``)."""
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(
                f"max_call_seconds={value!r} must be a number of seconds, None (no budget) or "
                '"auto" (the default: 50 ms for a background pool, none otherwise)'
            )
        return BACKGROUND_MAX_CALL_SECONDS if background and not per_buffer else None
    _check_max_call_seconds(value)
    if per_buffer and value is not None:
        raise ConfigError(_per_buffer_budget(value))
    return value  # type: ignore[return-value]  # checked: None or a number


def _per_buffer_budget(value: object) -> str:
    return (
        f'max_call_seconds={shown(value)} with chunk_bytes="{PER_BUFFER}": one registration per buffer cannot be '
        'cut to fit a stall budget; give max_call_seconds=None (or "auto", which gives such a pool none), or '
        "chunk sizes that may be cut (chunk_bytes= or max_chunk_bytes=)"
    )


def _check_max_call_seconds(budget: object) -> None:
    """The stall budget: None, or a finite number of seconds in (0, MAX_CALL_SECONDS] (never a bool)."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < math.inf:
        raise ConfigError(
            f"max_call_seconds={shown(budget)} must be a positive number of seconds, at most {MAX_CALL_SECONDS:g} "
            "(e.g. 0.02: no registration or populate call may hold the driver or mmap lock longer than 20 ms), "
            "or None for no budget"
        )
    if budget > MAX_CALL_SECONDS:
        raise ConfigError(
            f"max_call_seconds={shown(budget)} is more than {MAX_CALL_SECONDS:g} seconds: a stall budget bounds how "
            "long one call may hold the driver or mmap lock (e.g. 0.02 for 20 ms); give at most "
            f"{MAX_CALL_SECONDS:g}, or None for no budget"
        )


def _check_plain(
    layout: object,
    given_layout: object,
    populate: object,
    populate_workers: int | None,
    register_workers: int | None,
    unpin_workers: int | None,
    huge_pages: object,
    numa_node: object,
    name: object,
) -> None:
    """The checks that need neither parsing nor the host, in the order users have always seen them."""
    if not is_layout(layout):
        raise ConfigError(f"layout={given_layout!r} is not a layout; use one from pinpool.layouts, e.g. layouts.Raw()")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"name={name!r} must be a non-empty str (it labels the pool's logs and metrics)")
    if populate is not None and not isinstance(populate, bool):
        raise ConfigError(f"populate={populate!r} must be True, False or None (the default: on where supported)")
    if not isinstance(huge_pages, bool | str) or huge_pages not in HUGE_PAGES:
        raise ConfigError(
            f"huge_pages={huge_pages!r} must be False, True (transparent huge pages) or 'hugetlb' "
            "(2 MiB pages reserved in vm.nr_hugepages; also spelled 'hugetlb:2MiB'), or 'hugetlb:1GiB' "
            "(1 GiB pages reserved with hugepagesz=1G hugepages=N on the kernel command line)"
        )
    for option, value in (
        ("populate_workers", populate_workers), ("register_workers", register_workers),
        ("unpin_workers", unpin_workers),
    ):  # fmt: skip
        _check_workers(option, value)
    if numa_node is not None and (
        isinstance(numa_node, bool) or not isinstance(numa_node, int) or not 0 <= numa_node < MAX_NUMA_NODES
    ):
        raise ConfigError(
            f"numa_node={shown(numa_node)} is not a NUMA node number; give a node's int id, from 0 to "
            f"{MAX_NUMA_NODES - 1} (numactl -H lists them), or None to let the kernel place the memory"
        )
