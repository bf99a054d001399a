"""One byte budget for paired pools (:func:`share`: the most pages whose pools' mapped bytes fit it), and the
budget this host gives a rank (:func:`host_budget`: the pre-flight's own figures, so its pools pass it)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .. import _probe
from .._errors import ConfigError
from .._node.config import parse_fraction
from .._plan.declared import OPTIONS
from .._plan.facts import HostFacts
from .._plan.options import min_num_pages
from .._plan.preflight import place, resident_fit
from .._units import bytes_text, decimal_to_int, human, parse_size, shown
from ..layouts._spec import is_layout
from ..runtimes._registry import pinning_capabilities
from .request import pool_request

if TYPE_CHECKING:
    from ..layouts import Layout
    from .pool import PinnedPool

# torchrun (and torch.distributed.elastic) sets it in every worker: the ranks started on this machine.
RANKS_ENV = "LOCAL_WORLD_SIZE"
_FRACTION_HINT = 'a number in (0, 1] such as 0.8, or the strings "0.8" or "80%"'
# Pool options that say how the pools map their memory; the page count and the layout are share()'s.
_SHAPING = frozenset({"layout", "size", "num_pages"})
_POOL_OPTIONS = frozenset(o.name for o in OPTIONS if o.create) - _SHAPING


@dataclass(frozen=True)
class Shares:
    """Pools sized together by :func:`share`: one ``num_pages``, each pool's ``layouts`` and mapped ``bytes``."""

    budget: int
    num_pages: int
    layouts: Mapping[str, Layout]
    bytes: Mapping[str, int]
    options: Mapping[str, Any]

    @property
    def total_bytes(self) -> int:
        """The bytes all the pools map together: never more than ``budget``."""
        return sum(self.bytes.values())

    def pool(self, key: str, /, **options: Any) -> PinnedPool:
        """``PinnedPool(layout=layouts[key], num_pages=num_pages, name=key, ...)``; the sizing options stay."""
        if key not in self.layouts:
            raise ConfigError(f"Shares.pool({key!r}): no pool of that name was sized; give one of {list(self.layouts)}")
        for option in sorted(_SHAPING & set(options)):
            raise ConfigError(
                f"Shares.pool({key!r}, {option}=...): the shares give the layout and num_pages={self.num_pages}; "
                "drop it, or size the pools again with pinpool.share()"
            )
        for option, value in options.items():
            if option in self.options and value != self.options[option]:
                raise ConfigError(
                    f"Shares.pool({key!r}, {option}={value!r}): the pools were sized with "
                    f"{option}={self.options[option]!r}, which decides what they map; drop it, or size the pools "
                    "again with pinpool.share()"
                )
        from .pool import PinnedPool  # torch and anyio: only when a pool is built

        merged = {"name": key, **self.options, **options}
        return PinnedPool(layout=self.layouts[key], num_pages=self.num_pages, **merged)


