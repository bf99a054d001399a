"""A pool's options: :meth:`PoolOptions.create` turns spellings into values, the dataclass checks each
field once, every failure a :class:`ConfigError` naming the value and the fix."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection
from dataclasses import InitVar, dataclass, field
from typing import Any

from .._errors import ConfigError
from .._units import HUGETLB_PAGE_SIZES, format_bytes, parse_env_gib, parse_size, shown
from ..layouts._families import Raw
from ..layouts._spec import BufferSpec, Layout, check_layout, is_layout, layout_page_bytes, positive_int, require_layout
from .declared import DEFAULT_MAX_RETRIES, OPTIONS, PER_BUFFER, keyword_signature

# pin_nice="auto" for a background pool (why 10: docs/performance.md, "pinning leaves serving its CPU").
BACKGROUND_PIN_NICE = 10
MAX_NICE = 19  # Linux's lowest priority
# max_call_seconds="auto" for a background pool: each populate call holds mmap_lock, which serving waits behind.
BACKGROUND_MAX_CALL_SECONDS = 0.05
HUGE_PAGES = (False, True, *HUGETLB_PAGE_SIZES)
CHUNK_ENV = "PINPOOL_REGISTER_CHUNK_GB"  # the per-call limit without chunk_bytes= or max_chunk_bytes=
DEFAULT_CHUNK_GIB = 256
MAX_WORKERS = 1024  # per role: a typo (10**6) fails here, not in thread starts
MAX_CALL_SECONDS = 3600.0  # beyond an hour a budget bounds nothing, and the sizer's bytes outgrow any size
MAX_NUMA_NODES = 1024  # Linux's MAX_NUMNODES is at most 1 << 10 (CONFIG_NODES_SHIFT <= 10)
MAX_RETRIES = 64  # 64 halvings reach one byte from 2**64 bytes
MAX_ERROR_CODE = 2**31 - 1  # cudaError_t, hipError_t: positive C ints; 0 is success


def chunk_limit_from_env(environ: dict[str, str] | os._Environ[str] | None = None) -> int:
    """The per-call limit in bytes from ``PINPOOL_REGISTER_CHUNK_GB`` (GiB, fractions allowed)."""
    raw = (os.environ if environ is None else environ).get(CHUNK_ENV)
    return DEFAULT_CHUNK_GIB << 30 if raw is None else parse_env_gib(CHUNK_ENV, raw, default_gib=DEFAULT_CHUNK_GIB)


def _bytes(value: object, what: str) -> Any:  # a size string parsed; anything else is the dataclass's to check
    return parse_size(value, what=what) if isinstance(value, str) else value


def _smallest_pool(layout: Layout) -> tuple[int, tuple[BufferSpec, ...], int]:
    """page_bytes, one page's buffers, and the fewest bytes a pool holds (a page, a copy page of each)."""
    one_page = check_layout(layout, 1)
    page_bytes = layout.page_bytes
    return page_bytes, one_page, max([page_bytes, *(s.granularity or 0 for s in one_page)])


