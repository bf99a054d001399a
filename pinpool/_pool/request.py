"""What a caller asked for, as one frozen value: :func:`pool_request` turns every entry point's keywords into a
:class:`PoolRequest`, each option checked by its declared home; entry points then place and plan it on the host."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from prometheus_client import REGISTRY, CollectorRegistry

from .._errors import ConfigError
from .._node.config import NodePacing
from .._pin.memory_source import TensorLayout, check_memory_source
from .._plan.declared import DEFAULT_REGISTRY, OPTIONS, OPTIONS_HOME, PACING, REQUEST, SOURCE, Option
from .._plan.options import PoolOptions
from ..registrars import check_registrars
from .follow import check_policy

if TYPE_CHECKING:
    import torch

    from .._pin.lifecycle import ProgressCallback
    from .._plan.elastic import ElasticPolicy
    from .._shared.memory import SharedMemory
    from ..layouts import Layout
    from ..registrars import TransferRegistrar
    from ..runtimes import Runtime
    from .follow import PressureSource


@dataclass(frozen=True)
class PoolRequest:
    """One pool as asked for: ``options``, ``pacing`` (None: not paced), ``runtime`` as given (resolved once
    placed), its ``memory`` or pin()'s ``source`` tensor, where it reports; it checks the fields it is home to."""

    options: PoolOptions
    pacing: NodePacing | None = None
    runtime: str | Runtime = "auto"
    memory: SharedMemory | None = None
    source: torch.Tensor | None = None
    registry: CollectorRegistry | None = None
    logger: Any | None = None
    on_progress: ProgressCallback | None = None
    registrars: Sequence[TransferRegistrar] | None = None
    elastic: ElasticPolicy | None = None
    on_give_up: Callable[[int], Sequence[range] | None] | None = None
    pressure: PressureSource | None = None

    def __post_init__(self) -> None:
        check_memory_source(self.memory, self.options)
        check_policy(self.elastic, self.on_give_up, self.pressure)
        if self.elastic is not None and self.options.reserve is None:
            raise ConfigError(
                "elastic= is the policy of an elastic pool: give reserve= (the most it may grow to) too, with size= "
                "its floor"
            )
        object.__setattr__(self, "registrars", check_registrars(self.registrars))
        if self.registry is not None and not isinstance(self.registry, CollectorRegistry):
            raise ConfigError(f"registry={self.registry!r} must be a prometheus_client CollectorRegistry, or None")
        if self.logger is not None and not callable(getattr(self.logger, "bind", None)):
            raise ConfigError(
                f"logger={self.logger!r} must be a structlog (bound) logger with .bind(); "
                "wrap a stdlib logger with structlog.wrap_logger or structlog.stdlib.get_logger"
            )
        if self.on_progress is not None and not callable(self.on_progress):
            raise ConfigError(f"on_progress={self.on_progress!r} must be callable(pinned, total, done, chunks)")


def pool_request(entry: str, given: Mapping[str, Any], *, source: torch.Tensor | None = None) -> PoolRequest:
    """The request ``entry`` (named by a TypeError for an option it does not take) was ``given``, the rest
    defaulted; with ``source`` (pin()'s tensor, which gives the layout and size) pin()'s options."""
    takes = [o for o in OPTIONS if (o.pin if source is not None else o.pool)]
    if unknown := sorted(given.keys() - {o.name for o in takes}):
        raise TypeError(f"{entry}() got an unexpected keyword argument {unknown[0]!r}")
    value = {o.name: given.get(o.name, _default(o, pin=source is not None)) for o in takes}

    def home(where: str) -> dict[str, Any]:
        return {o.name: value[o.name] for o in takes if o.home == where}

    options = home(OPTIONS_HOME)
    if source is not None:
        options["layout"] = TensorLayout(source, **home(SOURCE))
        options["size"] = source.numel() * source.element_size()
    return PoolRequest(
        PoolOptions.create(**options), NodePacing.from_options(**home(PACING)), source=source, **home(REQUEST)
    )


def _default(option: Option, *, pin: bool) -> object:
    default = option.default_for_pin if pin else option.default
    return REGISTRY if default is DEFAULT_REGISTRY else default


class _PinningArguments(TypedDict, total=False):
    """The keywords ``PinnedPool(...)`` and ``pin()`` share, typed for IDEs (a test holds them to :data:`OPTIONS`)."""

    runtime: str | Runtime
    registrars: Sequence[TransferRegistrar] | None
    chunk_bytes: int | str | None
    max_chunk_bytes: int | str | None
    populate: bool | None
    populate_workers: int | None
    register_workers: int | None
    unpin_workers: int | None
    name: str
    min_chunk_bytes: int | str | None
    max_retries: int
    retry_codes: Collection[int] | None
    max_call_seconds: float | str | None
    background: bool
    pin_nice: int | str | None
    node_slots: int | None
    node_budget: int | float | str | None
    node_dir: str | None
    node_wait: bool
    registry: CollectorRegistry | None
    logger: Any | None
    on_progress: ProgressCallback | None


class PoolArguments(_PinningArguments, total=False):
    """``PinnedPool(**options)``'s keywords."""

    layout: Layout | None
    size: int | str | None
    num_pages: int | None
    reserve: int | str | None
    grow_step: int | str
    memory: SharedMemory | None
    elastic: ElasticPolicy | None
    on_give_up: Callable[[int], Sequence[range] | None] | None
    pressure: PressureSource | None
    huge_pages: bool | str
    numa_node: int | None


class PinArguments(_PinningArguments, total=False):
    """``pin(tensor, **options)``'s keywords."""

    granularity_bytes: int | None
    ranges: Sequence[tuple[int, int]] | None
