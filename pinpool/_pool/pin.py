"""``pin(tensor)``: a caller's tensor pinned with PinnedPool's chunking and guarantees."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from prometheus_client import REGISTRY, CollectorRegistry

from .._errors import ConfigError
from .._host.mapping import alias_of
from .._pin.lifecycle import ProgressCallback
from .._plan.options import DEFAULT_MAX_RETRIES
from ..runtimes import Runtime
from .pool import PinnedPool


def pin(
    tensor: torch.Tensor,
    *,
    granularity_bytes: int | None = None,
    ranges: Sequence[tuple[int, int]] | None = None,
    runtime: str | Runtime = "auto",
    chunk_bytes: int | str | None = None,
    max_chunk_bytes: int | str | None = None,
    populate: bool | None = None,
    populate_workers: int | None = None,
    register_workers: int | None = None,
    unpin_workers: int | None = None,
    name: str = "tensor",
    min_chunk_bytes: int | str | None = None,
    max_retries: int = DEFAULT_MAX_RETRIES,
    retry_codes: Collection[int] | None = None,
    max_call_seconds: float | str | None = "auto",
    background: bool = False,
    pin_nice: int | str | None = "auto",
    node_slots: int | None = None,
    node_budget: int | float | str | None = None,
    node_dir: str | None = None,
    node_wait: bool = True,
    registry: CollectorRegistry | None = REGISTRY,
    logger: Any | None = None,
    on_progress: ProgressCallback | None = None,
) -> PinnedPool:
    """Pin a CPU tensor you allocated, with PinnedPool's chunking and guarantees.

    Use it as ``with pin(t) as pinned:`` or ``async with pin(t) as pinned:``; ``pinned.tensor``
    views ``t``'s memory, with its shape and dtype (``pinned.tensors["data"]``). It takes every
    option of :class:`PinnedPool` with the same meaning and default (``name`` excepted:
    ``"tensor"``), background pinning, the stall budget, node pacing and retries included,
    but not those the tensor decides (``layout``, ``size``, ``num_pages``, ``memory``,
    ``huge_pages``, ``numa_node``). Its pages are the tensor's rows along its first dimension
    (``pinned.num_pages == t.shape[0]``), so with ``background=True`` ``pinned.pinned_pages``
    and ``wait_ready(...)`` tell which leading rows are pinned. Chunk
    boundaries are multiples of ``granularity_bytes`` from the tensor's start, and on OS page
    boundaries where one of those multiples falls on a page; where none does (torch.empty's
    memory starts 64 B into a page), they are counted from the start and neighbouring chunks
    share the page around each boundary, on runtimes that track exact byte ranges (CUDA,
    mlock, FakeRuntime); elsewhere that is a :class:`ConfigError` (allocate with
    :func:`pinpool.empty`, which is page-aligned).

    Not all of it, where it is given so (each range its own registrations, chunked within it by
    the rule above from its own start, never merged with a neighbour; rolled back and unpinned
    like chunks; two ranges may share an OS page only where neighbouring chunks may): a strided
    view whose rows are contiguous (``region.view(rows, stride)[:, a:b]``: vLLM's worker slots)
    pins each row, and ``ranges=[(offset, nbytes), ...]`` (byte offsets into a contiguous
    tensor, any order, none overlapping) pins those ranges; ``pinned.tensor`` is the tensor as
    given, ``pinned.nbytes`` the bytes registered, and pages are still its rows along the first
    dimension (a row is pinned once every range in it is). A view whose rows are not contiguous,
    or overlap one another, is a :class:`ConfigError`.

    The caller's memory is never freed by pinpool, nor under it: pinpool holds ``t``'s storage
    while pinned, and points ``t`` at a non-resizable alias of it, so growing ``t`` with
    ``resize_`` raises instead of reallocating pinned memory; ``t`` gets its own storage back
    when the pool lets go of the memory. A tensor that overlaps memory already pinned (by
    pinpool, or locked by anyone under mlock) raises :class:`AlreadyPinnedError` on entry,
    with nothing changed.
    """
    given = dict(locals())  # every option by its declared name (pinpool._plan.declared), for _configure
    del given["tensor"]
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"pin(tensor={type(tensor).__name__}): expected a torch.Tensor")
    if tensor.device.type != "cpu":
        raise ConfigError(f"pin(tensor on {tensor.device}): only CPU tensors live in host memory")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise ConfigError("pin(tensor): the tensor has no elements, so there is nothing to pin")
    pool = PinnedPool.__new__(PinnedPool)
    # The pool plans and pins an alias of the tensor: the same bytes, whose address and size
    # nothing done to `tensor` from now on can change, and which keeps its storage alive.
    pool._configure(source=alias_of(tensor), **given)
    return pool
