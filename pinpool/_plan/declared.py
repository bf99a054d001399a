"""A pool's options, declared once in :data:`OPTIONS`: the signatures, the request and its typed keywords,
``PoolOptions.create``, the flags and docs/options.md follow it. Standard library only (the CLI must not
import torch)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# 32 halvings reach one 4 KiB page from 16 TiB: the floor (min_chunk_bytes) ends halving first.
DEFAULT_MAX_RETRIES = 32
# chunk_bytes= that asks for one registration per buffer (ROCm kernels address a pool from one base).
PER_BUFFER = "buffer"


class _Default:
    """A default that is an object this module cannot import (prometheus_client's registry)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


DEFAULT_REGISTRY = _Default("prometheus_client.REGISTRY")
_SAME = _Default("the same")

# How the command line reads an option's text: each kind's reader and argparse action are pinpool._cli.options's.
KINDS = frozenset("layout size chunk int codes seconds nice text runtime huge_pages bool switch".split())


@dataclass(frozen=True)
class Flag:
    """How the command line spells an option: its ``kind``, the ``commands`` taking it, a ``default`` of its own."""

    flag: str
    kind: str
    metavar: str | None = None
    commands: tuple[str, ...] = ("pin", "plan")
    default: str | None = None
    note: str = ""

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


# Where the request (pinpool._pool.request) hands an option, and so where it is checked:
OPTIONS_HOME = "options"  # PoolOptions.create and the dataclass's checks (pinpool._plan.options)
PACING = "pacing"  # NodePacing.from_options (pinpool._node.config)
SOURCE = "source"  # pin()'s tensor: its layout (TensorLayout, pinpool._pin.memory_source)
REQUEST = "request"  # a field of PoolRequest, checked there (the runtime: when the pool resolves it)


@dataclass(frozen=True)
class Option:
    """One pool option: ``type`` its annotation; without a ``flag`` or ``pin``, ``no_flag`` and ``no_pin`` say
    why; ``home``: what checks its value; ``shown_default``: the docs' spelling where ``repr``'s is poor."""

    name: str
    type: str
    default: object
    help: str
    flag: Flag | None = None
    no_flag: str = ""
    pool: bool = True
    pin: bool = True
    no_pin: str = ""
    pin_default: object = _SAME
    home: str = OPTIONS_HOME
    shown_default: str | None = None

    def __post_init__(self) -> None:
        assert (self.flag is None) == bool(self.no_flag), f"{self.name}: a flag, or why there is none"
        assert self.pin or self.no_pin, f"{self.name}: say why pin() does not take it"
        assert self.flag is None or self.flag.kind in KINDS, f"{self.name}: unknown kind {self.flag.kind!r}"
        assert self.home in (OPTIONS_HOME, PACING, SOURCE, REQUEST), f"{self.name}: unknown home {self.home!r}"

    @property
    def create(self) -> bool:  # PoolOptions.create takes it
        return self.home == OPTIONS_HOME

    @property
    def default_for_pin(self) -> object:
        return self.default if self.pin_default is _SAME else self.pin_default

    def shown(self, value: object = _SAME) -> str:
        value = self.default if value is _SAME else value
        return self.shown_default if value is self.default and self.shown_default is not None else repr(value)


_TENSOR = "the tensor decides"

OPTIONS: tuple[Option, ...] = (
    Option("granularity_bytes", "int | None", None,
        "copy-page size of the tensor: chunk boundaries are multiples of it from the tensor's start",
        no_flag="pin() only (the command line's --layout raw --granularity does the same)", pool=False, home=SOURCE),
    Option("ranges", "Sequence[tuple[int, int]] | None", None,
        "pin only these (offset, nbytes) byte ranges, each its own registration (None: all, row by row if strided)",
        no_flag="pin() only: byte ranges of a tensor you give", pool=False, home=SOURCE),
    Option("layout", "Layout | None", None,
        "what the memory holds: a layout from pinpool.layouts (None: Raw(), plain bytes)",
        flag=Flag("--layout", "layout", "FAMILY"), pin=False, no_pin=_TENSOR),
    Option("size", "int | str | None", None,
        "byte budget, an int or a size string such as 64GiB, 1.5TiB, 512MB: the pool holds the whole pages that fit",
        flag=Flag("--size", "size", "SIZE", commands=("pin", "plan", "doctor"), default="4GiB",
                  note="(pin and plan: default 4GiB unless --num-pages; doctor: the size to check the host against)"),
        pin=False, no_pin=_TENSOR),
    Option("num_pages", "int | None", None,
        "instead of size: exactly this many layout pages (paired pools, e.g. MLA and its Indexer, get the same count)",
        flag=Flag("--num-pages", "int", "N"), pin=False, no_pin=_TENSOR),
    Option("reserve", "int | str | None", None,
        "an elastic pool: the largest size it may grow to, mapped once (size= is then its floor, pinned at entry "
        "until exit); pool.grow() pins more of it and pool.shrink() gives pages back (None: a fixed pool)",
        flag=Flag("--reserve", "size", "SIZE"), pin=False, no_pin="a caller's tensor cannot grow"),
    Option("grow_step", "int | str", "1GiB",
        "an elastic pool's segment: the unit it grows and shrinks by, rounded up to whole chunks of every buffer",
        flag=Flag("--grow-step", "size", "SIZE"), pin=False, no_pin="a caller's tensor cannot grow"),
    Option("elastic", "ElasticPolicy | None", None,
        "an elastic pool's policy loop (needs reserve= and on_give_up=): a thread that shrinks the pool under memory "
        "pressure and grows it when the server asks (pool.want()) or memory is free (None: grow and shrink by hand)",
        no_flag="Python-only: the loop asks the server's on_give_up which pages to give back", pin=False,
        no_pin="a caller's tensor cannot grow", home=REQUEST),
    Option("on_give_up", "Callable[[int], Sequence[range] | None] | None", None,
        "the policy loop asks it, under pressure, for pages worth nbytes the server no longer uses: it returns page "
        "ranges (the tail, or runs its allocator freed) or []/None to give nothing; called on the loop's thread",
        no_flag="Python-only: a callback of the server", pin=False, no_pin="a caller's tensor cannot grow",
        home=REQUEST),
    Option("pressure", "PressureSource | None", None,
        "where the policy loop reads memory pressure (None: the host's: PSI and cgroup v1 notifications where they "
        "can be armed, else a reading every read_interval_seconds)",
        no_flag="Python-only: a test injects readings (pinpool.testing.FakePressure)", pin=False,
        no_pin="a caller's tensor cannot grow", home=REQUEST),
    Option("memory", "SharedMemory | None", None,
        "where the memory comes from: None maps private anonymous memory; a pinpool.SharedMemory maps a shared file",
        no_flag="Python-only: a SharedMemory object", pin=False, no_pin="the tensor is the memory", home=REQUEST),
    Option("runtime", "str | Runtime", "auto",
        "what pins: auto (ROCm or CUDA with a GPU, else mlock), cuda, rocm, mlock, or a runtime object",
        flag=Flag("--runtime", "runtime", note="(names only: a runtime object is Python-only; fake is "
                  "pinpool.testing.FakeRuntime, which pins nothing)"), home=REQUEST),
    Option("registrars", "Sequence[TransferRegistrar] | None", None,
        "transfer engines that register the pool too (pinpool.registrars: Mooncake, NIXL, your own), from the same "
        "aligned chunks, rolled back and torn down with it; pages are usable once every one holds them",
        no_flag="Python-only: registrars wrap a server's live engine objects", home=REQUEST),
    Option("chunk_bytes", "int | str | None", None,
        "exact size of every registration call (a buffer's last shorter), rounded down to the alignment unit, never "
        f"split or cut by an 'auto' budget; {PER_BUFFER!r}: one per buffer; None: up to the chunk limit, then split",
        flag=Flag("--chunk-bytes", "chunk", "SIZE|buffer")),
    Option("max_chunk_bytes", "int | str | None", None,
        "upper bound of one registration call, rounded down to the alignment unit: as few as it allows, never split "
        "or cut by an 'auto' stall budget (None: PINPOOL_REGISTER_CHUNK_GB GiB, else 256 GiB, split for the workers)",
        flag=Flag("--max-chunk-bytes", "size", "SIZE")),
    Option("populate", "bool | None", None,
        "pre-fault the memory on threads (MADV_POPULATE_WRITE), pipelined with registration (None: where it can)",
        flag=Flag("--populate", "bool")),
    Option("populate_workers", "int | None", None, "pre-fault threads (None: CPUs, up to 16)",
        flag=Flag("--populate-workers", "int", "N")),
    Option("register_workers", "int | None", None,
        "registration threads (None: 1 for CUDA, whose driver serialises registration; CPUs up to 8 otherwise)",
        flag=Flag("--register-workers", "int", "N")),
    Option("unpin_workers", "int | None", None,
        "unregistration threads, at exit and in a rollback (None: CPUs, up to 8)",
        flag=Flag("--unpin-workers", "int", "N")),
    Option("huge_pages", "bool | str", False,
        "True: transparent huge pages (2 MiB-aligned, MADV_HUGEPAGE); 'hugetlb' (or 'hugetlb:2MiB'): 2 MiB pages "
        "from vm.nr_hugepages; 'hugetlb:1GiB': 1 GiB pages reserved at boot (hugepagesz=1G hugepages=N)",
        flag=Flag("--huge-pages", "huge_pages", note="(thp for True, also when given alone; hugetlb; off: False)"),
        pin=False, no_pin="pinpool.empty(..., huge_pages=) takes it"),
    Option("numa_node", "int | None", None,
        "bind the memory to this NUMA node (mbind) before any of it is faulted (None: the kernel places it)",
        flag=Flag("--numa-node", "int", "N"), pin=False, no_pin="pinpool.empty(..., numa_node=) takes it"),
    Option("name", "str", "default",
        "the pool's name in logs, metrics and errors (low-cardinality: one per pool role)",
        flag=Flag("--name", "text", "NAME", default="cli", note="(default cli)"), pin_default="tensor"),
    Option("min_chunk_bytes", "int | str | None", None,
        "retried halves are never cut below this (None: one alignment unit, lcm(granularity, OS page))",
        flag=Flag("--min-chunk-bytes", "size", "SIZE")),
    Option("max_retries", "int", DEFAULT_MAX_RETRIES,
        "how many times a failed registration may be halved, level after level, on a retry code (0: never)",
        flag=Flag("--max-retries", "int", "N")),
    Option("retry_codes", "Collection[int] | None", None,
        "error codes that retry a registration as halves (None: the runtime's; CUDA, ROCm: 1 and 2; (): never)",
        flag=Flag("--retry-codes", "codes", "CODE,...")),
    Option("max_call_seconds", "float | str | None", "auto",
        "the stall budget: no registration or populate call is sized to last longer ('auto': 50 ms if background)",
        flag=Flag("--max-call-seconds", "seconds", "SECONDS|auto|none", note="(here none for None)")),
    Option("background", "bool", False,
        "enter at once and pin in the background, lowest pages first (pool.state, pinned_pages, wait_ready)",
        flag=Flag("--background", "switch", note="(pin waits until the pool is ready before it reports or holds)")),
    Option("pin_nice", "int | str | None", "auto",
        "how much nicer than the process pin workers run, 0 to 19 ('auto': 10 for a background pool, else 0; None: 0)",
        flag=Flag("--pin-nice", "nice", "N|auto")),
    Option("node_slots", "int | None", None,
        "node pacing: at most this many processes of this host pin at once (None: PINPOOL_NODE_SLOTS, else no limit)",
        flag=Flag("--node-slots", "int", "N"), home=PACING),
    Option("node_budget", "int | float | str | None", None,
        "node pacing: bytes all cooperating pools may hold pinned, a size or a fraction of MemTotal such as 0.8 "
        "(None: env PINPOOL_NODE_BUDGET, else no budget)",
        flag=Flag("--node-budget", "text", "SIZE|FRACTION"), home=PACING),
    Option("node_dir", "str | None", None,
        "node pacing's directory of flock-ed files (None: env PINPOOL_NODE_DIR, else /dev/shm/pinpool-<uid>)",
        flag=Flag("--node-dir", "text", "PATH"), home=PACING),
    Option("node_wait", "bool", True,
        "node pacing: wait for admission (True), or raise NodeBusyError at once (False)",
        flag=Flag("--node-wait", "bool"), home=PACING),
    Option("registry", "CollectorRegistry | None", DEFAULT_REGISTRY,
        "the prometheus_client registry the pool's metrics go to (None: no metrics)",
        no_flag="Python-only: the command line keeps its own (pin --metrics-port serves it)", home=REQUEST),
    Option("logger", "Any | None", None,
        "a structlog bound logger for the pool's events (None: structlog's if configured, else stdlib's)",
        no_flag="Python-only: the command line prints the pool's events on stderr", home=REQUEST),
    Option("on_progress", "ProgressCallback | None", None,
        "callable(pinned_bytes, total_bytes, chunks_done, chunks_total), called about every 100 ms and once at the end",
        no_flag="Python-only: the command line draws progress itself (pin --progress)", home=REQUEST),
)  # fmt: skip

assert len({o.name for o in OPTIONS}) == len(OPTIONS), "an option is declared twice"


def pool_options() -> Iterator[Option]:
    """What ``PinnedPool(...)`` takes, in its signature's order."""
    return (o for o in OPTIONS if o.pool)


def keyword_signature(
    first: Iterable[str], options: Iterable[Option], returns: str, *, for_pin: bool = False,
    registry: object = DEFAULT_REGISTRY,
) -> inspect.Signature:  # fmt: skip
    """help()'s signature: ``first``, then ``options`` keyword-only (with ``for_pin``, pin()'s defaults)."""
    keywords = []
    for o in options:
        default = o.default_for_pin if for_pin else o.default
        default = registry if default is DEFAULT_REGISTRY else default
        keywords.append(inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=o.type))
    positional = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in first]
    return inspect.Signature([*positional, *keywords], return_annotation=returns)
