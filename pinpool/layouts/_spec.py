"""What a layout is (:class:`Layout`, :class:`BufferSpec`), the families' shared checks (one dtype
parser among them, which ``--layout-file`` uses too), and :func:`check_layout`; ``pinpool.layouts``
lends the public ones."""

from __future__ import annotations

import functools
import math
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeGuard, runtime_checkable

import torch

from .._errors import ConfigError, class_name, foreign_text
from .._units import shown


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a pool: ``granularity`` in bytes (``None``: any page-aligned split is safe), and
    ``page_runs``: the buffer is that many equal runs back to back, page *i* the *i*-th slice of each
    (``None``: its pages are usable only once all of it is pinned). docs/layouts.md, What every layout has."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    granularity: int | None
    page_runs: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@runtime_checkable
class Layout(Protocol):
    """What PinnedPool asks of a layout."""

    @property
    def name(self) -> str:
        """Short name for logs and metrics labels, e.g. ``"raw"`` or ``"mha/page_first"``."""
        ...

    @property
    def page_bytes(self) -> int:
        """Bytes one page occupies across all buffers; ``size=`` buys whole pages of this."""
        ...

    def buffers(self, num_pages: int) -> tuple[BufferSpec, ...]:
        """The buffers of a pool holding ``num_pages`` pages."""
        ...


LAYER_FIRST = "layer_first"
PAGE_FIRST = "page_first"
PAGE_FIRST_DIRECT = "page_first_direct"
PAGE_HEAD = "page_head"
PAGE_UNIFIED = "page_unified"  # SGLang 0.5.23: a page is one block, head groups outermost
PAGE_FIRST_KV_SPLIT = "page_first_kv_split"  # SGLang 0.5.23 MLA (Ascend): K, V (and indexer) buffers


def check_choice(family: str, layout: object, allowed: Sequence[str], why: str = "") -> str:
    if not isinstance(layout, str) or layout not in allowed:
        raise ConfigError(
            f"{family}(layout={layout!r}): choose one of {', '.join(map(repr, allowed))}" + (f" ({why})" if why else "")
        )
    return layout