def min_num_pages(layout: Layout) -> int:
    page_bytes, _, smallest = _smallest_pool(layout)
    return -(-smallest // page_bytes)


_SIZE_OR_PAGES_FIX = (
    'give exactly one of size= (a byte budget such as "64GiB": the pool holds the whole pages that fit) or '
    "num_pages= (a page count: the pool holds exactly that many pages, e.g. to pair an MLA pool with its "
    "Indexer pool)"
)
_CREATE = tuple(o for o in OPTIONS if o.create)


@dataclass(frozen=True)
class PoolOptions:
    """What a pool is asked to be, in bytes (fields as :mod:`pinpool._plan.declared` says); chunk_limit: the
    first chunk option given, else ``PINPOOL_REGISTER_CHUNK_GB``; per_buffer: ``chunk_bytes="buffer"``."""

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
    reserve: int | None = None  # an elastic pool's reservation in bytes (size= is its floor); None: fixed
    grow_step: int = 1 << 30
    # A grow's (max_call_seconds, budget_yields_to, pin_nice): the options as given, "auto" resolved as for a
    # background pool; None: options made without create(), whose values are all explicit already.
    grows_with: tuple[float | None, str | None, int] | None = field(default=None, repr=False, compare=False)
    buffers: tuple[BufferSpec, ...] = field(init=False, repr=False, compare=False)
    spelled: InitVar[object] = None  # size= as create was given it ("1KiB"), for messages

    @classmethod
    def create(cls, **given: Any) -> PoolOptions:
        """Options from their spellings (size strings, ``layout=None``, ``"buffer"``, ``"auto"``); reads the env."""
        for name in sorted(given.keys() - {o.name for o in _CREATE}):
            raise TypeError(f"PoolOptions.create() got an unexpected keyword argument {name!r}")
        o = {option.name: given.get(option.name, option.default) for option in _CREATE}
        layout = Raw() if o["layout"] is None else o["layout"]
        size = _size(layout, o["size"], o["num_pages"])
        chunk, bound = o["chunk_bytes"], _bytes(o["max_chunk_bytes"], "max_chunk_bytes")
        per_buffer = isinstance(chunk, str) and chunk == PER_BUFFER
        exact = None if per_buffer or chunk is None else _bytes(chunk, "chunk_bytes")
        background = o["background"] is True
        stall, yields_to = _stall_budget(o["max_call_seconds"], background and not per_buffer, exact, bound)
        grow_stall, grow_yields_to = _stall_budget(o["max_call_seconds"], not per_buffer, exact, bound)
        grows_with = (grow_stall, grow_yields_to, _pin_nice(o["pin_nice"], True))
        return cls(**{
            **o, "layout": layout, "size": size, "chunk_bytes": exact, "max_chunk_bytes": bound,
            "chunk_limit": exact or bound or (size if per_buffer else chunk_limit_from_env()),
            "per_buffer": per_buffer, "min_chunk_bytes": _bytes(o["min_chunk_bytes"], "min_chunk_bytes"),
            "max_call_seconds": stall, "budget_yields_to": yields_to, "pin_nice": _pin_nice(o["pin_nice"], background),
            "reserve": _bytes(o["reserve"], "reserve"), "grow_step": _bytes(o["grow_step"], "grow_step"),
            "grows_with": grows_with,
        }, spelled=o["size"])  # fmt: skip

    def __post_init__(self, spelled: object) -> None:
        if not isinstance(self.background, bool):
            raise ConfigError(f"background={self.background!r} must be True or False")
        _check_plain(self)
        if self.num_pages is not None:
            if not positive_int(self.num_pages):
                raise ConfigError(
                    f"num_pages={shown(self.num_pages)} must be a positive int number of layout pages (pool.num_pages "
                    "of a pool to pair with), or None to size the pool by size= instead"
                )
            pages, page_bytes = self.num_pages, layout_page_bytes(self.layout)
            if self.size != pages * page_bytes:
                raise ConfigError(
                    f"PoolOptions(size={self.size!r}, num_pages={pages}): size must be num_pages * layout.page_bytes "
                    f"({pages} * {page_bytes}); give one of them (PoolOptions.create computes the size)"
                )
        for option in ("size", "max_chunk_bytes", "chunk_bytes"):
            _check_bytes(getattr(self, option), option)
        self._check_chunk_options()
        self._check_reserve()
        object.__setattr__(self, "buffers", self._fits_a_page(self.size if spelled is None else spelled))
        self._check_stall_budget()
        _check_bytes(self.min_chunk_bytes, "min_chunk_bytes")
        nice = self.pin_nice
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= MAX_NICE:
            raise ConfigError(f"pin_nice={shown(nice)}: {_PIN_NICE_FIX}")
        object.__setattr__(self, "retry_codes", _retry_codes(self.retry_codes))
        retries = self.max_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise ConfigError(
                f"max_retries={shown(retries)} must be an int from 0 to {MAX_RETRIES}: how many times one planned "
                "registration may be halved, level after level (0 never retries; the default "
                f"{DEFAULT_MAX_RETRIES} lets halving reach one 4 KiB page from 16 TiB; {MAX_RETRIES} halvings "
                "already reach one byte from any size an address space holds)"
            )

    def _check_chunk_options(self) -> None:
        bound = self.max_chunk_bytes
        if not isinstance(self.per_buffer, bool):
            raise ConfigError(f"per_buffer={self.per_buffer!r} must be True or False")
        if self.per_buffer and self.chunk_bytes is not None:
            raise ConfigError(
                f"per_buffer=True with chunk_bytes={self.chunk_bytes!r}: one registration per buffer has no chunk "
                "size; give one of them"
            )
        if self.chunk_bytes is not None and bound is not None and self.chunk_bytes > bound:
            raise ConfigError(
                f"chunk_bytes={shown(self.chunk_bytes)} ({format_bytes(self.chunk_bytes)}) is more than "
                f"max_chunk_bytes={shown(bound)} ({format_bytes(bound)}): chunk_bytes is the exact size of every "
                "registration call and max_chunk_bytes its upper bound; give chunk_bytes <= max_chunk_bytes, or "
                "only one of them"
            )
        if self.chunk_bytes is not None or bound is not None:
            object.__setattr__(self, "chunk_limit", self.chunk_bytes or bound)
        limit = self.chunk_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ConfigError(f"chunk_limit={limit!r} must be a positive int number of bytes")

    def _check_reserve(self) -> None:
        _check_bytes(self.grow_step, "grow_step")
        reserve = self.reserve
        if reserve is None:
            return
        _check_bytes(reserve, "reserve")
        if reserve <= self.size:
            raise ConfigError(
                f"reserve={shown(reserve)} ({format_bytes(reserve)}) is not more than size={shown(self.size)} "
                f"({format_bytes(self.size)}): reserve= is the most an elastic pool may grow to and size= what it "
                "pins at entry; give reserve= > size=, or reserve=None for a fixed pool"
            )
        if self.per_buffer:
            raise ConfigError(
                f'reserve={shown(reserve)} with chunk_bytes="{PER_BUFFER}": an elastic pool pins and gives back whole '
                "chunks of some pages, and one registration per buffer is never cut; drop one of them"
            )

    def reservation(self) -> PoolOptions:
        """These options sized at the whole reservation (what is mapped and planned), as a fixed pool's."""
        assert self.reserve is not None
        return dataclasses.replace(self, size=self.reserve, num_pages=None, reserve=None)

    def growing(self) -> PoolOptions:
        """The options a grow's sessions pin with: those given, and where one was left "auto", a background
        pool's (its stall budget and priority): an explicit ``pin_nice=0`` or ``max_call_seconds=None`` holds."""
        if self.grows_with is None:
            stall, yields_to, nice = self.max_call_seconds, self.budget_yields_to, self.pin_nice
        else:
            stall, yields_to, nice = self.grows_with
        return dataclasses.replace(self, background=True, max_call_seconds=stall, budget_yields_to=yields_to,
                                   pin_nice=nice)  # fmt: skip

    def _fits_a_page(self, given: object) -> tuple[BufferSpec, ...]:  # one page, one copy page of each buffer
        layout, budget = self.layout, self.size
        page_bytes, one_page, smallest = _smallest_pool(layout)
        if budget < smallest and self.num_pages is not None:
            raise ConfigError(
                f"num_pages={shown(self.num_pages)} ({shown(budget)} B) is smaller than one copy page of a buffer of "
                f"layout {layout.name!r} ({shown(smallest)} B = {format_bytes(smallest)}); give "
                f"num_pages={shown(-(-smallest // page_bytes))} or more"
            )
        if budget < smallest:
            raise ConfigError(
                f"size={shown(given)} ({shown(budget)} B) is smaller than one page of layout {layout.name!r} "
                f"({shown(smallest)} B = {format_bytes(smallest)}); give a size of at least {shown(smallest)} bytes"
            )
        pages = budget // page_bytes
        return one_page if pages == 1 else check_layout(layout, pages)

    def _check_stall_budget(self) -> None:
        budget, yields = self.max_call_seconds, self.budget_yields_to
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget < math.inf
        ):
            raise ConfigError(
                f"max_call_seconds={shown(budget)} must be a positive number of seconds, at most {MAX_CALL_SECONDS:g} "
                "(e.g. 0.02: no registration or populate call may hold the driver or mmap lock longer than 20 ms), "
                "or None for no budget"
            )
        if budget is not None and budget > MAX_CALL_SECONDS:
            raise ConfigError(
                f"max_call_seconds={shown(budget)} is more than {MAX_CALL_SECONDS:g} seconds: a stall budget bounds "
                "how long one call may hold the driver or mmap lock (e.g. 0.02 for 20 ms); give at most "
                f"{MAX_CALL_SECONDS:g}, or None for no budget"
            )
        if self.per_buffer and budget is not None:
            raise ConfigError(
                f'max_call_seconds={shown(budget)} with chunk_bytes="{PER_BUFFER}": one registration per buffer cannot '
                'be cut to fit a stall budget; give max_call_seconds=None (or "auto", which gives such a pool none), '
                "or chunk sizes that may be cut (chunk_bytes= or max_chunk_bytes=)"
            )
        if yields not in (None, "chunk_bytes", "max_chunk_bytes") or (yields and getattr(self, yields) is None):
            raise ConfigError(f"budget_yields_to={yields!r}: None or a chunk option given; PoolOptions.create sets it")
        if self.chunk_bytes is not None and budget is not None and yields is None:
            raise ConfigError(
                f"chunk_bytes={shown(self.chunk_bytes)} ({format_bytes(self.chunk_bytes)}) makes every registration "
                f"exactly that size, and max_call_seconds={shown(budget)} would cut them into pieces "
                "that fit the stall budget; give max_chunk_bytes= instead of chunk_bytes= (an upper bound the budget "
                'may cut further), or max_call_seconds=None (or "auto": the budget then yields to chunk_bytes for '
                "registrations)"
            )