def share(budget: int | str, layouts: Mapping[str, Layout], *, host: HostFacts | None = None, **options: Any) -> Shares:
    """The most pages for which the pools of ``layouts`` together map at most ``budget``; ``options`` decide what
    they map (passed on by :meth:`Shares.pool`), ``host`` the page sizes (probed by default). Maps nothing."""
    nbytes = parse_size(budget, what="budget")
    if not isinstance(layouts, Mapping) or not layouts:
        raise ConfigError(
            f"share(layouts={layouts!r}): give a non-empty mapping of pool names to layouts, "
            'e.g. {"kv": layouts.MLA(...), "indexer": layouts.Indexer(...)}'
        )
    for key, layout in layouts.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"share(layouts=...): pool name {key!r} must be a non-empty str")
        if not is_layout(layout):
            raise ConfigError(
                f"share(layouts=...): {key!r}: {layout!r} is not a layout; use one from pinpool.layouts, "
                "e.g. layouts.MLA(...)"
            )
    unknown = sorted(set(options) - _POOL_OPTIONS)
    if unknown:
        raise ConfigError(
            f"share(..., {unknown[0]}=...): not a pool option that decides what a pool maps "
            f"({'layouts= and the budget decide' if unknown[0] in _SHAPING else 'see docs/options.md'}); drop it"
        )
    facts = _probe.probe_host(torch_build=False) if host is None else host
    named = dict(layouts)

    def mapped(pages: int) -> dict[str, int]:  # the pools' requests, placed unchecked: arithmetic
        requests = {
            key: pool_request("share", {**options, "layout": layout, "num_pages": pages})
            for key, layout in named.items()
        }
        return {key: place(request.options, facts, check=False).mapping_bytes for key, request in requests.items()}

    least = max(min_num_pages(layout) for layout in named.values())
    smallest = mapped(least)
    if sum(smallest.values()) > nbytes:
        each = ", ".join(f"{key} {human(n)}" for key, n in smallest.items())
        raise ConfigError(
            f"budget={shown(budget)} ({bytes_text(nbytes)}) is smaller than the fewest pages of every pool together: "
            f"{least} page(s) map {bytes_text(sum(smallest.values()))} ({each}); give a budget of at least "
            f"{sum(smallest.values())} bytes, or fewer or smaller layouts"
        )
    # Mapped bytes grow with the page count and are at least its page_bytes: search between.
    low, high = least, max(least, nbytes // sum(layout.page_bytes for layout in named.values()))
    while low < high:
        middle = (low + high + 1) // 2
        if sum(mapped(middle).values()) <= nbytes:
            low = middle
        else:
            high = middle - 1
    return Shares(
        budget=nbytes, num_pages=low, layouts=MappingProxyType(named), bytes=MappingProxyType(mapped(low)),
        options=MappingProxyType(dict(options)),
    )  # fmt: skip


def host_budget(
    fraction: float | str = 0.8, *, reserve: int | str = "10GiB", ranks: int | None = None,
    runtime: object = "auto", host: HostFacts | None = None, environ: Mapping[str, str] | None = None,
) -> int:  # fmt: skip
    """This rank's byte budget: ``fraction`` of what this process may still make resident after ``reserve``,
    over the ``ranks`` of this machine, within RLIMIT_MEMLOCK; compute it before building any pool and size
    the pools with :func:`share` (docs/operations.md says each step)."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float | str):
        raise ConfigError(f"fraction={fraction!r} has type {type(fraction).__name__}; give {_FRACTION_HINT}")
    # An int is 1 (all of it) or out of range; parse_fraction reads ints as bytes, so as a float.
    spelled = float(fraction) if isinstance(fraction, int) and fraction.bit_length() < 64 else fraction
    share_of = parse_fraction(spelled, what="fraction", of="the available memory", hint=_FRACTION_HINT)
    if share_of is None:
        raise ConfigError(f"fraction={shown(fraction)} is not a fraction; give {_FRACTION_HINT}")
    held_back = 0 if reserve == 0 and not isinstance(reserve, bool) else parse_size(reserve, what="reserve")
    count = _ranks(ranks, os.environ if environ is None else environ)
    facts = _probe.probe_host() if host is None else host
    available = facts.memory_available
    if available is None:
        raise ConfigError(
            "host_budget(): the memory this process may still make resident is unknown (no MemAvailable in "
            "/proc/meminfo, no memory cgroup limit); give the budget in bytes to pinpool.share() instead"
        )
    if held_back >= available:
        raise ConfigError(
            f"reserve={shown(reserve)} ({bytes_text(held_back)}) leaves nothing of the {human(available)} this process "
            "may still make resident (the memory cgroup's room or MemAvailable, whichever is smaller); give a smaller "
            "reserve (reserve=0 for none), or free memory on the host"
        )
    node = decimal_to_int(share_of, available - held_back) or 0
    per_rank = node // count
    budget = resident_fit(per_rank, facts.page_size)  # what is left once its page tables are charged too
    caps = pinning_capabilities(runtime, facts)
    memlock = facts.memlock_soft
    if caps is not None and caps.charges_memlock and not facts.cap_ipc_lock and memlock is not None:
        budget = min(budget, max(0, memlock - facts.locked_bytes) // facts.page_size * facts.page_size)
    if budget < facts.page_size:
        raise ConfigError(
            f"host_budget(fraction={fraction!r}, reserve={shown(reserve)}, ranks={count}) leaves {human(budget)} "
            f"per rank (of {human(available)} available, {human(per_rank)} per rank before page tables and "
            "RLIMIT_MEMLOCK), less than one OS page; give a larger fraction, a smaller reserve, or fewer ranks"
        )
    return budget


def _ranks(ranks: object, environ: Mapping[str, str]) -> int:
    if ranks is not None:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ConfigError(
                f"ranks={shown(ranks)} must be a positive int: the processes on this machine that size pools from "
                f"its memory (e.g. the local tensor-parallel size), or None to read {RANKS_ENV}"
            )
        return ranks
    raw = environ.get(RANKS_ENV)
    if raw is None:
        return 1
    text = raw.strip(" \t\n")
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ConfigError(
            f"{RANKS_ENV}={raw!r} is not a positive integer: it should count the ranks started on this machine "
            f"(torchrun sets it); pass ranks= to host_budget(), or fix or unset {RANKS_ENV}"
        )
    return int(text)