def check_dim(family: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{family}({name}={value!r}): must be a positive int")
    return value


# Short names engines use (SGLang's --kv-cache-dtype, vLLM's) for torch's dtypes.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}  # fmt: skip
DTYPE_SPELLINGS = (
    "a torch.dtype or its name, such as bfloat16, float16, float32, float8_e4m3fn, uint8 "
    f"(or {', '.join(DTYPE_ALIASES)}; a leading 'torch.' is allowed)"
)


def parse_dtype(value: object) -> torch.dtype | None:
    """``value`` as a torch.dtype: one already, or its name or alias (:data:`DTYPE_ALIASES`); None if neither."""
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        return None
    name = value.removeprefix("torch.")
    dtype = getattr(torch, DTYPE_ALIASES.get(name, name), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def check_dtype(family: str, value: object, name: str = "dtype") -> torch.dtype:
    dtype = parse_dtype(value)
    if dtype is None:
        raise ConfigError(f"{family}({name}={value!r}): must be {DTYPE_SPELLINGS}")
    return dtype


def check_shape(family: str, name: str, value: object) -> tuple[int, ...]:
    dims = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
    if dims is None or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in dims):
        raise ConfigError(f"{family}({name}={value!r}): must be a tuple of non-negative ints")
    return dims


def check_granularity(family: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ConfigError(
            f"{family}(granularity_bytes={shown(value)}): the granularity must be a positive int number of bytes "
            "(the size of one copy page), or None for no alignment constraint"
        )


# -- custom layouts: every broken promise of the Layout protocol is a ConfigError -------------------

_PAGE_BYTES_FIX = "a layout's page_bytes must be a positive int: the bytes one page occupies across all its buffers"
_BUFFERS_FIX = "a layout's buffers(num_pages) must return a tuple of pinpool.layouts.BufferSpec"


def _describe_layout(layout: object) -> str:
    try:
        name = getattr(layout, "name", None)
    except Exception:  # a property that raises: the class is all there is to go by
        name = None
    kind = type(layout).__qualname__
    return f"layout {name!r} ({kind})" if isinstance(name, str) and name else f"layout {kind}"


def is_layout(layout: object) -> bool:
    """``isinstance(layout, Layout)``; what reading it raises becomes a ConfigError naming it."""
    try:
        return isinstance(layout, Layout)
    except Exception as exc:
        if not_its_fault(exc):
            raise
        what = _describe_layout(layout)
        fixes = {"name": "fix its name", "page_bytes": _PAGE_BYTES_FIX, "buffers": _BUFFERS_FIX}
        for attribute, fix in fixes.items():  # which one raised, to name it
            _layout_value(what, attribute, functools.partial(getattr, layout, attribute), fix)
        raise ConfigError(f"{what} raised {class_name(exc)} ({foreign_text(exc)}) when read as a layout") from exc


def require_layout(layout: object) -> None:
    if not is_layout(layout):
        raise ConfigError(f"layout={layout!r} is not a layout; use one from pinpool.layouts, e.g. layouts.Raw()")


def check_layout(layout: Layout, num_pages: int) -> tuple[BufferSpec, ...]:
    """Check what a layout promises, as a pool will, and return its buffers for ``num_pages`` pages; a broken
    promise raises the ConfigError ``PinnedPool(layout=...)`` would (docs/layouts.md, Custom layouts)."""
    if not positive_int(num_pages):
        raise ConfigError(f"check_layout(num_pages={num_pages!r}): give a positive int number of pages")
    require_layout(layout)
    layout_page_bytes(layout)
    return layout_buffers(layout, num_pages)


def layout_page_bytes(layout: Layout) -> int:
    what = _describe_layout(layout)
    name = _layout_value(what, "name", lambda: layout.name, "fix its name")
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{what}: name={name!r} must be a non-empty str (it labels the pool's logs and metrics); fix its name"
        )
    page_bytes = _layout_value(what, "page_bytes", lambda: layout.page_bytes, _PAGE_BYTES_FIX)
    if not positive_int(page_bytes):
        raise ConfigError(f"{what}: page_bytes={page_bytes!r}; {_PAGE_BYTES_FIX} (size= buys whole pages of it)")
    return page_bytes


def layout_buffers(layout: Layout, num_pages: int) -> tuple[BufferSpec, ...]:
    """``buffers(num_pages)``, checked: a non-empty tuple of valid, distinct BufferSpecs holding bytes."""
    what = _describe_layout(layout)
    # An absurd size is refused later (the address space); its page count must still print.
    call = f"buffers({num_pages if num_pages.bit_length() <= 128 else f'~2**{num_pages.bit_length() - 1}'})"
    specs = _layout_value(what, call, lambda: layout.buffers(num_pages), _BUFFERS_FIX)
    if isinstance(specs, str | bytes) or not isinstance(specs, tuple | list):
        raise ConfigError(f"{what}: {call} returned {specs!r}; {_BUFFERS_FIX}")
    if not specs:
        raise ConfigError(f"{what}: {call} returned no buffers; {_BUFFERS_FIX}, at least one")
    seen: set[str] = set()
    for spec in specs:
        _check_buffer_spec(f"{what}: {call}", spec, seen)
    if not sum(spec.nbytes for spec in specs):
        raise ConfigError(
            f"{what}: {call} hold no bytes at all (every shape has a zero dimension); "
            "give at least one buffer a non-empty shape"
        )
    return tuple(specs)


def positive_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _layout_value(what: str, attribute: str, read: Callable[[], object], fix: str) -> object:
    try:
        return read()
    except ConfigError:
        raise
    except Exception as exc:
        if not_its_fault(exc):
            raise
        raise ConfigError(f"{what}: {attribute} raised {class_name(exc)} ({foreign_text(exc)}); {fix}") from exc


def not_its_fault(exc: BaseException) -> bool:
    """Whether ``exc``, raised while a layout's code ran, is no mistake of the layout's, to pass through
    untouched: no memory or stack left, or raised by a signal handler that ran meanwhile (an alarm's)."""
    if isinstance(exc, MemoryError | RecursionError):
        return True
    handlers = {getattr(signal.getsignal(signum), "__code__", None) for signum in signal.valid_signals()}
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in handlers:
            return True
        tb = tb.tb_next
    return False


def _check_buffer_spec(where: str, spec: object, seen: set[str]) -> None:
    if not isinstance(spec, BufferSpec):
        raise ConfigError(f"{where} holds {spec!r}, not a BufferSpec; {_BUFFERS_FIX}")
    if not isinstance(spec.name, str) or not spec.name or spec.name in seen:
        problem = "repeats the name" if spec.name in seen else "has name"
        raise ConfigError(
            f"{where} {problem} {spec.name!r}; every buffer needs a distinct non-empty str name (pool.tensors[name])"
        )
    seen.add(spec.name)
    shape = spec.shape
    if not isinstance(shape, tuple) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ConfigError(f"{where}: buffer {spec.name!r} has shape={shape!r}; give a tuple of non-negative ints")
    if not isinstance(spec.dtype, torch.dtype):
        raise ConfigError(f"{where}: buffer {spec.name!r} has dtype={spec.dtype!r}; give a torch.dtype")
    granularity = spec.granularity
    if granularity is not None and not positive_int(granularity):
        raise ConfigError(
            f"{where}: buffer {spec.name!r} has granularity={granularity!r}; give a positive int number of bytes "
            "(one copy page: chunk boundaries fall on its multiples), or None for no alignment constraint"
        )
    runs = getattr(spec, "page_runs", None)
    if runs is not None and not positive_int(runs):
        raise ConfigError(
            f"{where}: buffer {spec.name!r} has page_runs={runs!r}; give a positive int, or None when the "
            "buffer's pages are usable only once all of it is pinned"
        )