# create's signature, for help(): the declared options, keyword-only.
PoolOptions.create.__func__.__signature__ = keyword_signature(["cls"], _CREATE, "PoolOptions")  # type: ignore[attr-defined]


def _size(layout: Layout, size: object, pages: object) -> Any:
    if (size is None) == (pages is None):
        both = f"both were given (size={shown(size)}, num_pages={shown(pages)})"
        raise ConfigError(f"size= or num_pages=: {'neither was given' if size is None else both}; {_SIZE_OR_PAGES_FIX}")
    if pages is None:
        return _bytes(size, "size")
    return pages * layout_page_bytes(layout) if positive_int(pages) and is_layout(layout) else None


def _stall_budget(stall: object, background: bool, exact: object, bound: object) -> tuple[Any, str | None]:
    """``max_call_seconds`` with ``"auto"`` resolved, and the chunk option an ``"auto"`` budget yields to."""
    if not isinstance(stall, str):
        return stall, None
    if stall != "auto":
        raise ConfigError(
            f"max_call_seconds={stall!r} must be a number of seconds, None (no budget) or "
            '"auto" (the default: 50 ms for a background pool, none otherwise)'
        )
    if not background:
        return None, None
    yields_to = "chunk_bytes" if exact is not None else "max_chunk_bytes" if bound is not None else None
    return BACKGROUND_MAX_CALL_SECONDS, yields_to


