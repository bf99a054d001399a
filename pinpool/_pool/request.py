"""What a caller asked for, as one frozen value: :func:`pool_request` turns every entry point's keywords into a
:class:`PoolRequest`, each option checked by its declared home; entry points then place and plan it on the host."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry

from .._errors import ConfigError
from .._node.config import NodePacing
from .._pin.memory_source import TensorLayout, check_memory_source
from .._plan.declared import DEFAULT_REGISTRY, OPTIONS, OPTIONS_HOME, PACING, REQUEST, SOURCE, Option
from .._plan.options import PoolOptions

if TYPE_CHECKING:
    import torch

    from .._pin.lifecycle import ProgressCallback
    from .._shared.memory import SharedMemory
    from ..runtimes import Runtime


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

    def __post_init__(self) -> None:
        check_memory_source(self.memory, self.options)
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
    for name in sorted(given.keys() - {o.name for o in takes}):
        raise TypeError(f"{entry}() got an unexpected keyword argument {name!r}")
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