def _pin_nice(nice: object, background: bool) -> Any:
    if isinstance(nice, str) and nice != "auto":
        raise ConfigError(f"pin_nice={shown(nice)}: {_PIN_NICE_FIX}")
    if nice == "auto":
        return BACKGROUND_PIN_NICE if background else 0
    return 0 if nice is None else nice


def _check_bytes(value: object, option: str) -> None:
    if isinstance(value, str):
        raise ConfigError(f"{option}={value!r}: PoolOptions takes bytes; use PoolOptions.create for strings")
    if value is not None:
        parse_size(value, what=option)


def _retry_codes(codes: object) -> frozenset[int] | None:
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


def _check_plain(o: PoolOptions) -> None:
    require_layout(o.layout)
    if not isinstance(o.name, str) or not o.name:
        raise ConfigError(f"name={o.name!r} must be a non-empty str (it labels the pool's logs and metrics)")
    if o.populate is not None and not isinstance(o.populate, bool):
        raise ConfigError(f"populate={o.populate!r} must be True, False or None (the default: on where supported)")
    if not isinstance(o.huge_pages, bool | str) or o.huge_pages not in HUGE_PAGES:
        raise ConfigError(
            f"huge_pages={o.huge_pages!r} must be False, True (transparent huge pages) or 'hugetlb' "
            "(2 MiB pages reserved in vm.nr_hugepages; also spelled 'hugetlb:2MiB'), or 'hugetlb:1GiB' "
            "(1 GiB pages reserved with hugepagesz=1G hugepages=N on the kernel command line)"
        )
    for option in ("populate_workers", "register_workers", "unpin_workers"):
        value = getattr(o, option)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{option}={shown(value)} must be a positive int (or None for the default)")
        if value is not None and value > MAX_WORKERS:
            raise ConfigError(
                f"{option}={shown(value)} is more than {MAX_WORKERS} threads; give at most {MAX_WORKERS} "
                "(a few per core is plenty), or None for the default (sized from the CPUs)"
            )
    numa = o.numa_node
    if numa is not None and (isinstance(numa, bool) or not isinstance(numa, int) or not 0 <= numa < MAX_NUMA_NODES):
        raise ConfigError(
            f"numa_node={shown(numa)} is not a NUMA node number; give a node's int id, from 0 to "
            f"{MAX_NUMA_NODES - 1} (numactl -H lists them), or None to let the kernel place the memory"
        )
